// sinew-bench-checkpoint: a ~100 M-parameter float32 MLP trained with Adam, three ways:
// no checkpoint; a Sinew lazy snapshot every step (SnapshotArena, copy overlapped with the
// next forward/backward, waitBeforeUpdate() before the optimizer step) replicated to a
// peer process's ReplicaService over loopback TCP; and a synchronous torch::save of the
// same state every step. Stall = time the step waits for checkpointing. Also measured in
// the same run: memcpy bandwidth, and replication of one version vs a raw loopback TCP
// stream of the same bytes to the same peer process.
//
// Usage: sinew-bench-checkpoint [steps=6] [width=4096] [layers=6] [batch=16] [--device cuda]
// The peer runs in a child forked before libtorch starts any thread.
//
// --device cuda (docs/gpu.md; needs a GPU): the model and its Adam state live on the GPU, the
// snapshot copies them into the pinned arena on a side stream (no replication), each step is
// timed up to the end of its work on the default stream, and the same run measures a plain
// cudaMemcpyAsync of the same bytes into pinned memory. Defaults there: 20 steps, batch 8192
// (so that forward and backward take about as long as a real step does next to the copy).
// Last line: RESULT gpu_snapshot_ratio_vs_memcpy=<r> gpu_stall_pct_of_step=<p>, where r is
// the snapshot's copy throughput over the plain copy's and p is the step time added by a
// snapshot every step over the no-checkpoint step time, in percent.

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>
#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <type_traits>
#include <vector>

#include "sinew/checkpoint/replica.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/config.h"

#if SINEW_WITH_NCCL
#include <cuda_runtime_api.h>
#endif

using namespace sinew::checkpoint;
using Clock = std::chrono::steady_clock;

namespace {

// The job token of the bench's replica service and client.
constexpr uint64_t kBenchToken = 0xbe7c4;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Child: a replica service and a raw TCP sink; writes both ports to the pipe, then serves
// until the parent closes the pipe.
void runPeer(int writeFd, int readFd) {
  ReplicaServiceOptions so;
  so.token = kBenchToken;
  ReplicaService service(1, so);
  int ls = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::listen(ls, 4);
  socklen_t len = sizeof(a);
  ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  uint16_t ports[2] = {service.port(), ntohs(a.sin_port)};
  if (::write(writeFd, ports, sizeof(ports)) != sizeof(ports)) _exit(2);
  std::thread sink([ls] {
    std::vector<char> buf(4 << 20);
    for (;;) {
      int c = ::accept(ls, nullptr, nullptr);
      if (c < 0) return;
      while (::recv(c, buf.data(), buf.size(), 0) > 0) {
      }
      ::close(c);
    }
  });
  char b;
  while (::read(readFd, &b, 1) > 0) {
  }
  _exit(0);  // Parent is done.
}

struct Model {
  std::vector<torch::nn::Linear> layers;
  std::unique_ptr<torch::optim::Adam> adam;
  torch::Tensor input, target;
};

// Adam's state is keyed by the parameter's TensorImpl: its address printed as text in
// libtorch 1.x, the address itself (void*) in 2.x. Both compile.
template <typename StateMap>
auto findParamState(StateMap& st, const torch::Tensor& p) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << static_cast<const void*>(p.unsafeGetTensorImpl());
    return st.find(key.str());
  } else {
    return st.find(static_cast<Key>(p.unsafeGetTensorImpl()));
  }
}

ShardState stateOf(Model& m) {
  ShardState s;
  auto& st = m.adam->state();
  for (size_t i = 0; i < m.layers.size(); ++i) {
    LayerState l;
    l.name = "layers." + std::to_string(i);
    for (auto* p : {&m.layers[i]->weight, &m.layers[i]->bias}) {
      std::string n = p == &m.layers[i]->weight ? "weight" : "bias";
      l.tensors.push_back({n, p->data()});
      auto it = findParamState(st, *p);
      if (it != st.end()) {
        auto& as = static_cast<torch::optim::AdamParamState&>(*it->second);
        l.tensors.push_back(NamedTensor{n + ".exp_avg", as.exp_avg()});
        l.tensors.push_back(NamedTensor{n + ".exp_avg_sq", as.exp_avg_sq()});
      }
    }
    s.push_back(std::move(l));
  }
  return s;
}

