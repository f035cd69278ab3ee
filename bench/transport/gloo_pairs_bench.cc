// sinew-bench-gloo-pairs: point-to-point transfers between two processes on this host over
// three data paths, each measured in the same run and in turn:
//   lanes        Sinew's Gloo communicator (send/recv run on its lanes: plain sockets read and
//                written by the calling thread in one poll loop)
//   gloo-async   Gloo's own TCP pairs as they come (unbound buffers; Gloo's device loop thread
//                does the I/O and hands completion to the caller)
//   gloo-sync    Gloo's pairs switched to synchronous mode with busy polling
//                (tcp::Pair::setSync(true, true)): the calling thread does the I/O. Synchronous
//                pairs serve only Gloo's older fixed-slot Buffer API (createSendBuffer /
//                createRecvBuffer); a pair in that mode leaves the device loop for good.
// Each size is a ping-pong: rank 0 sends the bytes, rank 1 sends them back; one transfer is
// half the round trip (median of the rounds). Then a simultaneous exchange: both ranks send
// 16 MiB to each other at once (as a pipeline stage sends activations forward while it
// receives gradients), on lanes and on both kinds of Gloo pairs; a blocking synchronous write on
// both ends cannot complete once the socket buffers are full, so that variant runs in its own
// processes under a 10 s alarm and reports whether it finished.
//
// Last line:
//   RESULT gloo_sync_vs_lanes_16mib=<t_lanes / t_sync> gloo_sync_vs_lanes_1mib=<...>
//          gloo_async_vs_lanes_16mib=<...> gloo_async_vs_lanes_exchange_16mib=<...>
//          gloo_sync_exchange_16mib=<finished|deadlocked>
// (ratios above 1 mean the Gloo path is faster than the lanes).

#include <gloo/barrier.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "sinew/collectives/file_store.h"
#include "sinew/communicator.h"

