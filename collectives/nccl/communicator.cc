// NCCL backend of Communicator, for CUDA tensors.
//
// NCCL cannot say which peer died and a plain NCCL call can hang forever, so:
//  1. The communicator is created non-blocking (ncclConfig_t.blocking = 0) and every
//     call's completion, like the initialisation, is polled against the deadline:
//     cudaStreamQuery, ncclCommGetAsyncError, the abort flag and the sentinel.
//  2. The sentinel is a Gloo communicator among the same members (name + "/sentinel")
//     that carries no data: its watchers notice a member whose process died and name it,
//     and its goodbyes tell the other members when this one fails.
//  3. On any failure the sentinel is destroyed, which tells the peers, and every later call
//     throws the same error. The NCCL communicator is aborted (ncclCommAbort), or where this
//     NCCL can shrink one (>= 2.27, and SINEW_NCCL_SHRINK is not 0) and revoke one (>= 2.28)
//     revoked (ncclCommRevoke: its work on the GPU ends, it stays usable for a shrink). One
//     that was revoked, or aborted by abort() with no call failing, is kept when this
//     communicator is destroyed, for the next communicator of the same name and member id
//     (its parent).
//  4. The next communicator's members say which parent they hold ("parent/<rank>"); rank 0
//     decides ("setup"): all of the new members hold the same parent and the new list is that
//     list without some members, in order: ncclCommShrink (NCCL_SHRINK_ABORT after a failure);
//     the parent's members, all healthy, are the new list's first ranks and the rest joined
//     (NCCL >= 2.29): ncclCommGrow; otherwise a fresh ncclCommInitRankConfig. A parent that
//     is not used is aborted (docs/collectives.md, "NCCL: shrink and grow").
// Operations run on a stream of our own created without cudaStreamNonBlocking, so they
// are ordered after work queued on the legacy default stream (libtorch's default); each
// call returns after its stream work completed.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <ATen/ATen.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/collectives/nccl/membership.h"
#include "sinew/collectives/prefix_store.h"
#include "sinew/communicator.h"

#ifndef NCCL_VERSION_CODE
#define NCCL_VERSION_CODE 0
#endif
#ifndef NCCL_VERSION
#define NCCL_VERSION(X, Y, Z) ((X)*10000 + (Y)*100 + (Z))
#endif
// In-place membership changes: ncclCommShrink (2.27) and ncclCommGrow (2.29).
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
#define SINEW_NCCL_SHRINK 1
#else
#define SINEW_NCCL_SHRINK 0
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define SINEW_NCCL_REVOKE 1
#else
#define SINEW_NCCL_REVOKE 0
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
#define SINEW_NCCL_GROW 1
#else
#define SINEW_NCCL_GROW 0
#endif

namespace sinew {
namespace collectives {
namespace {

using Clock = std::chrono::steady_clock;

// How often a waiting call polls the stream and NCCL's asynchronous error.
constexpr std::chrono::microseconds kPollInterval{50};

// A communicator left for the next one of its name and member id (protocol step 3).
struct Parent {
  ncclComm_t comm = nullptr;
  int device = 0;
  int64_t epoch = -1;
  std::vector<int> members;
  bool healthy = false;  // No call failed or was given up on: nothing is outstanding.

  // The announcement (nccl_membership::announce).
  std::string announce() const {
    return nccl_membership::announce(comm != nullptr, epoch, members, healthy);
  }
  // Frees the communicator without waiting for anyone (ncclCommAbort is local).
  void release() {
    if (comm == nullptr) return;
    cudaSetDevice(device);
    ncclCommAbort(comm);
    comm = nullptr;
  }
};

// Whether failed communicators are kept for a shrink: this NCCL can, and SINEW_NCCL_SHRINK
// is not "0".
bool keepParents() {
  if (!SINEW_NCCL_SHRINK) return false;
  const char* v = std::getenv("SINEW_NCCL_SHRINK");
  return v == nullptr || std::string(v) != "0";
}

// This process's parents by communicator name and member id. A forked child starts with none
// (the parent process's NCCL state is not usable there).
class Parents {
 public:
  static Parents& instance() {
    static Parents* p = new Parents;  // Never destroyed: no order at exit to get wrong.
    return *p;
  }
  void put(const std::string& name, int self, Parent parent) {
    std::lock_guard<std::mutex> lock(mu_);
    check();
    auto& slot = byName_[name + "\n" + std::to_string(self)];
    slot.release();
    slot = parent;
  }
  // The parent of `name` for member `self`, if any. Parents of other names that an epoch
  // before `epoch - 1` left are freed: the epoch after theirs did not use them, and each holds
  // its communicator's device memory.
  Parent take(const std::string& name, int self, int64_t epoch) {
    std::lock_guard<std::mutex> lock(mu_);
    check();
    for (auto it = byName_.begin(); it != byName_.end();) {
      if (it->second.epoch < epoch - 1) {
        it->second.release();
        it = byName_.erase(it);
      } else {
        ++it;
      }
    }
    auto it = byName_.find(name + "\n" + std::to_string(self));
    if (it == byName_.end()) return {};
    Parent p = it->second;
    byName_.erase(it);
    return p;
  }

