// sinew-bench-pipeline: pipeline parallelism measured against its baselines, on this machine.
//
//  1. Activation transfers: a 16 MiB float64 activation bounced between two processes with
//     Communicator::exchange (what the stages use), against the same bytes over a raw
//     loopback TCP socket. The ratio is raw time / Sinew time, so > 1 means Sinew is faster.
//  2. The cost model: examples/train_pp as one 2-stage pipeline on 2 workers (memory budget 4.4 MB,
//     f = 0) under sinew-run. The measured 1F1B time per step (the slowest stage's median
//     `schedule_s`, from the progress events) is compared with the plan's
//     `predicted_iteration_s`, which the cost model computes from the profile measured at start.
//     The model describes the pipeline's schedule, so the comparison is on the job without
//     peer-RAM versions (their replication shares these two cores with the stages; item 4
//     measures what it costs); the same ratio with them is printed too. The job without them
//     runs three times, each with its own profile, and the run of the median ratio counts.
//  3. Pipeline against data parallelism: the same model, the same 2 workers, samples/s of the
//     pipeline job against a data-parallel job (the model fits one worker there).
//  4. Peer-RAM versions (Gemini, every step by default; each worker replicates its stage to the
//     other) against the same pipeline job with them off (--peer-checkpoint-every 0): the
//     step time with replication over the step time without (samples/s without / with).
//
//  5. Layer copies in a reconfiguration: a wider train_pp (width 256) on 6 workers loses one;
//     the largest copy of layer state one survivor received from live workers (bytes over the
//     wall time of receiving them, from its layers_moved event) against raw loopback TCP
//     moving the same bytes, and exchangeInChunks alone on those bytes between two processes.
//     Ratios are raw TCP time / Sinew time (the goal: >= 0.8); the "all" ratio is the
//     bytes every receiver of that reconfiguration got over the longest receive time, as a
//     throughput against one raw TCP stream's. The "concurrent" ratio compares the same
//     bytes moved over raw TCP at once (a pair of processes per receiver, each moving what that
//     receiver got, all released together):
//     the slowest raw stream's time over the longest receive: the same transfers sharing the
//     cores the same way (nothing else runs beside the raw streams, while the job's other
//     survivors do, so this favours raw TCP). The "chunked exchange concurrent" ratio moves the
//     same copies at once with exchangeInChunks (a pair of processes per receiver, nothing else
//     running) against those raw streams: Sinew's transport under the job's concurrency, without
//     the job's other work. The job runs five times (kCopyRuns): the largest-copy ratio is the
//     median run's, the others the medians of the five. A reconfiguration's copies are the first
//     bulk transfer on the new epoch's connections, so the largest copy is also compared with raw
//     TCP's first transfer of its bytes on a new connection (the "fresh" ratio, the median of
//     the runs'; rawTcpFreshSeconds; its raw sockets keep the kernel's autotuned buffers). The
//     job's lanes ask for 4 MiB socket buffers (the trainer's default,
//     SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES; the bench prints whether the system granted them); in
//     turn with each of its runs (before and after, alternately) the same job runs with the
//     kernel's autotuned buffers (SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES=0), whose largest-copy ratio,
//     the median of the five, is the "autotuned lanes" baseline. The bench's own communicators (p2p
//     and chunked-exchange ratios) ask for the job's buffers too.
//
// Last line: RESULT pp_iter_vs_model=<measured/predicted> p2p_ratio_vs_tcp=<r> pp_vs_dp=<x>
//            peer_ram_step_ratio=<with/without> pp_iter_vs_model_with_peer_ram=<r>
//            layer_copy_ratio_vs_tcp=<r> layer_copy_all_ratio_vs_tcp=<r>
//            layer_copy_concurrent_ratio_vs_tcp=<r> chunked_exchange_ratio_vs_tcp=<r>
//            chunked_exchange_concurrent_ratio_vs_tcp=<r> layer_copy_ratio_vs_fresh_tcp=<r>
//            layer_copy_ratio_vs_tcp_autotuned_lanes=<r>

#include <ftw.h>
#include <sys/stat.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "sinew/collectives/file_store.h"
#include "sinew/collectives/gloo/gloo_options.h"
#include "sinew/collectives/gloo/lanes.h"
#include "sinew/communicator.h"

#include "../raw_tcp.h"