// Returns the loss. Reading it waits for the GPU, as a training loop does before its
// optimizer step (Sinew's trainer reads every microbatch's loss and reduces the gradients).
double forwardBackward(Model& m) {
  m.adam->zero_grad();
  torch::Tensor x = m.input;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    x = m.layers[i]->forward(x);
    if (i + 1 < m.layers.size()) x = torch::relu(x);
  }
  torch::Tensor loss = torch::mse_loss(x, m.target);
  loss.backward();
  return loss.item<double>();
}

struct Run {
  double step = 0, stall = 0;
};

// Trains `warmup` untimed then `steps` timed steps: forward and backward, beforeUpdate(), the
// optimizer step, afterStep(step), then endStep() (on a GPU: wait for the default stream).
// Stall is the time the two hooks took. Prints one line.
Run timeSteps(Model& m, const char* name, int steps, int warmup,
              const std::function<double(int64_t)>& afterStep,
              const std::function<double()>& beforeUpdate, const std::function<void()>& endStep) {
  Run r;
  for (int64_t s = 0; s < steps + warmup; ++s) {
    auto t0 = Clock::now();
    forwardBackward(m);
    double stall = beforeUpdate ? beforeUpdate() : 0;
    m.adam->step();
    stall += afterStep ? afterStep(s) : 0;
    if (endStep) endStep();
    if (s >= warmup) {
      r.step += since(t0);
      r.stall += stall;
    }
  }
  r.step /= steps;
  r.stall /= steps;
  std::printf("%-34s step %8.2f ms   stall %8.3f ms (%.3f%%)\n", name, r.step * 1e3, r.stall * 1e3,
              100 * r.stall / r.step);
  return r;
}

// The hooks of a lazy snapshot every step: snapshot after the update, wait before the next.
std::function<double(int64_t)> snapshotAfter(SnapshotArena& arena, Model& m) {
  return [&arena, &m](int64_t s) {
    auto t = Clock::now();
    arena.snapshot(s, stateOf(m));
    return since(t);
  };
}

std::function<double()> waitBefore(SnapshotArena& arena) {
  return [&arena] {
    auto t = Clock::now();
    arena.waitBeforeUpdate();
    return since(t);
  };
}

// A synchronous torch::save of the whole state to `path` after every update.
std::function<double(int64_t)> torchSaveAfter(Model& m, const std::string& path) {
  return [&m, path](int64_t) {
    auto t = Clock::now();
    std::vector<torch::Tensor> all;
    for (auto& l : stateOf(m)) {
      for (auto& t2 : l.tensors) all.push_back(t2.tensor);
    }
    torch::save(all, path);
    return since(t);
  };
}