 private:
  void check() {
    if (pid_ == ::getpid()) return;
    byName_.clear();  // Inherited from the parent process: not ours to free.
    pid_ = ::getpid();
  }
  std::mutex mu_;
  pid_t pid_ = -1;
  std::map<std::string, Parent> byName_;
};

using nccl_membership::SetUp;

ncclDataType_t ncclType(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
    case at::kBFloat16:
      return ncclBfloat16;
#endif
    case at::kLong:
      return ncclInt64;
    case at::kInt:
      return ncclInt32;
    case at::kByte:
      return ncclUint8;
    case at::kChar:
      return ncclInt8;
    default:
      SINEW_THROW(InvalidArgument, "nccl: unsupported dtype ", dtypeName(t));
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const std::shared_ptr<Store>& store, const CommunicatorOptions& options);
  ~NcclCommunicator() override;

  const char* backend() const override { return "nccl"; }
  std::string setUp() const override { return how_; }
  void allreduce(at::Tensor& t, ReduceOp op, std::chrono::milliseconds timeout) override;
  void broadcast(at::Tensor& t, int root, std::chrono::milliseconds timeout) override;
  void allgather(at::Tensor& output, const at::Tensor& input,
                 std::chrono::milliseconds timeout) override;
  void send(const at::Tensor& t, int dst, uint32_t tag, std::chrono::milliseconds timeout) override;
  void recv(at::Tensor& t, int src, uint32_t tag, std::chrono::milliseconds timeout) override;
  void exchange(const std::vector<P2POp>& ops, std::chrono::milliseconds timeout) override;
  void barrier(std::chrono::milliseconds timeout) override;
  void abort() override;
  std::exception_ptr error() const override;

 private:
  std::string describe() const;
  void validate(const at::Tensor& t, const char* op) const;
  void checkCuda(cudaError_t e, const char* what);
  // Runs one NCCL call and waits for its completion (protocol step 1).
  template <typename F>
  void run(const char* name, std::chrono::milliseconds timeout, F&& enqueue);
  // Polls until NCCL leaves ncclInProgress (and, if wantStream, the stream drained).
  void waitFor(const char* name, Clock::time_point deadline, std::chrono::milliseconds timeout,
               bool wantStream);
  [[noreturn]] void failAndThrow(std::exception_ptr error);
  // Protocol step 4: announces `parent`, and returns rank 0's verdict and the unique id that
  // goes with it (init, grow).
  std::pair<SetUp, ncclUniqueId> decide(Store& store, const Parent& parent,
                                        Clock::time_point deadline);
  // Rank 0: the verdict from every member's announcement.
  SetUp verdict(Store& store, const Parent& parent, Clock::time_point deadline);
  // Starts comm_ as `how` says (from `parent` for a shrink or a grow).
  void start(SetUp how, const ncclUniqueId& id, Parent& parent);

  ncclComm_t comm_ = nullptr;
  bool ncclAborted_ = false;  // Operation thread (and destructor) only.
  bool ready_ = false;        // comm_ finished its set-up (only then can it be a parent).
  bool interrupted_ = false;  // Operation thread only: a call failed or was given up on.
  bool revoked_ = false;      // Operation thread only: ncclCommRevoke ended its work.
  const char* how_ = "init";  // How comm_ was set up: "init", "shrink" or "grow".
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  std::atomic<bool> abortRequested_{false};

