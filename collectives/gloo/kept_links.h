#pragma once

// Internal to the Gloo backend: the connections a communicator leaves to the next one of its
// name (docs/collectives.md, "Repair: kept connections"). Used by gloo/communicator.cc.
//
// A communicator that ends (it failed, was aborted, or was destroyed) with its connection to
// a peer intact leaves it here: the Gloo pair's socket and the two lanes, as one Link with an
// id both ends know. The next communicator of the same name and member id takes the links of
// the members it shares with this one, if the peer left the same link too (the members say
// which links they hold when they join), and connects only the pairs it has no link for.
// Before a kept link carries anything, each end writes a mark naming the new epoch and the
// link's id on each of its three sockets and reads the other end's, dropping everything before
// it: what an operation of an older epoch left unread or half written never reaches the new
// communicator.
//
// Thread safety: LinkPool is safe to use from any thread; resyncLinks is for one thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace sinew {
namespace collectives {
namespace gloo_backend {

// One member's connections to one peer. The descriptors are owned by whoever holds the Link
// (close() closes them).
struct Link {
  int peerWorker = -1;
  uint64_t id = 0;     // the same at both ends; never 0
  int pairFd = -1;     // the Gloo pair's connection
  int sendFd = -1;     // the lane this member sends on
  int recvFd = -1;     // the lane this member receives on
  int64_t epoch = -1;  // of the communicator that left it

  bool complete() const { return id != 0 && pairFd >= 0 && sendFd >= 0 && recvFd >= 0; }
  void close();
};

// The id of a link made now: a mix of the two ends' nonces of the Gloo pairs' set-up, in rank
// order (lower, higher), so both ends compute the same.
uint64_t linkId(uint64_t lowerNonce, uint64_t higherNonce);

// This process's kept links, by communicator name and member id. A forked child starts empty
// (the parent's descriptors it inherited are closed in it, so that they do not keep the
// parent's connections open).
class LinkPool {
 public:
  static LinkPool& instance();

  // Keeps `link` for the next communicator `name` of member `self`; one it replaces is closed.
  void put(const std::string& name, int self, Link link);
  // Takes the links of `self` in `name` to the workers of `peers` (the others are closed: the
  // next communicator of that name has no use for them), each of an epoch before `epoch`.
  // Links of other names left before `epoch - 1` are closed too (their epoch's successor did
  // not take them).
  std::map<int, Link> takeFor(const std::string& name, int self, const std::vector<int>& peers,
                              int64_t epoch);
  // How many links are kept (tests).
  size_t size() const;

 private:
  void forkCheckLocked();
  mutable std::mutex mu_;
  int pid_ = -1;
  // name + "\n" + self → peer worker → link
  std::map<std::string, std::map<int, Link>> links_;
};

// The counters a process's communicators add to (tests and the bench read them).
struct LinkCounters {
  int64_t connectionsMade = 0;  // sockets connected or accepted by set-ups (pairs and lanes)
  int64_t linksKept = 0;        // links a communicator took over from the one before
  int64_t bytesDropped = 0;     // bytes of older epochs read past by resyncLinks
};
LinkCounters linkCounters();
void countConnectionsMade(int64_t n);
void countLinksKept(int64_t n);

// Resynchronises `links` for `epoch`: on each socket writes the mark (epoch, id) and reads up
// to and including the other end's, dropping what comes before it, all side by side in one
// poll loop (so a socket whose send buffer is full of older bytes the other end drains does not
// stop the rest). Reads nothing past a mark. `tick` is called every 50 ms and may throw to give
// up. Returns an empty string, or why not (a link that broke, or one still unmarked at the
// deadline), with that link's peer worker in *failedPeerWorker.
std::string resyncLinks(const std::vector<Link*>& links, int64_t epoch,
                        std::chrono::steady_clock::time_point deadline,
                        const std::function<void()>& tick, int* failedPeerWorker);

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