#if SINEW_WITH_NCCL
void cudaCheck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Waits for the work queued on the default stream (not for the snapshot's side stream).
void syncDefault() { cudaCheck(cudaStreamSynchronize(cudaStreamLegacy), "sync"); }

int benchGpu(int steps, int64_t width, int nlayers, int64_t batch) {
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "sinew-bench-checkpoint: --device cuda: this libtorch has no CUDA\n");
    return 2;
  }
  const at::Device dev(at::kCUDA, 0);
  torch::manual_seed(0);
  Model m;
  std::vector<torch::Tensor> params;
  for (int i = 0; i < nlayers; ++i) {
    m.layers.emplace_back(width, width);
    m.layers.back()->to(dev);
    for (auto& p : m.layers.back()->parameters()) params.push_back(p);
  }
  int64_t nparams = 0;
  for (auto& p : params) nparams += p.numel();
  m.adam = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-4));
  m.input = torch::randn({batch, width}, dev);
  m.target = torch::randn({batch, width}, dev);
  forwardBackward(m);
  m.adam->step();
  syncDefault();
  ShardState state = stateOf(m);
  uint64_t stateBytes = 0;
  for (auto& l : state) {
    for (auto& t : l.tensors) stateBytes += t.tensor.numel() * t.tensor.element_size();
  }
  std::printf("model on cuda:0: %d layers of %lldx%lld, batch %lld, %.1f M params, state %.2f GB\n",
              nlayers, static_cast<long long>(width), static_cast<long long>(width),
              static_cast<long long>(batch), nparams / 1e6, stateBytes / 1e9);

  // Each step timed until its work on the default stream is done; the stall is the host's.
  auto train = [&](const char* name, const std::function<double(int64_t)>& afterStep,
                   const std::function<double()>& beforeUpdate) {
    return timeSteps(m, name, steps, 2, afterStep, beforeUpdate, syncDefault);
  };
  Run none = train("no checkpoint", nullptr, nullptr);
  SnapshotArena arena(state, SnapshotOptions());
  Run snap = train("sinew snapshot every step", snapshotAfter(arena, m), waitBefore(arena));
  arena.waitComplete();
  auto stats = arena.stats();
  std::printf("  snapshots taken %lld, skipped %lld\n", static_cast<long long>(stats.taken),
              static_cast<long long>(stats.skipped));
  Run none2 = train("no checkpoint (again)", nullptr, nullptr);
  const std::string path = "/tmp/sinew-bench-checkpoint-gpu.pt";
  Run save = train("torch::save every step", torchSaveAfter(m, path), nullptr);
  ::unlink(path.c_str());

  // Copy throughput on an idle GPU, best of 5 each, interleaved: the snapshot (one
  // cudaMemcpyAsync per tensor on its side stream) against one cudaMemcpyAsync of the same
  // bytes from one device buffer into pinned memory.
  at::Tensor src =
      at::empty({static_cast<int64_t>(stateBytes)}, at::TensorOptions(at::kByte).device(dev));
  at::Tensor dst = at::empty({static_cast<int64_t>(stateBytes)},
                             at::TensorOptions(at::kByte).pinned_memory(true));
  cudaStream_t stream;
  cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  double snapBest = 1e9, memcpyBest = 1e9, completeBest = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    cudaCheck(cudaDeviceSynchronize(), "sync");
    auto t = Clock::now();
    cudaCheck(
        cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), stateBytes, cudaMemcpyDeviceToHost, stream),
        "memcpy");
    cudaCheck(cudaStreamSynchronize(stream), "sync");
    memcpyBest = std::min(memcpyBest, since(t));
    cudaCheck(cudaDeviceSynchronize(), "sync");
    t = Clock::now();
    arena.waitBeforeUpdate();
    if (!arena.snapshot(1000 + rep, stateOf(m))) {
      std::fprintf(stderr, "snapshot skipped\n");
      return 1;
    }
    cudaCheck(cudaDeviceSynchronize(), "sync");  // Every stream: the side stream's copies.
    snapBest = std::min(snapBest, since(t));
    arena.waitComplete();  // And the checksums.
    completeBest = std::min(completeBest, since(t));
  }
  cudaStreamDestroy(stream);
  const double gb = stateBytes / 1e9;
  std::printf(
      "copy of %.2f GB to pinned memory: cudaMemcpyAsync %.2f GB/s, snapshot %.2f GB/s "
      "(%.2f GB/s with its crc32c)\n",
      gb, gb / memcpyBest, gb / snapBest, gb / completeBest);
  const double base = (none.step + none2.step) / 2;
  const double stallPct = std::max(0.0, snap.step - base) / base * 100;
  const double savePct = std::max(0.0, save.step - base) / base * 100;
  std::printf(
      "step time added per step: sinew snapshot %.3f ms (%.2f%%), torch::save %.1f ms "
      "(%.1f%%); no-checkpoint runs %.2f and %.2f ms\n",
      (snap.step - base) * 1e3, stallPct, (save.step - base) * 1e3, savePct, none.step * 1e3,
      none2.step * 1e3);
  std::printf("RESULT gpu_snapshot_ratio_vs_memcpy=%.3f gpu_stall_pct_of_step=%.3f\n",
              memcpyBest / snapBest, stallPct);
  return stats.skipped == 0 ? 0 : 1;
}
#endif