  mutable std::mutex mu_;
  // Guarded by mu_.
  std::exception_ptr failure_;
  std::unique_ptr<Communicator> sentinel_;  // Null once failed.
};

std::string NcclCommunicator::describe() const {
  std::ostringstream os;
  os << "communicator '" << options_.name << "' (nccl, epoch " << epoch() << ", worker " << self()
     << ", rank " << rank_ << "/" << size() << ", cuda:" << device_ << ")";
  return os.str();
}

void NcclCommunicator::checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    SINEW_THROW(IoError, describe(), ": ", what, ": ", cudaGetErrorString(e));
  }
}

NcclCommunicator::NcclCommunicator(const std::shared_ptr<Store>& store,
                                   const CommunicatorOptions& options)
    : Communicator(options) {
  auto deadline = Clock::now() + options_.initTimeout;
  if (options_.device >= 0) {
    device_ = options_.device;
  } else {
    checkCuda(cudaGetDevice(&device_), "cudaGetDevice");
  }
  checkCuda(cudaSetDevice(device_), "cudaSetDevice");

  CommunicatorOptions sentinelOptions = options_;
  sentinelOptions.name = options_.name + "/sentinel";
  sentinel_ = createGlooCommunicator(store, sentinelOptions);

  auto prefixed = std::make_shared<PrefixStore>(
      "sinew/comm/" + options_.name + "/epoch/" + std::to_string(epoch()) + "/nccl", store);
  Parent parent =
      keepParents() ? Parents::instance().take(options_.name, self(), epoch()) : Parent{};
  try {
    const auto [how, id] = decide(*prefixed, parent, deadline);
    start(how, id, parent);
    waitFor(how == SetUp::kInit ? "init" : how_, deadline, options_.initTimeout,
            /*wantStream=*/false);
  } catch (...) {
    parent.release();
    throw;
  }
  parent.release();  // The new communicator no longer needs it.
  ready_ = true;
  checkCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamDefault), "cudaStreamCreate");
}

std::pair<SetUp, ncclUniqueId> NcclCommunicator::decide(Store& store, const Parent& parent,
                                                        Clock::time_point deadline) {
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  const std::string mine = parent.announce();
  store.set("parent/" + std::to_string(rank_), Bytes(mine.begin(), mine.end()));
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank_ == 0) {
    const SetUp how = verdict(store, parent, deadline);
    if (how == SetUp::kInit) {
      ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) {
        SINEW_THROW(IoError, describe(), ": ncclGetUniqueId: ", ncclGetErrorString(r));
      }
    }
#if SINEW_NCCL_GROW
    if (how == SetUp::kGrow) {
      ncclResult_t r = ncclCommGetUniqueId(parent.comm, &id);
      if (r != ncclSuccess) {
        SINEW_THROW(IoError, describe(), ": ncclCommGetUniqueId: ", ncclGetErrorString(r));
      }
    }
#endif
    Bytes b(1 + sizeof(id));
    b[0] = static_cast<uint8_t>(how);
    std::memcpy(b.data() + 1, &id, sizeof(id));
    store.set("setup", b);
    return {how, id};
  }
  Bytes b = store.get("setup", left());
  if (b.size() != 1 + sizeof(id) || b[0] < 1 || b[0] > 4) {
    SINEW_THROW(Corruption, describe(), ": the set-up verdict has ", b.size(), " bytes (kind ",
                b.empty() ? 0 : int(b[0]), "), expected ", 1 + sizeof(id));
  }
  std::memcpy(&id, b.data() + 1, sizeof(id));
  return {static_cast<SetUp>(b[0]), id};
}

SetUp NcclCommunicator::verdict(Store& store, const Parent& parent, Clock::time_point deadline) {
  if (!keepParents()) return SetUp::kInit;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  std::vector<std::string> said(size());
  for (int r = 0; r < size(); ++r) {
    if (r == 0) {
      said[r] = parent.announce();
      continue;
    }
    const Bytes b = store.get("parent/" + std::to_string(r), left());
    said[r].assign(b.begin(), b.end());
  }
  return nccl_membership::decide(said, options_.members, epoch(), SINEW_NCCL_SHRINK != 0,
                                 SINEW_NCCL_GROW != 0);
}