namespace {

// Not std::filesystem::remove_all: libtorch 2.11 exports a copy of it that crashes when it
// wins symbol resolution (docs/gpu.md).
void removeTree(const std::string& path) {
  ::nftw(
      path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
      16, FTW_DEPTH | FTW_PHYS);
}

using Clock = std::chrono::steady_clock;
constexpr int64_t kBytes = 16 << 20;
constexpr int kRounds = 20;
// Runs of the layer-copy job (item 5): the largest copy's ratio moved from 0.57 to 1.23 between
// three runs of one build, so one run's ratio decided the median of three; five since
// 2026-11-27.
constexpr int kCopyRuns = 5;
// The lane buffers of the job's world communicator (the trainer's
// default), given to the bench's own communicators too.
constexpr int kLaneSocketBufferBytes = 4 << 20;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// "0.812 0.934 ..." (three decimals each).
std::string listed(const std::vector<double>& v) {
  std::string s;
  char buf[32];
  for (double x : v) {
    std::snprintf(buf, sizeof buf, "%s%.3f", s.empty() ? "" : " ", x);
    s += buf;
  }
  return s;
}

double rawTcpSeconds(int64_t bytes = kBytes, const std::function<void()>& beforeRounds = {}) {
  return sinew_bench::rawTcpSeconds(bytes, kRounds, beforeRounds);
}

constexpr int kFreshConnections = 5;
double rawTcpFreshSeconds(int64_t bytes) {
  return sinew_bench::rawTcpFreshSeconds(bytes, kFreshConnections);
}

// `streams` transfers at once, as a reconfiguration's receivers get their copies: per stream
// its own pair of processes running `transfer(bytes, beforeRounds)` (rawTcpSeconds or
// sinewSeconds), connected first and then released together (a pipe every stream waits on in
// beforeRounds), so that their rounds overlap; the slowest stream's median seconds.
using Transfer = std::function<double(int64_t, const std::function<void()>&)>;
double concurrentSeconds(const std::vector<int64_t>& streams, const Transfer& transfer) {
  int ready[2], go[2];
  if (::pipe(ready) != 0 || ::pipe(go) != 0) throw std::runtime_error("pipe failed");
  std::vector<std::pair<pid_t, int>> kids;
  bool failed = false;
  for (int64_t bytes : streams) {
    int fds[2];
    if (::pipe(fds) != 0) {
      failed = true;
      break;
    }
    pid_t pid = ::fork();
    if (pid < 0) {
      ::close(fds[0]);
      ::close(fds[1]);
      failed = true;
      break;
    }
    if (pid == 0) {
      ::close(fds[0]);
      ::close(ready[0]);
      ::close(go[1]);
      double s = -1;
      bool arrived = false;
      try {
        s = transfer(bytes, [&] {
          char c = 1;
          arrived = true;
          if (::write(ready[1], &c, 1) != 1 || ::read(go[0], &c, 1) != 1) {
            throw std::runtime_error("start barrier failed");
          }
        });
      } catch (const std::exception&) {
        char c = 0;
        if (!arrived && ::write(ready[1], &c, 1) != 1) _exit(1);  // Do not hold the others.
      }
      _exit(::write(fds[1], &s, sizeof s) == sizeof s ? 0 : 1);
    }
    ::close(fds[1]);
    kids.emplace_back(pid, fds[0]);
  }
  ::close(ready[1]);
  ::close(go[0]);
  // Every stream connected (or gone: its end of `ready` closed), then all go at once. A child
  // that failed before the barrier reports -1 below.
  for (size_t i = 0; i < kids.size(); ++i) {
    char c;
    if (::read(ready[0], &c, 1) != 1) break;
  }
  const std::string all(kids.size(), '1');
  if (!all.empty() && ::write(go[1], all.data(), all.size()) != static_cast<ssize_t>(all.size())) {
    failed = true;
  }
  ::close(ready[0]);
  ::close(go[1]);
  double slowest = 0;
  for (auto [pid, fd] : kids) {
    double s = -1;
    if (::read(fd, &s, sizeof s) != sizeof s || s < 0) failed = true;
    ::close(fd);
    int st = 0;
    ::waitpid(pid, &st, 0);
    slowest = std::max(slowest, s);
  }
  if (failed) throw std::runtime_error("a concurrent stream failed");
  return slowest;
}

// The same with a Gloo communicator of two members (on lanes) and exchange(), as the stages
// send; with chunkBytes > 0, the bytes go as the eight tensors of a layer's state would,
// through exchangeInChunks with chunks of that size, as a reconfiguration copies layers.
// `beforeRounds`, if given, runs in this process once the communicator is up (its peer waits
// in the first exchange).
double sinewSeconds(int64_t bytes = kBytes, size_t chunkBytes = 0,
                    const std::function<void()>& beforeRounds = {}) {
  char tmpl[] = "/tmp/sinew-bench-pipeline-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
  const std::string dir = tmpl;
  auto run = [&](int self) {
    auto store = std::make_shared<sinew::collectives::FileStore>(dir);
    sinew::collectives::CommunicatorOptions o;
    o.members = {0, 1};
    o.self = self;
    o.name = "bench";
    sinew::collectives::GlooOptions gloo;
    gloo.laneSocketBufferBytes = kLaneSocketBufferBytes;  // As the job's world communicator.
    auto comm = sinew::collectives::createGlooCommunicator(store, o, gloo);
    using sinew::collectives::P2POp;
    at::Tensor t = at::ones({bytes / 8}, at::kDouble);
    const int peer = 1 - self;
    // One op, or eight tensors (views of t) cut into chunks.
    auto ops = [&](bool send, uint32_t tag) {
      std::vector<P2POp> v;
      const int parts = chunkBytes > 0 ? 8 : 1;
      const int64_t n = t.numel();
      for (int i = 0; i < parts; ++i) {
        at::Tensor part = t.narrow(0, n * i / parts, n * (i + 1) / parts - n * i / parts);
        v.push_back(send ? P2POp::send(part, peer, tag) : P2POp::recv(part, peer, tag));
      }
      return v;
    };
    auto exchange = [&](bool send, uint32_t tag) {
      if (chunkBytes > 0) {
        sinew::collectives::exchangeInChunks(*comm, ops(send, tag), chunkBytes);
      } else {
        comm->exchange(ops(send, tag));
      }
    };
    if (self == 0 && beforeRounds) beforeRounds();
    std::vector<double> s;
    for (int i = 0; i < kRounds + 2; ++i) {
      auto t0 = Clock::now();
      exchange(self == 0, 2);
      exchange(self != 0, 3);
      if (i >= 2) s.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / 2);
    }
    comm->barrier();
    return median(s);
  };
  pid_t pid = ::fork();
  if (pid == 0) {
    try {
      run(1);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench child: %s\n", e.what());
      _exit(1);
    }
    _exit(0);
  }
  double result = run(0);
  int st = 0;
  ::waitpid(pid, &st, 0);
  removeTree(dir);
  return result;
}

