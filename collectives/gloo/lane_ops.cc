// The Gloo backend's operations on the lanes (gloo/gloo_communicator.h; docs/collectives.md,
// "Lanes"): the two-member allreduce, and point to point, exchange and barrier, which are one
// implementation (exchangeOnLanes). Every message is a LaneFrame and its payload, moved by the
// calling thread with non-blocking socket calls and poll(); a deadline or abort() wakes the poll
// through the lanes' wake descriptor, and a broken lane goes to onPairError like a Gloo pair's,
// which waits for the peer's watcher to name the cause.

#include <ATen/ATen.h>

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "sinew/base/error.h"
#include "sinew/collectives/gloo/gloo_communicator.h"
#include "sinew/collectives/gloo/reduce.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {
namespace {

// The two-member allreduce's receive ring, small enough to stay in the L2 cache between the
// recv and the add (a 2 MiB ring made every size about half as fast); the most one send call
// moves, for every kind of message (each receive call asks for the ring's free space, or the
// rest of a point-to-point message); the most one add covers; how long an allreduce with
// nothing to do spins before it sleeps in poll(). Send calls of 512 KiB against 32 KiB: the
// two-member allreduce at or above MPI over TCP at every size from 1 to 64 MiB in eight of ten
// runs against none of eight, and the pipeline bench's 16 MiB activation transfer 4.4-6.0 ms
// against 5.8-7.2 (bench/RESULTS.md, "Call sizes, again").
constexpr size_t kLaneScratchBytes = 128 << 10;
constexpr size_t kLaneSendCallBytes = 512 << 10;
constexpr size_t kLaneReduceBytes = 128 << 10;
constexpr std::chrono::microseconds kLaneSpin{200};

// A spin-wait hint to the CPU (x86 PAUSE): lets a hyperthread sibling run.
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

// Two members: one exchange over the lane instead of the ring's two phases. Each member sends
// a frame (kind kAllreduce, dtype, operation number, bytes) and its whole tensor, and receives the
// other's into a ring of scratch bytes, all from this thread with non-blocking socket calls and
// poll(); every received byte is added into the tensor once the same byte of the tensor has been
// sent, so the reduction overlaps the rest of the transfer and scratch stays at kLaneScratchBytes
// whatever the tensor. a + b and b + a are the same float, so both members end with identical
// bytes. A member blocks only while it can neither send (the peer's receive buffer is full) nor
// receive (its scratch is full of bytes it has not sent yet); both cannot hold at once on both
// members, so the exchange never deadlocks. Failures: a deadline or abort() wakes the poll through
// the lanes' eventfd; a broken connection goes to onPairError like a Gloo pair's, which waits for
// the watcher's verdict to name the cause.
void GlooCommunicator::allreduceTwo(at::Tensor& t, std::chrono::milliseconds timeout) {
  const size_t esize = t.element_size();
  const size_t bytes = t.numel() * esize;
  char* data = static_cast<char*>(t.data_ptr());
  const int peer = 1 - rank_;
  const int sfd = lanes_->sendFd(peer);
  const int rfd = lanes_->recvFd(peer);
  if (scratch_.size() < kLaneScratchBytes) scratch_.resize(kLaneScratchBytes);
  char* scratch = scratch_.data();
  const size_t cap = kLaneScratchBytes;  // a multiple of every element size
  LaneFrame out;
  out.kind = static_cast<uint32_t>(LaneKind::kAllreduce);
  out.tag = static_cast<uint32_t>(t.scalar_type());
  out.seq = laneSeq_++;
  out.bytes = bytes;
  uint8_t outWire[LaneFrame::kWireBytes], inWire[LaneFrame::kWireBytes];
  out.encode(outWire);
  runOp("allreduce", timeout, {}, [&] {
    size_t headerSent = 0, sent = 0, headerRecv = 0, recvd = 0, reduced = 0;
    Clock::time_point idleSince{};  // since when nothing moved, or zero
    waitingOn_.store(peer);
    while (reduced < bytes) {
      throwIfFailed();
      bool progress = false;
      short sendEvents = 0, recvEvents = 0;
      // Send: what is left of the header and up to kLaneSendCallBytes of the tensor, in one call.
      if (sent < bytes) {
        iovec iov[2];
        int n = 0;
        if (headerSent < sizeof(outWire)) {
          iov[n++] = {outWire + headerSent, sizeof(outWire) - headerSent};
        }
        iov[n++] = {data + sent, std::min(bytes - sent, kLaneSendCallBytes)};
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = n;
        ssize_t rv = ::sendmsg(sfd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (rv > 0) {
          size_t k = static_cast<size_t>(rv);
          size_t h = std::min(k, sizeof(outWire) - headerSent);
          headerSent += h;
          sent += k - h;
          progress = true;
        } else if (rv < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          onPairError(peer, std::string("lane send: ") + std::strerror(errno));
        } else {
          sendEvents = POLLOUT;
        }
      }
      // Receive: the header first, then as much of the payload as scratch has room for.
      char* dst = nullptr;
      size_t want = 0;
      if (headerRecv < sizeof(inWire)) {
        dst = reinterpret_cast<char*>(inWire) + headerRecv;
        want = sizeof(inWire) - headerRecv;
      } else if (recvd < bytes && recvd - reduced < cap) {
        const size_t pos = recvd % cap;
        dst = scratch + pos;
        want = std::min({cap - (recvd - reduced), cap - pos, bytes - recvd});
      }
      if (want > 0) {
        ssize_t rv = ::recv(rfd, dst, want, MSG_DONTWAIT);
        if (rv > 0) {
          progress = true;
          if (headerRecv < sizeof(inWire)) {
            headerRecv += static_cast<size_t>(rv);
            if (headerRecv == sizeof(inWire))
              checkFrame(LaneFrame::decode(inWire), out, "allreduce", peer);
          } else {
            recvd += static_cast<size_t>(rv);
          }
        } else if (rv == 0) {
          onPairError(peer, "lane: connection closed");
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          onPairError(peer, std::string("lane recv: ") + std::strerror(errno));
        } else {
          recvEvents = POLLIN;
        }
      }
      // Reduce: whole elements that have arrived and whose own bytes have gone.
      const size_t ready = std::min(recvd, sent) / esize * esize;
      while (reduced < ready) {
        const size_t pos = reduced % cap;
        const size_t n = std::min({ready - reduced, cap - pos, kLaneReduceBytes});
        reduceSum(t.scalar_type(), data + reduced, scratch + pos, n / esize);
        reduced += n;
        progress = true;
      }
      if (progress || (sendEvents | recvEvents) == 0) {
        idleSince = Clock::time_point{};
        continue;
      }
      if (idleSince == Clock::time_point{}) idleSince = Clock::now();
      // Nothing moved: wait until a socket (or the wake fd) is ready. Spin on a zero-timeout
      // poll() for a while first: the peer's bytes are usually microseconds away, and a sleep
      // costs a wake-up. poll() checks readiness without taking the socket's lock, which a
      // spinning recv() would take over and over while the peer's segments arrive.
      pollfd fds[3] = {{sendEvents ? sfd : -1, sendEvents, 0},
                       {recvEvents ? rfd : -1, recvEvents, 0},
                       {lanes_->wakeFd(), POLLIN, 0}};
      for (;;) {
        const bool spin = Clock::now() - idleSince < kLaneSpin;
        int rv = ::poll(fds, 3, spin ? 0 : -1);
        if (rv > 0) break;
        if (rv < 0 && errno != EINTR) {
          SINEW_THROW(IoError, describe(), ": allreduce: poll: ", std::strerror(errno));
        }
        if (!spin) break;
        cpuRelax();
      }
    }
    waitingOn_.store(-1);
  });
}

struct GlooCommunicator::LaneExchange {
  static constexpr size_t kHeader = LaneFrame::kWireBytes;
  struct Send {
    const char* data;
    size_t bytes;
    size_t done = 0;  // header and payload bytes written
    uint8_t header[kHeader];
  };
  struct Recv {
    char* data;
    size_t bytes;
    uint32_t tag;
    bool matched = false;
  };
  struct Incoming {
    uint8_t header[kHeader];
    size_t headerDone = 0;
    int recv = -1;  // the receive the current message fills, or -1 before its header
    size_t done = 0;
  };

  // `ops` by member, empty messages left out (nothing travels: skipped on both sides).
  LaneExchange(const std::vector<P2POp>& ops, const char* name, LaneKind kind, int members)
      : name(name),
        kind(kind),
        sends(members),
        recvs(members),
        nextSend(members, 0),
        expected(members, 0),
        in(members) {
    for (const P2POp& op : ops) {
      const size_t bytes = op.tensor.numel() * op.tensor.element_size();
      if (bytes == 0) continue;
      if (op.kind == P2POp::Kind::kSend) {
        Send snd{static_cast<const char*>(op.tensor.data_ptr()), bytes, 0, {}};
        LaneFrame f;
        f.kind = static_cast<uint32_t>(kind);
        f.tag = op.tag;
        f.bytes = bytes;
        f.encode(snd.header);
        sends[op.peer].push_back(snd);
      } else {
        recvs[op.peer].push_back({static_cast<char*>(op.tensor.data_ptr()), bytes, op.tag});
        expected[op.peer]++;
      }
      left++;
    }
  }

  const char* const name;
  const LaneKind kind;
  std::vector<std::vector<Send>> sends;
  std::vector<std::vector<Recv>> recvs;
  std::vector<size_t> nextSend;
  std::vector<int> expected;  // receives from each member not complete yet
  std::vector<Incoming> in;
  size_t left = 0;  // messages not complete yet
  // Of the current round: the sockets to poll, and whom a timeout names (a member this one
  // waits to receive from, else one it waits to send to).
  std::vector<pollfd> fds;
  int blockedRecv = -1, blockedSend = -1;
};

// Point to point, exchange and barrier. Every message is a frame (`kind`, tag, bytes) and its
// bytes, written on the lane to its receiver in the order of `ops`; the receiver reads straight
// into the tensor of the first of its receives from that member with the header's tag. It reads
// from a member only while it still expects a message from it, so a message for a later call
// stays in the socket. All from this thread with non-blocking calls and poll(): sends to
// different members and receives from every member move together, and a member waits only
// while no socket can move. Failures as in allreduceTwo (a deadline or abort() wakes the poll;
// a broken lane goes to onPairError).
void GlooCommunicator::exchangeOnLanes(const std::vector<P2POp>& ops, const char* name,
                                       std::chrono::milliseconds timeout, LaneKind kind) {
  const int P = size();
  LaneExchange x(ops, name, kind, P);
  if (x.left == 0) return;
  runOp(name, timeout, {}, [&] {
    while (x.left > 0) {
      throwIfFailed();
      bool progress = false;
      x.fds.clear();
      x.blockedRecv = -1;
      x.blockedSend = -1;
      for (int peer = 0; peer < P; ++peer) {
        progress = pumpLaneSends(x, peer) || progress;
        progress = pumpLaneReceives(x, peer) || progress;
      }
      if (x.left == 0 || progress) continue;
      // Nothing moved: sleep until a socket (or the wake fd) is ready.
      waitingOn_.store(x.blockedRecv >= 0 ? x.blockedRecv : x.blockedSend);
      x.fds.push_back({lanes_->wakeFd(), POLLIN, 0});
      int rv = ::poll(x.fds.data(), x.fds.size(), -1);
      if (rv < 0 && errno != EINTR) {
        SINEW_THROW(IoError, describe(), ": ", name, ": poll: ", std::strerror(errno));
      }
      waitingOn_.store(-1);
    }
  });
}

bool GlooCommunicator::pumpLaneSends(LaneExchange& x, int peer) {
  constexpr size_t kHeader = LaneExchange::kHeader;
  bool progress = false;
  // The rest of the current message's header and a call's worth of its bytes, per call.
  while (x.nextSend[peer] < x.sends[peer].size()) {
    throwIfFailed();
    LaneExchange::Send& m = x.sends[peer][x.nextSend[peer]];
    iovec iov[2];
    int n = 0;
    if (m.done < kHeader) {
      iov[n++] = {m.header + m.done, kHeader - m.done};
    }
    const size_t sent = m.done > kHeader ? m.done - kHeader : 0;
    iov[n++] = {const_cast<char*>(m.data) + sent, std::min(m.bytes - sent, kLaneSendCallBytes)};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    ssize_t rv = ::sendmsg(lanes_->sendFd(peer), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (rv > 0) {
      m.done += static_cast<size_t>(rv);
      progress = true;
      if (m.done == kHeader + m.bytes) {
        x.nextSend[peer]++;
        x.left--;
      }
      continue;
    }
    if (rv < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      onPairError(peer, std::string("lane send: ") + std::strerror(errno));
    }
    if (rv < 0 && errno == EINTR) continue;
    x.fds.push_back({lanes_->sendFd(peer), POLLOUT, 0});
    if (x.blockedSend < 0) x.blockedSend = peer;
    break;
  }
  return progress;
}

bool GlooCommunicator::pumpLaneReceives(LaneExchange& x, int peer) {
  constexpr size_t kHeader = LaneExchange::kHeader;
  bool progress = false;
  // A header, then its bytes straight into the matching receive's tensor.
  while (x.expected[peer] > 0) {
    throwIfFailed();
    LaneExchange::Incoming& c = x.in[peer];
    char* dst;
    size_t want;
    if (c.recv < 0) {
      dst = reinterpret_cast<char*>(c.header) + c.headerDone;
      want = kHeader - c.headerDone;
    } else {
      LaneExchange::Recv& r = x.recvs[peer][c.recv];
      dst = r.data + c.done;
      want = r.bytes - c.done;  // The kernel returns what has arrived.
    }
    ssize_t rv = ::recv(lanes_->recvFd(peer), dst, want, MSG_DONTWAIT);
    if (rv == 0) onPairError(peer, "lane: connection closed");
    if (rv < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        onPairError(peer, std::string("lane recv: ") + std::strerror(errno));
      }
      x.fds.push_back({lanes_->recvFd(peer), POLLIN, 0});
      if (x.blockedRecv < 0) x.blockedRecv = peer;
      break;
    }
    progress = true;
    if (c.recv < 0) {
      c.headerDone += static_cast<size_t>(rv);
      if (c.headerDone < kHeader) continue;
      const LaneFrame f = LaneFrame::decode(c.header);
      LaneFrame expected;
      expected.kind = static_cast<uint32_t>(x.kind);
      checkFrame(f, expected, x.name, peer);
      c.recv = matchLaneReceive(x, peer, f);
      c.headerDone = 0;
      c.done = 0;
    } else {
      c.done += static_cast<size_t>(rv);
    }
    if (c.recv >= 0 && c.done == x.recvs[peer][c.recv].bytes) {
      c.recv = -1;
      c.done = 0;
      x.expected[peer]--;
      x.left--;
    }
  }
  return progress;
}

int GlooCommunicator::matchLaneReceive(LaneExchange& x, int peer, const LaneFrame& f) {
  const uint32_t tag = f.tag;
  const uint64_t bytes = f.bytes;
  std::vector<LaneExchange::Recv>& recvs = x.recvs[peer];
  int match = -1;
  for (size_t i = 0; i < recvs.size(); ++i) {
    if (!recvs[i].matched && recvs[i].tag == tag) {
      match = static_cast<int>(i);
      break;
    }
  }
  if (match < 0) {
    SINEW_THROW(InvalidArgument, describe(), ": ", x.name, ": worker ", workerOf(peer),
                " sent a message with tag ", tag, " (", bytes,
                " bytes) ahead of those this call receives from it, and this call "
                "receives none with that tag (on lanes, a member's messages are "
                "received in the order it sent them)");
  }
  if (bytes != recvs[match].bytes) {
    SINEW_THROW(InvalidArgument, describe(), ": ", x.name, ": worker ", workerOf(peer), " sent ",
                bytes, " bytes with tag ", tag, "; this member receives ", recvs[match].bytes,
                " (the members' calls do not match)");
  }
  recvs[match].matched = true;
  return match;
}

void GlooCommunicator::checkFrame(const LaneFrame& in, const LaneFrame& expected, const char* op,
                                  int peer) {
  if (in.kind != expected.kind && laneKindName(in.kind) != nullptr) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": worker ", workerOf(peer), " sent ",
                laneKindName(in.kind), " where this member expects ", laneKindName(expected.kind),
                " (the members' calls do not match)");
  }
  if (in.kind != expected.kind) {
    SINEW_THROW(Corruption, describe(), ": ", op, ": worker ", workerOf(peer),
                " sent a lane frame of kind ", in.kind, " (expected ", expected.kind, ")");
  }
  if (static_cast<LaneKind>(in.kind) != LaneKind::kAllreduce) return;
  if (in.seq != expected.seq || in.bytes != expected.bytes || in.tag != expected.tag) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": worker ", workerOf(peer), " reduces ",
                in.bytes, " bytes of dtype ", c10::toString(static_cast<at::ScalarType>(in.tag)),
                " as lane operation ", in.seq, "; this member ", expected.bytes, " bytes of dtype ",
                c10::toString(static_cast<at::ScalarType>(expected.tag)), " as operation ",
                expected.seq, " (the members' calls do not match)");
  }
}