void NcclCommunicator::start(SetUp how, const ncclUniqueId& id, Parent& parent) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t r = ncclSuccess;
  if (how == SetUp::kShrink || how == SetUp::kShrinkAbort) {
#if SINEW_NCCL_SHRINK
    how_ = "shrink";
    if (parent.comm == nullptr) SINEW_THROW(InternalError, describe(), ": shrink without a parent");
    std::vector<int> excluded;
    for (size_t r0 = 0; r0 < parent.members.size(); ++r0) {
      const int w = parent.members[r0];
      if (std::find(options_.members.begin(), options_.members.end(), w) ==
          options_.members.end()) {
        excluded.push_back(static_cast<int>(r0));
      }
    }
    if (how == SetUp::kShrinkAbort) {
      // A revoked parent becomes quiescent (ncclSuccess) on its own; wait for it briefly.
      ncclResult_t state = ncclInProgress;
      const auto until = Clock::now() + std::chrono::seconds(2);
      while (ncclCommGetAsyncError(parent.comm, &state) == ncclSuccess && state == ncclInProgress &&
             Clock::now() < until) {
        std::this_thread::sleep_for(kPollInterval);
      }
    }
    r = ncclCommShrink(parent.comm, excluded.data(), static_cast<int>(excluded.size()), &comm_,
                       &config, how == SetUp::kShrink ? NCCL_SHRINK_DEFAULT : NCCL_SHRINK_ABORT);
    if (r != ncclSuccess && r != ncclInProgress) {
      SINEW_THROW(IoError, describe(), ": ncclCommShrink: ", ncclGetErrorString(r));
    }
    return;
#endif
  }
  if (how == SetUp::kGrow) {
#if SINEW_NCCL_GROW
    how_ = "grow";
    const bool existing = parent.comm != nullptr;
    r = ncclCommGrow(existing ? parent.comm : nullptr, size(),
                     (!existing || rank_ == 0) ? &id : nullptr, existing ? -1 : rank_, &comm_,
                     &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      SINEW_THROW(IoError, describe(), ": ncclCommGrow: ", ncclGetErrorString(r));
    }
    return;
#endif
  }
  (void)parent;
  how_ = "init";
  r = ncclCommInitRankConfig(&comm_, size(), id, rank_, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    SINEW_THROW(IoError, describe(), ": ncclCommInitRankConfig: ", ncclGetErrorString(r));
  }
}

NcclCommunicator::~NcclCommunicator() {
  const bool ended = revoked_ || abortRequested_.load() || error() != nullptr;
  if (comm_ != nullptr && !ncclAborted_ && ready_ && keepParents() && ended) {
    // Left for the next communicator of this name (protocol step 3), if it failed or was
    // aborted (an epoch ended); one that does not use it frees it. One destroyed in good
    // order (the job's end) is finalized as before.
    Parent p;
    p.comm = comm_;
    p.device = device_;
    p.epoch = epoch();
    p.members = options_.members;
    // Interrupted, it was revoked: nothing of it runs any more, but it must be quiescent
    // before a shrink (NCCL_SHRINK_ABORT also covers one that is not yet).
    p.healthy = !interrupted_;
    Parents::instance().put(options_.name, self(), p);
    comm_ = nullptr;
  }
  if (comm_ != nullptr && !ncclAborted_) {
    bool failed = error() != nullptr || abortRequested_.load();
    if (failed) {
      ncclCommAbort(comm_);
    } else {
      // A healthy communicator is finalized, bounded by a deadline.
      cudaSetDevice(device_);
      if (stream_) cudaStreamSynchronize(stream_);
      ncclCommFinalize(comm_);
      ncclResult_t state = ncclInProgress;
      auto deadline = Clock::now() + std::chrono::seconds(5);
      while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(kPollInterval);
      }
      if (state == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
  }
  if (stream_) cudaStreamDestroy(stream_);
  std::unique_ptr<Communicator> sentinel;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sentinel = std::move(sentinel_);
  }
}

void NcclCommunicator::failAndThrow(std::exception_ptr error) {
  std::unique_ptr<Communicator> sentinel;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) failure_ = error;
    error = failure_;
    sentinel = std::move(sentinel_);
  }
  // Protocol step 3. Only the operation thread touches comm_, so no call can race this.
  // Work still on the GPU must end now either way: a kernel that waits for a dead peer would
  // hold back everything libtorch queues on the default stream, which this stream is ordered
  // with. Revoked (NCCL >= 2.28), the communicator can still be shrunk once quiescent; else
  // it is aborted and will be no parent.
  interrupted_ = true;
  if (comm_ != nullptr && !ncclAborted_) {
#if SINEW_NCCL_REVOKE
    if (ready_ && keepParents() && !revoked_) {
      revoked_ = ncclCommRevoke(comm_, NCCL_REVOKE_DEFAULT) == ncclSuccess;
    }
#endif
    if (!revoked_) {
      ncclCommAbort(comm_);
      ncclAborted_ = true;
    }
  }
  if (sentinel) {
    sentinel->abort();
    sentinel.reset();  // Its goodbyes tell the other members.
  }
  std::rethrow_exception(error);
}

