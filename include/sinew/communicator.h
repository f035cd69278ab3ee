#pragma once

// Communicators: collectives and point-to-point transfers of at::Tensor among a fixed
// member list for one epoch (docs/architecture.md section 2).
//
// A communicator is never repaired. Every operation has a deadline; any failure
// (PeerLost, Timeout, Aborted) leaves the communicator dead: it tells the other members
// why (so they fail with the same cause instead of waiting for their deadlines), closes
// its connections, and every later call throws the same error. Survivors then build a
// new communicator for the next epoch, normally under a new store prefix.
//
// Thread safety: operations must be issued by one thread at a time, in the same order on
// every member. abort(), error() and the accessors may be called from any thread, at any
// time; abort() makes a blocked operation throw Aborted promptly (well under 100 ms).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "sinew/error.h"
#include "sinew/store.h"

namespace sinew {
namespace collectives {

enum class ReduceOp {
  kSum,
  // Sum divided by the number of members; integer tensors round toward zero.
  kAvg,
};

// Use the communicator's default operation timeout.
constexpr std::chrono::milliseconds kDefaultOpTimeout{-1};

struct CommunicatorOptions {
  // Worker ids of the members; a member's rank is its index in this list. Ids are stable
  // for a worker's lifetime, ranks are per communicator.
  std::vector<int> members;
  // This process's worker id; must appear exactly once in members.
  int self = -1;
  // The epoch this communicator belongs to; rendezvous keys are namespaced by it, so
  // members of different epochs never meet.
  int64_t epoch = 0;
  // Distinguishes several communicators of one epoch (e.g. per pipeline stage group).
  std::string name = "default";
  // Deadline for building the communicator (rendezvous and connecting every pair).
  std::chrono::milliseconds initTimeout{60000};
  // Default deadline of each operation.
  std::chrono::milliseconds timeout{30000};
  // Address to listen on for peer connections (Gloo's TCP transport).
  std::string hostname = "127.0.0.1";
  // CUDA device index for the NCCL backend; -1 means the current device.
  int device = -1;
};

// One transfer of Communicator::exchange().
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  at::Tensor tensor;  // kSend: the data; kRecv: where it lands
  int peer = -1;      // the other member's rank
  uint32_t tag = 0;

  static P2POp send(at::Tensor t, int peer, uint32_t tag) {
    return {Kind::kSend, std::move(t), peer, tag};
  }
  static P2POp recv(at::Tensor t, int peer, uint32_t tag) {
    return {Kind::kRecv, std::move(t), peer, tag};
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(options_.members.size()); }
  int64_t epoch() const { return options_.epoch; }
  int self() const { return options_.self; }
  const std::vector<int>& members() const { return options_.members; }
  // The worker id of a rank. REQUIRES: 0 <= rank < size().
  int workerOf(int rank) const { return options_.members.at(rank); }
  // The backend's name: "gloo" or "nccl".
  virtual const char* backend() const = 0;
  // How this communicator was set up from the one of its name before it (docs/collectives.md,
  // "Repair"): Gloo "kept <k> links, made <m> connections"; NCCL "init", "shrink" or "grow".
  virtual std::string setUp() const { return ""; }

  // In-place reduction of t across all members.
  // REQUIRES: t is contiguous, of a supported dtype and device, the same shape everywhere.
  virtual void allreduce(at::Tensor& t, ReduceOp op = ReduceOp::kSum,
                         std::chrono::milliseconds timeout = kDefaultOpTimeout) = 0;

  // Copies root's t into every member's t. REQUIRES: same shape and dtype everywhere.
  virtual void broadcast(at::Tensor& t, int root,
                         std::chrono::milliseconds timeout = kDefaultOpTimeout) = 0;

  // output = concatenation of every member's input along a new leading dimension of
  // size(): output[r] is rank r's input. REQUIRES: output has size() * input.numel()
  // elements, the input's dtype, and is contiguous.
  virtual void allgather(at::Tensor& output, const at::Tensor& input,
                         std::chrono::milliseconds timeout = kDefaultOpTimeout) = 0;

  // Sends t to rank dst. Messages between two ranks with the same tag arrive in order;
  // the receiver's tensor must have the same number of bytes. Like MPI_Ssend it may
  // block until dst has posted the matching recv, so two members must not both send to
  // each other first. With Gloo, the messages one member sends another are received in the
  // order they were sent: a receive that would have to skip an earlier message of the same
  // member (another tag) fails with InvalidArgument naming both tags.
  virtual void send(const at::Tensor& t, int dst, uint32_t tag,
                    std::chrono::milliseconds timeout = kDefaultOpTimeout) = 0;

  // Receives into t a message sent by rank src with the given tag.
  virtual void recv(at::Tensor& t, int src, uint32_t tag,
                    std::chrono::milliseconds timeout = kDefaultOpTimeout) = 0;

