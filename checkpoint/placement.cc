#include "sinew/checkpoint/placement.h"

#include <algorithm>

#include "sinew/base/error.h"

namespace sinew {
namespace checkpoint {

ReplicaPlacement::ReplicaPlacement(std::vector<int> nodes, int m)
    : nodes_(std::move(nodes)), m_(m) {
  if (m_ < 1)
    SINEW_THROW(InvalidArgument, "ReplicaPlacement: replication m = ", m_, " must be >= 1");
  if (nodes_.empty()) SINEW_THROW(InvalidArgument, "ReplicaPlacement: nodes is empty");
  std::set<int> distinct;
  for (int node : nodes_) {
    if (!distinct.insert(node).second) {
      SINEW_THROW(InvalidArgument, "ReplicaPlacement: node ", node, " is listed twice");
    }
  }
  const int n = static_cast<int>(nodes_.size());
  holders_.assign(n, {});
  if (n <= m_) {
    // Everyone holds everything.
    groups_.push_back(nodes_);
    for (int i = 0; i < n; ++i) {
      holders_[i].push_back(nodes_[i]);
      for (int j = 0; j < n; ++j) {
        if (j != i) holders_[i].push_back(nodes_[j]);
      }
    }
    return;
  }
  const int full = n / m_;
  const int rem = n % m_;
  const int plainGroups = rem == 0 ? full : full - 1;
  for (int g = 0; g < plainGroups; ++g) {
    std::vector<int> members(nodes_.begin() + g * m_, nodes_.begin() + (g + 1) * m_);
    for (int i = 0; i < m_; ++i) {
      const int idx = g * m_ + i;
      holders_[idx].push_back(nodes_[idx]);
      for (int j = 0; j < m_; ++j) {
        if (j != i) holders_[idx].push_back(members[j]);
      }
    }
    groups_.push_back(std::move(members));
  }
  if (rem != 0) {
    hasRing_ = true;
    const int start = plainGroups * m_;
    const int ringSize = n - start;  // m + rem
    std::vector<int> ring(nodes_.begin() + start, nodes_.end());
    for (int i = 0; i < ringSize; ++i) {
      for (int d = 0; d < m_; ++d) holders_[start + i].push_back(ring[(i + d) % ringSize]);
    }
    groups_.push_back(std::move(ring));
  }
}

int ReplicaPlacement::indexOf(int node) const {
  auto it = std::find(nodes_.begin(), nodes_.end(), node);
  if (it == nodes_.end()) {
    SINEW_THROW(InvalidArgument, "ReplicaPlacement: node ", node, " is not in the placement");
  }
  return static_cast<int>(it - nodes_.begin());
}

const std::vector<int>& ReplicaPlacement::holders(int node) const {
  return holders_[indexOf(node)];
}

std::vector<int> ReplicaPlacement::peersOf(int node) const {
  const auto& h = holders(node);
  return std::vector<int>(h.begin() + 1, h.end());
}

std::vector<int> ReplicaPlacement::sourcesOf(int node) const {
  std::vector<int> out;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i] == node) continue;
    const auto& h = holders_[i];
    if (std::find(h.begin(), h.end(), node) != h.end()) out.push_back(nodes_[i]);
  }
  return out;
}

bool ReplicaPlacement::recoverable(const std::set<int>& dead) const {
  for (const auto& h : holders_) {
    bool anyAlive = false;
    for (int x : h) anyAlive = anyAlive || dead.count(x) == 0;
    if (!anyAlive) return false;
  }
  return true;
}

namespace {
double choose(int n, int k) {
  if (k < 0 || n < 0 || k > n) return 0;
  double r = 1;
  for (int i = 1; i <= k; ++i) r = r * (n - k + i) / i;
  return r;
}
}  // namespace

double groupPlacementFailureProbability(int n, int m, int k) {
  if (m < 1 || n % m != 0) {
    SINEW_THROW(InvalidArgument, "groupPlacementFailureProbability: m = ", m,
                " must be >= 1 and divide n = ", n);
  }
  const int groups = n / m;
  double sum = 0;
  for (int j = 1; j <= groups && j * m <= k; ++j) {
    double term = choose(groups, j) * choose(n - j * m, k - j * m);
    sum += (j % 2 == 1) ? term : -term;
  }
  return sum / choose(n, k);
}

}  // namespace checkpoint
}  // namespace sinew