void NcclCommunicator::waitFor(const char* name, Clock::time_point deadline,
                               std::chrono::milliseconds timeout, bool wantStream) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      std::ostringstream os;
      os << describe() << ": " << name << ": NCCL error "
         << ncclGetErrorString(r != ncclSuccess ? r : state);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
      const char* last = ncclGetLastError(comm_);
      if (last && *last) os << " (" << last << ")";
#endif
      failAndThrow(std::make_exception_ptr(Aborted(os.str())));
    }
    bool done = state == ncclSuccess;
    if (done && wantStream) {
      cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaErrorNotReady) {
        done = false;
      } else if (q != cudaSuccess) {
        failAndThrow(std::make_exception_ptr(
            IoError(describe() + ": " + name + ": CUDA error " + cudaGetErrorString(q))));
      }
    }
    if (done) return;
    std::exception_ptr peerFailure;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (sentinel_) peerFailure = sentinel_->error();
    }
    if (peerFailure) failAndThrow(peerFailure);
    if (abortRequested_.load()) {
      failAndThrow(std::make_exception_ptr(Aborted(describe() + ": abort() was called")));
    }
    if (Clock::now() > deadline) {
      std::ostringstream os;
      os << describe() << ": " << name << " timed out after " << timeout.count() << " ms";
      failAndThrow(std::make_exception_ptr(Timeout(os.str())));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

template <typename F>
void NcclCommunicator::run(const char* name, std::chrono::milliseconds timeout, F&& enqueue) {
  if (auto e = error()) failAndThrow(e);
  auto deadline = Clock::now() + timeout;
  checkCuda(cudaSetDevice(device_), "cudaSetDevice");
  ncclResult_t r = enqueue();
  if (r != ncclSuccess && r != ncclInProgress) {
    failAndThrow(
        std::make_exception_ptr(Aborted(describe() + ": " + name + ": " + ncclGetErrorString(r))));
  }
  waitFor(name, deadline, timeout, /*wantStream=*/true);
}

void NcclCommunicator::validate(const at::Tensor& t, const char* op) const {
  if (!t.defined() || !t.is_cuda()) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": the nccl backend takes CUDA tensors");
  }
  if (t.device().index() != device_) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": tensor on ", t.device().str(),
                ", communicator on cuda:", device_);
  }
  if (!t.is_contiguous()) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": tensor must be contiguous");
  }
  ncclType(t);
}

void NcclCommunicator::allreduce(at::Tensor& t, ReduceOp op, std::chrono::milliseconds timeout) {
  validate(t, "allreduce");
  timeout = resolveTimeout(timeout);
  bool intAvg = op == ReduceOp::kAvg && t.scalar_type() == at::kLong;
  ncclRedOp_t red = ncclSum;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
  if (op == ReduceOp::kAvg && !intAvg) red = ncclAvg;
  bool divideAfter = intAvg;
#else
  bool divideAfter = op == ReduceOp::kAvg;
#endif
  run("allreduce", timeout, [&] {
    return ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), ncclType(t), red, comm_, stream_);
  });
  if (divideAfter && size() > 1) {
    if (intAvg) {
      t.div_(size(), "trunc");
    } else {
      t.div_(size());
    }
  }
}

void NcclCommunicator::broadcast(at::Tensor& t, int root, std::chrono::milliseconds timeout) {
  validate(t, "broadcast");
  if (root < 0 || root >= size()) {
    SINEW_THROW(InvalidArgument, describe(), ": broadcast root = ", root, " is not a rank in [0, ",
                size(), ")");
  }
  run("broadcast", resolveTimeout(timeout), [&] {
    return ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), ncclType(t), root, comm_, stream_);
  });
}

