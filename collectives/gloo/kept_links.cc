#include "sinew/collectives/gloo/kept_links.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "sinew/base/little_endian.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {
namespace {

std::atomic<int64_t> gConnectionsMade{0};
std::atomic<int64_t> gLinksKept{0};
std::atomic<int64_t> gBytesDropped{0};

// The mark: "SNWKEEP1", the new epoch, the link's id (little-endian, 8 bytes each).
constexpr size_t kMarkBytes = 24;
constexpr char kMarkMagic[9] = "SNWKEEP1";
constexpr std::chrono::milliseconds kSlice{50};

std::array<uint8_t, kMarkBytes> mark(int64_t epoch, uint64_t id) {
  std::array<uint8_t, kMarkBytes> m{};
  std::memcpy(m.data(), kMarkMagic, 8);
  ::sinew::detail::storeLe(m.data() + 8, static_cast<uint64_t>(epoch), 8);
  ::sinew::detail::storeLe(m.data() + 16, id, 8);
  return m;
}

std::string key(const std::string& name, int self) { return name + "\n" + std::to_string(self); }

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One socket of a link being resynchronised.
struct Socket {
  int fd = -1;
  int peerWorker = -1;
  std::array<uint8_t, kMarkBytes> out{};
  size_t sent = 0;
  bool found = false;
  bool stalled = false;  // what is there may be the beginning of the mark
  std::string error;
};

// Writes what is left of s's mark without waiting.
void writeSome(Socket& s) {
  while (s.sent < kMarkBytes) {
    const ssize_t rv =
        ::send(s.fd, s.out.data() + s.sent, kMarkBytes - s.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (rv > 0) {
      s.sent += static_cast<size_t>(rv);
    } else if (rv < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else if (rv < 0 && errno == EINTR) {
      continue;
    } else {
      s.error = std::string("writing the mark: ") + std::strerror(errno);
      return;
    }
  }
}

// Reads past what precedes the other end's mark `want`, and the mark, without waiting and
// without reading a byte after it: what is there is peeked, and only bytes that cannot begin
// the mark, or the mark itself, are taken. Sets s.stalled when all that is there may be the
// mark's beginning (the rest is still to come).
void readSome(Socket& s, const std::array<uint8_t, kMarkBytes>& want) {
  std::array<uint8_t, 64 * 1024> buf;
  s.stalled = false;
  while (!s.found) {
    const ssize_t rv = ::recv(s.fd, buf.data(), buf.size(), MSG_PEEK | MSG_DONTWAIT);
    if (rv == 0) {
      s.error = "the connection was closed";
      return;
    }
    if (rv < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR) continue;
      s.error = std::string("reading: ") + std::strerror(errno);
      return;
    }
    const auto n = static_cast<size_t>(rv);
    const uint8_t* begin = buf.data();
    const uint8_t* end = begin + n;
    const uint8_t* at = std::search(begin, end, want.data(), want.data() + kMarkBytes);
    size_t take;
    if (at != end) {
      take = static_cast<size_t>(at - buf.data()) + kMarkBytes;
      s.found = true;
      gBytesDropped.fetch_add(static_cast<int64_t>(take - kMarkBytes));
    } else {
      // The longest tail that may begin the mark stays for the next look.
      size_t keep = std::min(n, kMarkBytes - 1);
      while (keep > 0 && std::memcmp(end - keep, want.data(), keep) != 0) --keep;
      take = n - keep;
      if (take == 0) {
        s.stalled = true;
        return;
      }
      gBytesDropped.fetch_add(static_cast<int64_t>(take));
    }
    size_t got = 0;
    while (got < take) {
      const ssize_t r = ::recv(s.fd, buf.data(), take - got, MSG_DONTWAIT);
      if (r > 0) {
        got += static_cast<size_t>(r);
      } else if (r < 0 && errno == EINTR) {
        continue;
      } else {
        s.error = "reading: the peeked bytes are gone";  // Nothing else reads this socket.
        return;
      }
    }
  }
}

}  // namespace

void Link::close() {
  for (int* fd : {&pairFd, &sendFd, &recvFd}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

uint64_t linkId(uint64_t lowerNonce, uint64_t higherNonce) {
  uint64_t id = splitmix(splitmix(lowerNonce) ^ higherNonce);
  return id == 0 ? 1 : id;
}

LinkPool& LinkPool::instance() {
  static LinkPool* pool = new LinkPool;  // Never destroyed: no order at exit to get wrong.
  return *pool;
}

void LinkPool::forkCheckLocked() {
  if (pid_ == ::getpid()) return;
  if (pid_ != -1) {
    for (auto& [k, byPeer] : links_) {
      for (auto& [peer, link] : byPeer) link.close();
    }
  }
  links_.clear();
  pid_ = ::getpid();
}

void LinkPool::put(const std::string& name, int self, Link link) {
  std::lock_guard<std::mutex> lock(mu_);
  forkCheckLocked();
  auto& slot = links_[key(name, self)][link.peerWorker];
  slot.close();
  slot = link;
}

std::map<int, Link> LinkPool::takeFor(const std::string& name, int self,
                                      const std::vector<int>& peers, int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  forkCheckLocked();
  std::map<int, Link> out;
  // Links of other names that the epoch after theirs did not take (a gradient group whose
  // layer range changed, say) are closed: their name may never be built again.
  for (auto other = links_.begin(); other != links_.end();) {
    if (other->first == key(name, self)) {
      ++other;
      continue;
    }
    for (auto l = other->second.begin(); l != other->second.end();) {
      if (l->second.epoch < epoch - 1) {
        l->second.close();
        l = other->second.erase(l);
      } else {
        ++l;
      }
    }
    other = other->second.empty() ? links_.erase(other) : std::next(other);
  }
  auto it = links_.find(key(name, self));
  if (it == links_.end()) return out;
  for (auto& [peer, link] : it->second) {
    const bool wanted = std::find(peers.begin(), peers.end(), peer) != peers.end();
    if (wanted && link.epoch < epoch && link.complete()) {
      out.emplace(peer, link);
    } else {
      link.close();
    }
  }
  links_.erase(it);
  return out;
}

size_t LinkPool::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (pid_ != ::getpid()) return 0;
  size_t n = 0;
  for (const auto& [k, byPeer] : links_) n += byPeer.size();
  return n;
}

LinkCounters linkCounters() {
  return {gConnectionsMade.load(), gLinksKept.load(), gBytesDropped.load()};
}

void countConnectionsMade(int64_t n) { gConnectionsMade.fetch_add(n); }

void countLinksKept(int64_t n) { gLinksKept.fetch_add(n); }

std::string resyncLinks(const std::vector<Link*>& links, int64_t epoch,
                        std::chrono::steady_clock::time_point deadline,
                        const std::function<void()>& tick, int* failedPeerWorker) {
  std::vector<Socket> sockets;
  for (Link* l : links) {
    for (int fd : {l->pairFd, l->sendFd, l->recvFd}) {
      Socket s;
      s.fd = fd;
      s.peerWorker = l->peerWorker;
      s.out = mark(epoch, l->id);
      sockets.push_back(s);
    }
  }
  auto lastTick = std::chrono::steady_clock::now();
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Socket*> polled;
    bool stalled = false;
    for (Socket& s : sockets) {
      if (s.sent < kMarkBytes) writeSome(s);
      if (s.error.empty() && !s.found) readSome(s, s.out);  // Both ends write the same mark.
      if (!s.error.empty()) {
        if (failedPeerWorker) *failedPeerWorker = s.peerWorker;
        return "worker " + std::to_string(s.peerWorker) + "'s kept connection: " + s.error;
      }
      short events = 0;
      if (s.sent < kMarkBytes) events |= POLLOUT;
      if (!s.found && !s.stalled) events |= POLLIN;
      if (!s.found && s.stalled) events |= POLLRDHUP;  // The rest of the mark, or a hang-up.
      stalled = stalled || s.stalled;
      if (events != 0 || s.stalled) {
        fds.push_back({s.fd, events, 0});
        polled.push_back(&s);
      }
    }
    if (fds.empty()) return {};
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      if (failedPeerWorker) *failedPeerWorker = polled.front()->peerWorker;
      return "worker " + std::to_string(polled.front()->peerWorker) +
             "'s kept connection: no mark of epoch " + std::to_string(epoch) + " in time";
    }
    if (now - lastTick >= kSlice) {
      tick();
      lastTick = now;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    int ms = static_cast<int>(std::min<int64_t>(left.count() + 1, kSlice.count()));
    if (stalled) ms = 1;  // The rest of a mark is on its way; look again shortly.
    if (::poll(fds.data(), fds.size(), ms) < 0 && errno != EINTR) {
      if (failedPeerWorker) *failedPeerWorker = -1;
      return std::string("poll: ") + std::strerror(errno);
    }
    // A socket whose data may be the start of a mark never reads as closed (its bytes are
    // only peeked): a hang-up there is the other end gone mid-mark.
    for (size_t i = 0; i < fds.size(); ++i) {
      if (polled[i]->stalled && (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        if (failedPeerWorker) *failedPeerWorker = polled[i]->peerWorker;
        return "worker " + std::to_string(polled[i]->peerWorker) +
               "'s kept connection was closed before its mark arrived";
      }
    }
  }
}

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