// The benchmark's MLP of `nlayers` width x width layers on a fixed batch, with Adam's state
// made by one step.
Model buildModel(int nlayers, int64_t width, int64_t batch) {
  torch::manual_seed(0);
  Model m;
  std::vector<torch::Tensor> params;
  for (int i = 0; i < nlayers; ++i) {
    m.layers.emplace_back(width, width);
    for (auto& p : m.layers.back()->parameters()) params.push_back(p);
  }
  m.adam = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-4));
  m.input = torch::randn({batch, width});
  m.target = torch::randn({batch, width});
  forwardBackward(m);
  m.adam->step();  // Creates Adam's state.
  return m;
}

int64_t parameterCount(Model& m) {
  int64_t n = 0;
  for (auto& l : m.layers) {
    for (auto& p : l->parameters()) n += p.numel();
  }
  return n;
}

// Replicates each completed snapshot of `arena` to the peer through `client`, from a thread of
// its own; a version that completes while the last one is still being sent replaces the one
// waiting.
class Replicator {
 public:
  Replicator(SnapshotArena& arena, ReplicaClient& client) : client_(client) {
    arena.setOnComplete([this](std::shared_ptr<const HostShard> s) {
      std::lock_guard<std::mutex> lock(mu_);
      pending_ = std::move(s);
      cv_.notify_all();
    });
    thread_ = std::thread([this] { run(); });
  }
  ~Replicator() { stop(); }
  // Stops the thread; the versions replicated.
  int64_t stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
    return replicated_;
  }

 private:
  void run() {
    for (;;) {
      std::shared_ptr<const HostShard> s;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || pending_; });
        if (stop_) return;
        s = std::move(pending_);
        pending_ = nullptr;
      }
      client_.put(*s);
      replicated_++;
    }
  }

  ReplicaClient& client_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<const HostShard> pending_;
  bool stop_ = false;
  std::atomic<int64_t> replicated_{0};
  std::thread thread_;
};