struct JobStats {
  double predictedIterationS = 0;
  double measuredIterationS = 0;  // max over stages of the median schedule_s
  double waitS = 0;               // that stage's median schedule_wait_s
  double samplesPerS = 0;         // median over progress reports, first one skipped
  // The largest layer copy a worker received in a reconfiguration (layers_moved events):
  // its bytes and the wall time of receiving them.
  int64_t copiedBytes = 0;
  double copySeconds = 0;
  // Every receiver's copy of the first reconfiguration together: all their bytes over the
  // longest of their receive times (copies run at once, sharing this machine's cores).
  int64_t allCopiedBytes = 0;
  double allCopySeconds = 0;
  int64_t copyEpoch = -1;
  std::vector<int64_t> epochCopies;  // the bytes each of those receivers got
  std::string plans;                 // worker 0's plan events, for error messages
};

JobStats runJob(const std::string& name, const std::vector<std::string>& args, int steps,
                int workers = 2, const std::string& inject = "", const std::string& env = "") {
  std::string dir = std::filesystem::temp_directory_path().string() + "/sinew-bench-pipeline-" +
                    name + "-" + std::to_string(::getpid());
  removeTree(dir);
  std::string cmd = env + (env.empty() ? "" : " ") + std::string(SINEW_RUN_PATH) + " -n " +
                    std::to_string(workers) + " --log-dir " + dir +
                    (inject.empty() ? "" : " --inject '" + inject + "'") + " " + TRAIN_PP_PATH +
                    " --steps " + std::to_string(steps) +
                    " --progress 5 --no-reference --devices-per-node 1";
  for (const auto& a : args) cmd += " " + a;
  cmd += " > " + dir + ".out 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    throw std::runtime_error("job failed: " + cmd + " (see " + dir + ".out)");
  }
  JobStats stats;
  std::vector<double> rates;
  std::map<int, std::vector<double>> schedule, wait;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind("worker-", 0) != 0 || file.find("-events.jsonl") == std::string::npos) continue;
    int worker = std::stoi(file.substr(7));
    std::ifstream in(entry.path());
    std::string line;
    int progress = 0;
    while (std::getline(in, line)) {
      auto e = nlohmann::json::parse(line, nullptr, false);
      if (e.is_discarded() || !e.contains("event")) continue;
      if (e["event"] == "plan" && e.contains("predicted_iteration_s")) {
        stats.predictedIterationS = e["predicted_iteration_s"].get<double>();
        if (worker == 0) stats.plans += " " + e["pipelines"].dump();
      }
      if (e["event"] == "layers_moved" && e.value("copied_bytes", int64_t{0}) > 0) {
        const int64_t bytes = e["copied_bytes"].get<int64_t>();
        const double secs = e["copy_s"].get<double>();
        const int64_t epoch = e["epoch"].get<int64_t>();
        if (bytes > stats.copiedBytes) {
          stats.copiedBytes = bytes;
          stats.copySeconds = secs;
        }
        if (stats.copyEpoch < 0 || epoch < stats.copyEpoch) {
          stats.copyEpoch = epoch;
          stats.allCopiedBytes = 0;
          stats.allCopySeconds = 0;
          stats.epochCopies.clear();
        }
        if (epoch == stats.copyEpoch) {
          stats.epochCopies.push_back(bytes);
          stats.allCopiedBytes += bytes;
          stats.allCopySeconds = std::max(stats.allCopySeconds, secs);
        }
      }
      if (e["event"] == "progress" && progress++ > 0) {
        if (e.contains("schedule_s")) schedule[worker].push_back(e["schedule_s"].get<double>());
        if (e.contains("schedule_wait_s")) {
          wait[worker].push_back(e["schedule_wait_s"].get<double>());
        }
        if (worker == 0) rates.push_back(e["samples_per_s"].get<double>());
      }
    }
  }
  for (auto& [w, v] : schedule) {
    if (median(v) > stats.measuredIterationS) {
      stats.measuredIterationS = median(v);
      stats.waitS = median(wait[w]);
    }
  }
  stats.samplesPerS = median(rates);
  removeTree(dir);
  std::filesystem::remove(dir + ".out");
  return stats;
}