void GlooCommunicator::send(const at::Tensor& t, int dst, uint32_t tag,
                            std::chrono::milliseconds timeout) {
  validate(t, "send", false);
  checkAlive();
  if (dst < 0 || dst >= size() || dst == rank_) {
    SINEW_THROW(InvalidArgument, describe(), ": send to rank dst = ", dst,
                " is not another member");
  }
  exchangeOnLanes({P2POp::send(t, dst, tag)}, "send", resolveTimeout(timeout),
                  LaneKind::kPointToPoint);
}

void GlooCommunicator::recv(at::Tensor& t, int src, uint32_t tag,
                            std::chrono::milliseconds timeout) {
  validate(t, "recv", false);
  checkAlive();
  if (src < 0 || src >= size() || src == rank_) {
    SINEW_THROW(InvalidArgument, describe(), ": recv from rank src = ", src,
                " is not another member");
  }
  exchangeOnLanes({P2POp::recv(t, src, tag)}, "recv", resolveTimeout(timeout),
                  LaneKind::kPointToPoint);
}

void GlooCommunicator::exchange(const std::vector<P2POp>& ops, std::chrono::milliseconds timeout) {
  for (const P2POp& op : ops) {
    const bool isSend = op.kind == P2POp::Kind::kSend;
    validate(op.tensor, isSend ? "exchange (send)" : "exchange (recv)", false);
    if (op.peer < 0 || op.peer >= size() || op.peer == rank_) {
      SINEW_THROW(InvalidArgument, describe(), ": exchange with rank ", op.peer,
                  " is not another member");
    }
  }
  checkAlive();
  exchangeOnLanes(ops, "exchange", resolveTimeout(timeout), LaneKind::kPointToPoint);
}

// One round: 8 bytes to every other member and from every other member, so the last member to
// arrive releases all the others at once (a ring allreduce on Gloo's pairs takes 2(P - 1)
// hand-overs in turn, and released five members up to 8 ms apart in a reconfiguration's
// copies).
void GlooCommunicator::barrier(std::chrono::milliseconds timeout) {
  checkAlive();
  timeout = resolveTimeout(timeout);
  if (size() == 1) return;
  const auto seq = static_cast<uint32_t>(barrierSeq_++);
  at::Tensor out = at::full({1}, static_cast<int64_t>(seq), at::kLong);
  at::Tensor in = at::empty({size()}, at::kLong);
  std::vector<P2POp> ops;
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    ops.push_back(P2POp::send(out, r, seq));
    ops.push_back(P2POp::recv(in.narrow(0, r, 1), r, seq));
  }
  exchangeOnLanes(ops, "barrier", timeout, LaneKind::kBarrier);
}

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