// One transfer of `bytes` over a new loopback connection to the peer's sink on `port`, until
// the sink has read everything and closed: GB/s, or -1 if the connection failed.
double rawTcpGbps(const uint8_t* data, uint64_t bytes, uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  const auto t = Clock::now();
  for (uint64_t off = 0; off < bytes;) {
    ssize_t w = ::send(fd, data + off, std::min<uint64_t>(bytes - off, 4 << 20), 0);
    if (w <= 0) {
      ::close(fd);
      return -1;
    }
    off += static_cast<uint64_t>(w);
  }
  ::shutdown(fd, SHUT_WR);
  char c;
  while (::recv(fd, &c, 1, 0) > 0) {  // Until the sink has read everything and closed.
  }
  const double gbps = bytes / since(t) / 1e9;
  ::close(fd);
  return gbps;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Step stall of lazy snapshots + replication vs torch::save vs no checkpoint.",
               "sinew-bench-checkpoint");
  int steps = 6, nlayers = 6;
  int64_t width = 4096, batch = 16;
  app.add_option("steps", steps, "training steps per variant")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("width", width, "hidden width of the MLP")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("layers", nlayers, "linear layers")
      ->check(CLI::Range(1, 10000))
      ->capture_default_str();
  app.add_option("batch", batch, "batch size")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  std::string device = "cpu";
  app.add_option("--device", device, "where the model trains: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const bool gpu = device == "cuda";
  if (gpu) {
#if SINEW_WITH_NCCL
    if (app.count("steps") == 0) steps = 20;
    if (app.count("batch") == 0) batch = 8192;
    return benchGpu(steps, width, nlayers, batch);  // No replication peer.
#else
    std::fprintf(stderr, "sinew-bench-checkpoint: --device cuda needs Sinew built with CUDA\n");
    return 2;
#endif
  }

  int up[2], down[2];
  if (::pipe(up) != 0 || ::pipe(down) != 0) return 1;
  pid_t peer = ::fork();
  if (peer == 0) {
    ::close(up[0]);
    ::close(down[1]);
    runPeer(up[1], down[0]);
  }
  ::close(up[1]);
  ::close(down[0]);
  uint16_t ports[2];
  if (::read(up[0], ports, sizeof(ports)) != sizeof(ports)) return 1;
  const std::string replicaAddr = "127.0.0.1:" + std::to_string(ports[0]);

  Model m = buildModel(nlayers, width, batch);
  ShardState state = stateOf(m);
  uint64_t stateBytes = 0;
  for (auto& l : state) {
    for (auto& t : l.tensors) stateBytes += t.tensor.numel() * t.tensor.element_size();
  }
  std::printf(
      "model: %d layers of %lldx%lld, %.1f M params, checkpoint state %.2f GB, %d threads\n",
      nlayers, static_cast<long long>(width), static_cast<long long>(width),
      parameterCount(m) / 1e6, stateBytes / 1e9, at::get_num_threads());

  auto train = [&](const char* name, const std::function<double(int64_t)>& afterStep,
                   const std::function<double()>& beforeUpdate) {
    return timeSteps(m, name, steps, 1, afterStep, beforeUpdate, nullptr);
  };

  Run none = train("no checkpoint", nullptr, nullptr);

  // Sinew: snapshot after the step, wait before the next update, replicate each version.
  SnapshotArena arena(state, SnapshotOptions());
  ReplicaClientOptions co;
  co.token = kBenchToken;
  co.timeout = std::chrono::milliseconds(120000);
  ReplicaClient client(1, replicaAddr, co);
  Replicator replicator(arena, client);
  Run sinewRun = train("sinew snapshot + replication", snapshotAfter(arena, m), waitBefore(arena));
  arena.waitBeforeUpdate();
  auto snapStats = arena.stats();
  const int64_t replicated = replicator.stop();
  std::printf("  snapshots taken %lld, skipped %lld, versions replicated %lld\n",
              static_cast<long long>(snapStats.taken), static_cast<long long>(snapStats.skipped),
              static_cast<long long>(replicated));

  const std::string path = "/tmp/sinew-bench-checkpoint.pt";
  Run save = train("torch::save every step", torchSaveAfter(m, path), nullptr);
  ::unlink(path.c_str());

  // Bandwidths of one version: memcpy, the snapshot copy, replication vs raw TCP.
  auto latest = arena.latest();
  const uint64_t bytes = latest->layout.totalBytes;
  std::vector<uint8_t> dst(bytes, 1);
  auto t = Clock::now();
  std::memcpy(dst.data(), latest->data(), bytes);
  const double memcpyGbps = bytes / since(t) / 1e9;
  const double snapshotGbps = snapStats.bytesCopied / snapStats.copySeconds / 1e9;
  double replGbps = 0, rawGbps = 0;
  for (int rep = 0; rep < 2; ++rep) {  // Best of two each, interleaved.
    t = Clock::now();
    client.put(*latest);
    replGbps = std::max(replGbps, bytes / since(t) / 1e9);
    const double raw = rawTcpGbps(latest->data(), bytes, ports[1]);
    if (raw < 0) return 1;
    rawGbps = std::max(rawGbps, raw);
  }
  std::printf(
      "memcpy %.2f GB/s, snapshot copy+crc32c %.2f GB/s, replication %.2f GB/s, raw TCP %.2f "
      "GB/s\n",
      memcpyGbps, snapshotGbps, replGbps, rawGbps);
  ::close(down[1]);
  ::waitpid(peer, nullptr, 0);
  const double stallPct = 100 * sinewRun.stall / sinewRun.step;
  const double ratio = sinewRun.stall > 0 ? save.stall / sinewRun.stall : 0;
  std::printf(
      "RESULT stall_pct_of_step=%.3f stall_ratio_vs_torch_save=%.1f snapshot_gbps=%.2f "
      "memcpy_gbps=%.2f replication_ratio_vs_tcp=%.2f\n",
      stallPct, ratio, snapshotGbps, memcpyGbps, replGbps / rawGbps);
  (void)none;
  return 0;
}