// Layer copies: a wider model (width 256, 4 blocks, float32: about 9.5 MB of parameters
// and Adam state per block, 40 MB per worker) on 6 workers as pipelines of 2 or 3 stages; worker
// 2 is killed at step 4, and the survivors' plan (since 2026-11-27 the last plan reconfigured:
// 3+3 shrinks to 2+3, 2+2+2 merges into 3+2) makes them copy whole blocks from live
// workers. The largest copy one worker received, against raw TCP moving the same bytes (in this
// run, between two processes), and the chunked exchange alone on the same bytes.
// kCopyRuns runs (the copies share two cores with the other survivors, and one run's ratio
// varied from 0.3 to 0.9): each against raw TCP on its bytes measured right after it, and
// the run of the median largest-copy ratio is printed.
struct CopyRun {
  JobStats job;
  double tcpS = 0;
  double ratio = 0;       // raw TCP time / the largest copy's time
  double freshTcpS = 0;   // the same bytes as the first transfer on a new connection
  double freshRatio = 0;  // that time / the largest copy's time
  double allRatio = 0;    // all receivers' throughput / one raw TCP stream's
  // Raw TCP moving that reconfiguration's copies at once (one stream per receiver) / Sinew:
  // the slowest raw stream's time over the longest receive time.
  double concurrentTcpS = 0;
  double concurrentRatio = 0;
  // exchangeInChunks moving the same copies at once, one pair of processes per receiver:
  // the transport under the job's concurrency without the job's other work.
  double concurrentChunkedS = 0;
};