namespace {

using Clock = std::chrono::steady_clock;

const std::vector<int64_t> kSizes = {64 << 10, 1 << 20, 16 << 20};
constexpr int kRounds = 15;
constexpr int64_t kExchangeBytes = 16 << 20;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The median time of kRounds runs of `op` after two warm-ups, divided by `per` (2 for half a
// round trip).
double medianSeconds(const std::function<void()>& op, double per = 1) {
  std::vector<double> s;
  for (int i = 0; i < kRounds + 2; ++i) {
    const auto t0 = Clock::now();
    op();
    if (i >= 2) s.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / per);
  }
  return median(s);
}

std::string tempDir(const char* what) {
  std::string t = std::string("/tmp/sinew-bench-gloo-pairs-") + what + "-XXXXXX";
  std::vector<char> buf(t.begin(), t.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return buf.data();
}

// Runs body(rank) in a forked child (rank 1) and here (rank 0); the child's result comes back
// through a pipe. Returns rank 0's result, or -1 where either side failed.
double onTwoRanks(const std::function<double(int)>& body) {
  pid_t pid = ::fork();
  if (pid == 0) {
    try {
      body(1);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank 1: %s\n", e.what());
      _exit(1);
    }
    _exit(0);
  }
  double r = -1;
  try {
    r = body(0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank 0: %s\n", e.what());
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return -1;
  return r;
}

// Per size: the median one-way transfer time in seconds.
using Times = std::map<int64_t, double>;

std::shared_ptr<gloo::rendezvous::Context> glooContext(int rank, const std::string& dir) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, 2);
  context->setTimeout(std::chrono::seconds(30));
  gloo::rendezvous::FileStore store(dir);
  context->connectFullMesh(store, device);
  return context;
}

// Sinew's Gloo communicator of ranks 0 and 1 (its point to point runs on the lanes), meeting
// through a file store in `dir`.
std::unique_ptr<sinew::collectives::Communicator> sinewComm(int rank, const std::string& dir) {
  auto store = std::make_shared<sinew::collectives::FileStore>(dir);
  sinew::collectives::CommunicatorOptions o;
  o.members = {0, 1};
  o.self = rank;
  o.name = "bench";
  return sinew::collectives::createGlooCommunicator(store, o);
}

Times lanes() {
  Times out;
  const std::string dir = tempDir("lanes");
  for (int64_t bytes : kSizes) {
    out[bytes] = onTwoRanks([&](int rank) {
      auto comm = sinewComm(rank, dir + "/" + std::to_string(bytes));
      at::Tensor t = at::ones({bytes / 8}, at::kDouble);
      const double s = medianSeconds(
          [&] {
            if (rank == 0) {
              comm->send(t, 1, 1);
              comm->recv(t, 1, 2);
            } else {
              comm->recv(t, 0, 1);
              comm->send(t, 0, 2);
            }
          },
          2);
      comm->barrier();
      return s;
    });
  }
  std::filesystem::remove_all(dir);
  return out;
}

Times glooAsync() {
  Times out;
  for (int64_t bytes : kSizes) {
    const std::string dir = tempDir("async");
    out[bytes] = onTwoRanks([&](int rank) {
      auto context = glooContext(rank, dir);
      std::vector<char> data(bytes, 1);
      auto buf = context->createUnboundBuffer(data.data(), data.size());
      const double s = medianSeconds(
          [&] {
            if (rank == 0) {
              buf->send(1, 1);
              buf->waitSend();
              buf->recv(1, 2);
              buf->waitRecv();
            } else {
              buf->recv(0, 1);
              buf->waitRecv();
              buf->send(0, 2);
              buf->waitSend();
            }
          },
          2);
      gloo::BarrierOptions b(context);
      gloo::barrier(b);
      return s;
    });
    std::filesystem::remove_all(dir);
  }
  return out;
}

// A synchronous pair to the other rank with a send and a receive buffer of `bytes` each
// (slots 1 and 2: each rank's send slot is the other's receive slot), registered before a
// barrier on the still asynchronous pairs, so no bytes arrive for an unregistered slot.
struct SyncPair {
  std::shared_ptr<gloo::rendezvous::Context> context;
  std::vector<char> out, in;
  std::unique_ptr<gloo::transport::Buffer> send, recv;

  SyncPair(int rank, const std::string& dir, int64_t bytes) : out(bytes, 1), in(bytes, 0) {
    context = glooContext(rank, dir);
    auto& pair = context->getPair(1 - rank);
    send = pair->createSendBuffer(rank == 0 ? 1 : 2, out.data(), out.size());
    recv = pair->createRecvBuffer(rank == 0 ? 2 : 1, in.data(), in.size());
    gloo::BarrierOptions b(context);
    gloo::barrier(b);
    pair->setSync(true, true);
  }
};

Times glooSync() {
  Times out;
  for (int64_t bytes : kSizes) {
    const std::string dir = tempDir("sync");
    out[bytes] = onTwoRanks([&](int rank) {
      SyncPair p(rank, dir, bytes);
      return medianSeconds(
          [&] {
            if (rank == 0) {
              p.send->send();
              p.send->waitSend();
              p.recv->waitRecv();
            } else {
              p.recv->waitRecv();
              p.send->send();
              p.send->waitSend();
            }
          },
          2);
    });
    std::filesystem::remove_all(dir);
  }
  return out;
}

// Both ranks send kExchangeBytes at once and then receive; seconds per exchange (median).
double lanesExchange() {
  const std::string dir = tempDir("lanes-exchange");
  double r = onTwoRanks([&](int rank) {
    auto comm = sinewComm(rank, dir);
    at::Tensor a = at::ones({kExchangeBytes / 8}, at::kDouble);
    at::Tensor b = at::zeros({kExchangeBytes / 8}, at::kDouble);
    const double s = medianSeconds([&] {
      comm->exchange({sinew::collectives::P2POp::send(a, 1 - rank, 3),
                      sinew::collectives::P2POp::recv(b, 1 - rank, 3)});
    });
    comm->barrier();
    return s;
  });
  std::filesystem::remove_all(dir);
  return r;
}

// The same on Gloo's asynchronous pairs: both post the send and the receive, then wait.
double glooAsyncExchange() {
  const std::string dir = tempDir("async-exchange");
  double r = onTwoRanks([&](int rank) {
    auto context = glooContext(rank, dir);
    std::vector<char> out(kExchangeBytes, 1), in(kExchangeBytes, 0);
    auto send = context->createUnboundBuffer(out.data(), out.size());
    auto recv = context->createUnboundBuffer(in.data(), in.size());
    const double s = medianSeconds([&] {
      send->send(1 - rank, 3);
      recv->recv(1 - rank, 3);
      send->waitSend();
      recv->waitRecv();
    });
    gloo::BarrierOptions b(context);
    gloo::barrier(b);
    return s;
  });
  std::filesystem::remove_all(dir);
  return r;
}

// The same on synchronous pairs: both ranks write first. True if both finished within 10 s.
bool syncExchangeFinishes() {
  const std::string dir = tempDir("sync-exchange");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    pid_t pid = ::fork();
    if (pid == 0) {
      try {
        SyncPair p(rank, dir, kExchangeBytes);
        ::alarm(10);  // From here on: a hang ends the process.
        p.send->send();
        p.send->waitSend();
        p.recv->waitRecv();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "sync exchange rank %d: %s\n", rank, e.what());
        _exit(1);
      }
      _exit(0);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int st = 0;
    ::waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = false;
  }
  std::filesystem::remove_all(dir);
  return ok;
}

}  // namespace