void NcclCommunicator::allgather(at::Tensor& output, const at::Tensor& input,
                                 std::chrono::milliseconds timeout) {
  validate(input, "allgather");
  validate(output, "allgather");
  if (output.scalar_type() != input.scalar_type() || output.numel() != input.numel() * size()) {
    SINEW_THROW(InvalidArgument, describe(), ": allgather output (", output.numel(), " ",
                dtypeName(output), " elements) must hold ", input.numel() * size(), " ",
                dtypeName(input), " elements");
  }
  run("allgather", resolveTimeout(timeout), [&] {
    return ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(), ncclType(input), comm_,
                         stream_);
  });
}

// NCCL has no tags: messages between two ranks arrive in the order they were sent.
void NcclCommunicator::send(const at::Tensor& t, int dst, uint32_t tag,
                            std::chrono::milliseconds timeout) {
  validate(t, "send");
  if (dst < 0 || dst >= size() || dst == rank_) {
    SINEW_THROW(InvalidArgument, describe(), ": send to rank dst = ", dst,
                " is not another member");
  }
  run("send", resolveTimeout(timeout),
      [&] { return ncclSend(t.data_ptr(), t.numel(), ncclType(t), dst, comm_, stream_); });
}

void NcclCommunicator::recv(at::Tensor& t, int src, uint32_t tag,
                            std::chrono::milliseconds timeout) {
  validate(t, "recv");
  if (src < 0 || src >= size() || src == rank_) {
    SINEW_THROW(InvalidArgument, describe(), ": recv from rank src = ", src,
                " is not another member");
  }
  run("recv", resolveTimeout(timeout),
      [&] { return ncclRecv(t.data_ptr(), t.numel(), ncclType(t), src, comm_, stream_); });
}

void NcclCommunicator::exchange(const std::vector<P2POp>& ops, std::chrono::milliseconds timeout) {
  for (const P2POp& op : ops) {
    validate(op.tensor, op.kind == P2POp::Kind::kSend ? "exchange (send)" : "exchange (recv)");
    if (op.peer < 0 || op.peer >= size() || op.peer == rank_) {
      SINEW_THROW(InvalidArgument, describe(), ": exchange with rank ", op.peer,
                  " is not another member");
    }
  }
  if (ops.empty()) return;
  // One NCCL group: every transfer is posted before any is waited for.
  run("exchange", resolveTimeout(timeout), [&] {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (const P2POp& op : ops) {
      const at::Tensor& t = op.tensor;
      r = op.kind == P2POp::Kind::kSend
              ? ncclSend(t.data_ptr(), t.numel(), ncclType(t), op.peer, comm_, stream_)
              : ncclRecv(t.data_ptr(), t.numel(), ncclType(t), op.peer, comm_, stream_);
      if (r != ncclSuccess && r != ncclInProgress) break;
    }
    ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess && r != ncclInProgress ? r : end;
  });
}

void NcclCommunicator::barrier(std::chrono::milliseconds timeout) {
  at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
  allreduce(one, ReduceOp::kSum, timeout);
}

// The operation thread, which polls the flag every kPollInterval, aborts NCCL itself, so
// ncclCommAbort never races a call on the same communicator.
void NcclCommunicator::abort() {
  abortRequested_.store(true);
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_) failure_ = std::make_exception_ptr(Aborted(describe() + ": abort() was called"));
}

std::exception_ptr NcclCommunicator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_) return failure_;
  return sentinel_ ? sentinel_->error() : nullptr;
}

}  // namespace

std::unique_ptr<Communicator> createNcclCommunicator(const std::shared_ptr<Store>& store,
                                                     const CommunicatorOptions& options) {
  return std::make_unique<NcclCommunicator>(store, options);
}

std::string ncclMembershipChange() {
  std::ostringstream os;
  if (SINEW_NCCL_GROW && keepParents()) {
    os << "shrink and grow";
  } else if (keepParents()) {
    os << "shrink; a join makes a new communicator";
  } else {
    os << "a new communicator";
  }
  os << " (built with NCCL " << NCCL_VERSION_CODE / 10000 << "." << NCCL_VERSION_CODE / 100 % 100
     << "." << NCCL_VERSION_CODE % 100;
  if (SINEW_NCCL_SHRINK && !keepParents()) os << "; SINEW_NCCL_SHRINK=0";
  os << ")";
  return os.str();
}

}  // namespace collectives
}  // namespace sinew