// The kCopyRuns copy jobs, each with its baseline of autotuned lane buffers in turn
// (`autotunedRatios`: the largest copy against raw TCP, in run order).
std::vector<CopyRun> runCopies(std::vector<double>& autotunedRatios) {
  std::vector<CopyRun> copies;
  // The baseline, in turn with them: the same job with the kernel's autotuned buffers on the
  // lanes (SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES=0), the largest copy against raw TCP measured right
  // after it.
  auto copyJob = [](const std::string& laneBuffer) {
    JobStats job = runJob(
        "copy",
        {"--width", "256", "--blocks", "4", "--memory-bytes", "40000000", "--global-batch", "8",
         "--microbatch", "2", "--float32", "--peer-checkpoint-every", "0"},
        10, 6, "kill:worker=2:step=4",
        std::string(sinew::collectives::GlooOptions::kLaneSocketBufferEnv) + "=" + laneBuffer);
    if (job.copiedBytes <= 0 || job.copySeconds <= 0) {
      throw std::runtime_error("the copy job moved no layers between live workers; its plans:" +
                               job.plans);
    }
    return job;
  };
  for (int i = 0; i < kCopyRuns; ++i) {
    // Which of the two goes first alternates.
    auto baseline = [&] {
      JobStats base = copyJob("0");
      autotunedRatios.push_back(rawTcpSeconds(base.copiedBytes) / base.copySeconds);
    };
    if (i % 2 == 0) baseline();
    CopyRun r;
    r.job = copyJob(std::to_string(kLaneSocketBufferBytes));
    if (i % 2 == 1) baseline();
    r.tcpS = rawTcpSeconds(r.job.copiedBytes);
    r.ratio = r.tcpS / r.job.copySeconds;
    r.freshTcpS = rawTcpFreshSeconds(r.job.copiedBytes);
    r.freshRatio = r.freshTcpS / r.job.copySeconds;
    r.allRatio = (r.job.allCopiedBytes / r.job.allCopySeconds) / (r.job.copiedBytes / r.tcpS);
    r.concurrentTcpS = concurrentSeconds(
        r.job.epochCopies,
        [](int64_t b, const std::function<void()>& f) { return rawTcpSeconds(b, f); });
    r.concurrentChunkedS =
        concurrentSeconds(r.job.epochCopies, [](int64_t b, const std::function<void()>& f) {
          return sinewSeconds(b, size_t{4} << 20, f);
        });
    r.concurrentRatio = r.concurrentTcpS / r.job.allCopySeconds;
    copies.push_back(r);
  }
  return copies;
}

// The copy runs' ratios, what the RESULT line reports of them.
struct CopyFigures {
  double largestRatio = 0;
  double allRatio = 0;
  double concurrentRatio = 0;
  double chunkedRatio = 0;
  double concurrentChunkedRatio = 0;
  double freshRatio = 0;
  double autotunedRatio = 0;
};