int main() {
  at::set_num_threads(1);
  std::printf("sinew-bench-gloo-pairs: one-way transfer between two processes (median of %d)\n",
              kRounds);
  // Each variant in turn, twice, so that neither always runs first on a busy machine; the
  // better (smaller) median of the two runs counts.
  Times l = lanes(), a = glooAsync(), s = glooSync();
  Times l2 = lanes(), a2 = glooAsync(), s2 = glooSync();
  for (int64_t b : kSizes) {
    l[b] = std::min(l[b], l2[b]);
    a[b] = std::min(a[b], a2[b]);
    s[b] = std::min(s[b], s2[b]);
  }
  for (int64_t b : kSizes) {
    if (l[b] <= 0 || a[b] <= 0 || s[b] <= 0) {
      std::fprintf(stderr, "a variant failed at %lld bytes\n", static_cast<long long>(b));
      return 1;
    }
  }
  std::printf("  %10s %14s %14s %14s\n", "bytes", "lanes ms", "gloo-async ms", "gloo-sync ms");
  for (int64_t b : kSizes) {
    std::printf("  %10lld %14.3f %14.3f %14.3f\n", static_cast<long long>(b), l[b] * 1e3,
                a[b] * 1e3, s[b] * 1e3);
  }
  const double lx = std::min(lanesExchange(), lanesExchange());
  const double ax = std::min(glooAsyncExchange(), glooAsyncExchange());
  const bool syncX = syncExchangeFinishes();
  std::printf("  simultaneous 16 MiB exchange: lanes %.3f ms; gloo-async %.3f ms; gloo-sync %s\n",
              lx * 1e3, ax * 1e3,
              syncX ? "finished" : "did not finish within 10 s (both ends blocked writing)");
  const int64_t mib = 1 << 20, big = 16 << 20;
  std::printf(
      "RESULT gloo_sync_vs_lanes_16mib=%.3f gloo_sync_vs_lanes_1mib=%.3f "
      "gloo_async_vs_lanes_16mib=%.3f gloo_async_vs_lanes_exchange_16mib=%.3f "
      "gloo_sync_exchange_16mib=%s\n",
      l[big] / s[big], l[mib] / s[mib], l[big] / a[big], lx / ax,
      syncX ? "finished" : "deadlocked");
  return 0;
}
