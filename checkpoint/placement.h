#pragma once

// ReplicaPlacement: Gemini's group placement of checkpoint replicas (docs/architecture.md section
// 5).
//
// The nodes, in the given order, form floor(N/m) groups of m consecutive nodes; every
// member of a group holds all of the group's shards. When m does not divide N, the last
// group and the remainder (m + N mod m nodes) form a ring instead, in which each node's
// shard is held by itself and the next m-1 nodes of the ring. So every shard lives in
// exactly m places (N < m: in all N). Recovery from RAM fails exactly when every holder
// of some shard is dead; for N divisible by m that is "all m members of some group".
//
// Thread safety: immutable after construction.

#include <cstdint>
#include <set>
#include <vector>

namespace sinew {
namespace checkpoint {

class ReplicaPlacement {
 public:
  // nodes: node ids in placement order (distinct). m >= 1.
  ReplicaPlacement(std::vector<int> nodes, int m);

  // Nodes that hold node's shard, node itself first.
  const std::vector<int>& holders(int node) const;
  // Nodes node sends its shard to (holders minus itself).
  std::vector<int> peersOf(int node) const;
  // Nodes whose shards node holds besides its own.
  std::vector<int> sourcesOf(int node) const;
  // Whether every shard still has a live holder when `dead` have failed.
  bool recoverable(const std::set<int>& dead) const;

  const std::vector<int>& nodes() const { return nodes_; }
  int replication() const { return m_; }
  // Groups of m nodes, then (if any) the ring, as the last entry.
  const std::vector<std::vector<int>>& groups() const { return groups_; }
  bool hasRing() const { return hasRing_; }

 private:
  std::vector<int> nodes_;
  int m_;
  std::vector<std::vector<int>> groups_;
  bool hasRing_ = false;
  std::vector<std::vector<int>> holders_;  // Indexed like nodes_.
  int indexOf(int node) const;
};

// Gemini's analysis for N divisible by m: the probability that k simultaneous node
// failures lose some shard under group placement, by inclusion–exclusion:
// sum_{j>=1} (-1)^{j+1} C(N/m, j) C(N - j m, k - j m) / C(N, k).
double groupPlacementFailureProbability(int n, int m, int k);

}  // namespace checkpoint
}  // namespace sinew