// Prints each copy run and the run of the median largest-copy ratio.
CopyFigures printCopies(std::vector<CopyRun> copies, const std::vector<double>& autotunedRatios) {
  const int laneBuffers =
      sinew::collectives::Lanes::usableSocketBufferBytes(kLaneSocketBufferBytes);
  std::vector<double> allRatios, concurrentRatios, concurrentChunkedRatios, freshRatios;
  for (const auto& r : copies) {
    freshRatios.push_back(r.freshRatio);
    allRatios.push_back(r.allRatio);
    concurrentRatios.push_back(r.concurrentRatio);
    concurrentChunkedRatios.push_back(r.concurrentTcpS / r.concurrentChunkedS);
  }
  // Each run in order: how many workers received copies, their bytes, and the times behind
  // the largest copy's ratios (the spread between runs is this machine's, which the lines let
  // one see).
  for (size_t i = 0; i < copies.size(); ++i) {
    const CopyRun& r = copies[i];
    std::string each;
    for (int64_t b : r.job.epochCopies) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%s%.1f", each.empty() ? "" : "+", b / 1048576.0);
      each += buf;
    }
    std::printf(
        "  copy run %zu: %zu receivers (%s MiB), largest copy %.3f ms, raw TCP %.3f ms, new "
        "connection %.3f ms: ratio %.3f\n",
        i + 1, r.job.epochCopies.size(), each.c_str(), r.job.copySeconds * 1e3, r.tcpS * 1e3,
        r.freshTcpS * 1e3, r.ratio);
  }
  const double freshRatio = median(freshRatios);
  const double allRatio = median(allRatios);
  const double concurrentRatio = median(concurrentRatios);
  const double concurrentChunkedRatio = median(concurrentChunkedRatios);
  std::sort(copies.begin(), copies.end(),
            [](const CopyRun& a, const CopyRun& b) { return a.ratio < b.ratio; });
  const CopyRun& mid = copies[copies.size() / 2];
  const JobStats& copy = mid.job;
  const double copyTcp = mid.tcpS;
  const double copyChunked = sinewSeconds(copy.copiedBytes, size_t{4} << 20);
  std::vector<double> largestRatios;
  for (const auto& r : copies) largestRatios.push_back(r.ratio);
  std::printf("layer copy in a reconfiguration (6 workers, width 256, worker 2 killed), %d runs\n",
              kCopyRuns);
  std::printf("  largest copy / raw TCP  %s\n", listed(largestRatios).c_str());
  std::printf(
      "  the same with autotuned lane buffers (SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES=0)  %s (in run "
      "order)\n",
      listed(autotunedRatios).c_str());
  if (laneBuffers > 0) {
    std::printf("  (the job's lanes had %d KiB socket buffers each way)\n", laneBuffers >> 10);
  } else {
    std::printf(
        "  (this system's net.core.rmem_max/wmem_max are below %d KiB: the job's lanes kept "
        "autotuned buffers too, so both lines measure the same thing)\n",
        kLaneSocketBufferBytes >> 10);
  }
  std::printf("  largest copy / raw TCP's first transfer on a new connection  %s (in run order)\n",
              listed(freshRatios).c_str());
  std::printf("  all receivers / raw TCP  %s (in run order)\n", listed(allRatios).c_str());
  std::printf("  the same copies at once, raw TCP / Sinew  %s (in run order)\n",
              listed(concurrentRatios).c_str());
  std::printf("  the same copies at once, raw TCP / exchangeInChunks alone  %s\n",
              listed(concurrentChunkedRatios).c_str());
  std::printf("the run of the median largest-copy ratio:\n");
  std::printf("  largest copy received   %8.3f ms  %6.2f GB/s  (%.1f MiB)\n",
              copy.copySeconds * 1e3, copy.copiedBytes / copy.copySeconds / 1e9,
              copy.copiedBytes / 1048576.0);
  std::printf("  all receivers at once   %8.3f ms  %6.2f GB/s  (%.1f MiB)\n",
              copy.allCopySeconds * 1e3, copy.allCopiedBytes / copy.allCopySeconds / 1e9,
              copy.allCopiedBytes / 1048576.0);
  std::printf("  raw loopback TCP        %8.3f ms  %6.2f GB/s  (the largest copy's bytes)\n",
              copyTcp * 1e3, copy.copiedBytes / copyTcp / 1e9);
  std::printf(
      "  raw TCP, new connection %8.3f ms  %6.2f GB/s  (the largest copy's bytes, first "
      "transfer, median of %d connections)\n",
      mid.freshTcpS * 1e3, copy.copiedBytes / mid.freshTcpS / 1e9, kFreshConnections);
  std::printf("  raw TCP, %zu streams     %8.3f ms  %6.2f GB/s  (each receiver's bytes, at once)\n",
              copy.epochCopies.size(), mid.concurrentTcpS * 1e3,
              copy.allCopiedBytes / mid.concurrentTcpS / 1e9);
  std::printf("  exchangeInChunks alone  %8.3f ms  %6.2f GB/s  (4 MiB chunks, 2 processes)\n",
              copyChunked * 1e3, copy.copiedBytes / copyChunked / 1e9);
  std::printf(
      "  exchangeInChunks, %zu pairs %6.3f ms  %6.2f GB/s  (each receiver's bytes, at once)\n",
      copy.epochCopies.size(), mid.concurrentChunkedS * 1e3,
      copy.allCopiedBytes / mid.concurrentChunkedS / 1e9);
  CopyFigures f;
  f.largestRatio = mid.ratio;
  f.allRatio = allRatio;
  f.concurrentRatio = concurrentRatio;
  f.chunkedRatio = copyTcp / copyChunked;
  f.concurrentChunkedRatio = concurrentChunkedRatio;
  f.freshRatio = freshRatio;
  f.autotunedRatio = median(autotunedRatios);
  return f;
}

// The activation transfer, the cost model and pipelines against data parallel; the RESULT
// line's first figures.
struct IterationFigures {
  double p2pRatio = 0;
  double iterRatio = 0;
  double ppVsDp = 0;
  double peerRatio = 0;
  double iterRatioWithPeerRam = 0;
};