  // Posts every send and receive of `ops` at once and returns when all of them completed
  // (like torch.distributed's batch_isend_irecv followed by waiting on each), so two members
  // may send to each other in one call without deadlock: a pipeline stage sends its
  // activation forward while it receives a gradient back. Messages with the same (peer, tag)
  // match in the order of `ops` (NCCL ignores tags: there all messages between two ranks in
  // one direction match in posting order, so post them in the same order on both sides, as
  // the pipeline stages do). The deadline covers the whole batch; a failure of any
  // transfer fails the communicator as send() and recv() do.
  // REQUIRES: every tensor contiguous, every peer another member; a receive's tensor has the
  // byte count of the matching send.
  virtual void exchange(const std::vector<P2POp>& ops,
                        std::chrono::milliseconds timeout = kDefaultOpTimeout) = 0;

  // Returns after every member entered the barrier.
  virtual void barrier(std::chrono::milliseconds timeout = kDefaultOpTimeout) = 0;

  // Fails the communicator: a blocked or later operation throws Aborted, and the other
  // members' operations fail with Aborted naming this worker. Idempotent.
  virtual void abort() = 0;

  // The failure that killed this communicator, or null while it is healthy. Failures are
  // detected even between operations (a member's death is noticed when its connection
  // closes), so callers can poll this as a failure detector.
  virtual std::exception_ptr error() const = 0;

 protected:
  explicit Communicator(CommunicatorOptions options);
  std::chrono::milliseconds resolveTimeout(std::chrono::milliseconds t) const {
    return t.count() < 0 ? options_.timeout : t;
  }

  const CommunicatorOptions options_;
  const int rank_;
};

// Builds a Gloo communicator for CPU tensors of dtype float32, float64, float16,
// bfloat16 and int64. Blocks until every member has connected or initTimeout passes
// (Timeout naming the members that did not show up). The store is used only for
// rendezvous, under the prefix "sinew/comm/<name>/epoch/<epoch>".
std::unique_ptr<Communicator> createGlooCommunicator(const std::shared_ptr<Store>& store,
                                                     const CommunicatorOptions& options);

// Builds an NCCL communicator for CUDA tensors (non-blocking init polled against
// initTimeout, ncclCommAbort on failure). A small Gloo communicator among the same
// members runs beside it to notice a dead peer and name it, which NCCL cannot.
// Throws InvalidArgument if Sinew was built without NCCL (SINEW_WITH_NCCL=0).
std::unique_ptr<Communicator> createNcclCommunicator(const std::shared_ptr<Store>& store,
                                                     const CommunicatorOptions& options);

// How this build's NCCL communicators follow a change of members, chosen at build time by
// NCCL_VERSION_CODE (docs/collectives.md, "NCCL: shrink and grow"): "shrink and grow"
// (NCCL >= 2.29: the next communicator of a name is ncclCommShrink or ncclCommGrow of the one
// before where its members allow), "shrink; a join makes a new communicator" (>= 2.27), "a
// new communicator" (older, or SINEW_NCCL_SHRINK=0), with the NCCL version in parentheses.
std::string ncclMembershipChange();

// Builds a Gloo communicator that also takes CUDA tensors, through host memory: each
// operation copies a CUDA tensor to the host (after the work queued on its device's current
// stream), runs on the CPU and copies the results back. For jobs whose GPUs cannot all join
// one NCCL communicator: several workers sharing one GPU (NCCL refuses two ranks of one
// communicator on the same GPU), or workers with and without GPUs. CPU tensors pass through
// as in createGlooCommunicator; backend() is "gloo".
std::unique_ptr<Communicator> createHostStagedCommunicator(const std::shared_ptr<Store>& store,
                                                           const CommunicatorOptions& options);

// Builds the backend that suits tensors of the given device type ("cpu" → Gloo,
// "cuda" → NCCL).
std::unique_ptr<Communicator> createCommunicator(const std::string& deviceType,
                                                 const std::shared_ptr<Store>& store,
                                                 const CommunicatorOptions& options);

// "float32", "bfloat16", ...: the dtype names used in error messages.
std::string dtypeName(const at::Tensor& t);

// comm.exchange(ops, timeout) with every tensor cut into chunks of at most chunkBytes (views of
// its memory, no copy; the last chunk of a tensor may be smaller), all posted in one exchange,
// so the chunks of many tensors stream back to back over each connection while no single
// message is larger than a chunk (what a staging buffer for device memory must hold). Both
// sides must cut the same way: a receive's tensor has the byte count and the element size of
// the matching send, and both call this with the same chunkBytes. Layer copies in a pipeline
// reconfiguration use it (docs/pipeline.md, "Reconfiguration"). Throws InvalidArgument if
// chunkBytes is smaller than a tensor's element size, or for what exchange() rejects.
void exchangeInChunks(Communicator& comm, const std::vector<P2POp>& ops, size_t chunkBytes,
                      std::chrono::milliseconds timeout = kDefaultOpTimeout);

}  // namespace collectives
}  // namespace sinew