IterationFigures runIterations(int steps) {
  double tcp = rawTcpSeconds();
  double sinew = sinewSeconds();
  std::printf("activation transfer of %lld MiB (median of %d, half a round trip)\n",
              static_cast<long long>(kBytes >> 20), kRounds);
  std::printf("  raw loopback TCP        %8.3f ms  %6.2f GB/s\n", tcp * 1e3, kBytes / tcp / 1e9);
  std::printf("  Sinew exchange (lanes)  %8.3f ms  %6.2f GB/s\n", sinew * 1e3,
              kBytes / sinew / 1e9);

  JobStats pp = runJob("pp", {"--fault-tolerance", "0", "--memory-bytes", "4400000"}, steps);
  JobStats dp = runJob("dp", {"--data-parallel"}, steps);
  auto ratio = [](const JobStats& j) {
    return j.predictedIterationS > 0 ? j.measuredIterationS / j.predictedIterationS : 0;
  };
  // The cost model's comparison: three runs, each with its own profile and prediction (this
  // machine's speed varies by a quarter from run to run), and the run of the median ratio.
  std::vector<JobStats> bares;
  for (int i = 0; i < 3; ++i) {
    bares.push_back(runJob(
        "pp-bare",
        {"--fault-tolerance", "0", "--memory-bytes", "4400000", "--peer-checkpoint-every", "0"},
        steps));
  }
  std::sort(bares.begin(), bares.end(),
            [&](const JobStats& a, const JobStats& b) { return ratio(a) < ratio(b); });
  const JobStats bare = bares[1];
  std::printf("train_pp on 2 workers, %d steps\n", steps);
  std::printf(
      "  cost model, 3 runs without peer-RAM versions: measured / predicted %.3f %.3f %.3f\n",
      ratio(bares[0]), ratio(bares[1]), ratio(bares[2]));
  std::printf(
      "  pipeline (2 stages), without peer-RAM versions: 1F1B %8.3f ms/step measured (%.3f ms "
      "of it in sends and receives), %8.3f ms predicted (x%.3f); %8.1f samples/s\n",
      bare.measuredIterationS * 1e3, bare.waitS * 1e3, bare.predictedIterationS * 1e3, ratio(bare),
      bare.samplesPerS);
  std::printf(
      "  pipeline (2 stages), with peer-RAM versions:    1F1B %8.3f ms/step measured (%.3f ms "
      "of it in sends and receives), %8.3f ms predicted (x%.3f); %8.1f samples/s\n",
      pp.measuredIterationS * 1e3, pp.waitS * 1e3, pp.predictedIterationS * 1e3, ratio(pp),
      pp.samplesPerS);
  std::printf("  data parallel:                                  %8.1f samples/s\n",
              dp.samplesPerS);
  const double iterRatio = ratio(bare);
  double ppVsDp = dp.samplesPerS > 0 ? pp.samplesPerS / dp.samplesPerS : 0;
  double peerRatio = pp.samplesPerS > 0 ? bare.samplesPerS / pp.samplesPerS : 0;

  IterationFigures f;
  f.p2pRatio = tcp / sinew;
  f.iterRatio = iterRatio;
  f.ppVsDp = ppVsDp;
  f.peerRatio = peerRatio;
  f.iterRatioWithPeerRam = ratio(pp);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 60;
  if (argc == 3 && std::string(argv[1]) == "--steps") steps = std::max(15, std::atoi(argv[2]));
  at::set_num_threads(1);
  const IterationFigures it = runIterations(steps);
  std::vector<double> autotunedRatios;
  std::vector<CopyRun> copies = runCopies(autotunedRatios);
  const CopyFigures cf = printCopies(std::move(copies), autotunedRatios);
  std::printf(
      "RESULT pp_iter_vs_model=%.3f p2p_ratio_vs_tcp=%.3f pp_vs_dp=%.3f peer_ram_step_ratio=%.3f "
      "pp_iter_vs_model_with_peer_ram=%.3f layer_copy_ratio_vs_tcp=%.3f "
      "layer_copy_all_ratio_vs_tcp=%.3f layer_copy_concurrent_ratio_vs_tcp=%.3f "
      "chunked_exchange_ratio_vs_tcp=%.3f chunked_exchange_concurrent_ratio_vs_tcp=%.3f "
      "layer_copy_ratio_vs_fresh_tcp=%.3f layer_copy_ratio_vs_tcp_autotuned_lanes=%.3f\n",
      it.iterRatio, it.p2pRatio, it.ppVsDp, it.peerRatio, it.iterRatioWithPeerRam, cf.largestRatio,
      cf.allRatio, cf.concurrentRatio, cf.chunkedRatio, cf.concurrentChunkedRatio, cf.freshRatio,
      cf.autotunedRatio);
  return 0;
}
