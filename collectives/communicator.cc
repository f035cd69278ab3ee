#include "sinew/communicator.h"

#include <algorithm>

#include "sinew/base/error.h"
#include "sinew/config.h"

namespace sinew {
namespace collectives {
namespace {

int rankOfSelf(const CommunicatorOptions& o) {
  if (o.members.empty()) {
    SINEW_THROW(InvalidArgument, "CommunicatorOptions::members is empty (communicator '", o.name,
                "' of epoch ", o.epoch, ")");
  }
  auto count = std::count(o.members.begin(), o.members.end(), o.self);
  if (count != 1) {
    SINEW_THROW(InvalidArgument, "CommunicatorOptions::self = ", o.self, " appears ", count,
                " times in the member list of communicator '", o.name, "' (epoch ", o.epoch, ")");
  }
  std::vector<int> sorted = o.members;
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) {
    SINEW_THROW(InvalidArgument, "CommunicatorOptions::members of communicator '", o.name,
                "' lists worker ", *dup, " twice");
  }
  if (o.timeout.count() <= 0 || o.initTimeout.count() <= 0) {
    SINEW_THROW(InvalidArgument, "CommunicatorOptions::timeout = ", o.timeout.count(),
                " ms and initTimeout = ", o.initTimeout.count(), " ms must be positive");
  }
  return static_cast<int>(std::find(o.members.begin(), o.members.end(), o.self) -
                          o.members.begin());
}

}  // namespace

Communicator::Communicator(CommunicatorOptions options)
    : options_(std::move(options)), rank_(rankOfSelf(options_)) {}

std::string dtypeName(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kByte:
      return "uint8";
    case at::kChar:
      return "int8";
    case at::kBool:
      return "bool";
    default:
      return std::string(c10::toString(t.scalar_type()));
  }
}

void exchangeInChunks(Communicator& comm, const std::vector<P2POp>& ops, size_t chunkBytes,
                      std::chrono::milliseconds timeout) {
  std::vector<P2POp> chunks;
  for (const P2POp& op : ops) {
    const at::Tensor& t = op.tensor;
    const size_t element = static_cast<size_t>(t.element_size());
    if (chunkBytes < element) {
      SINEW_THROW(InvalidArgument, "exchangeInChunks: chunks of ", chunkBytes,
                  " bytes cannot hold one ", dtypeName(t), " element");
    }
    if (!t.is_contiguous()) {
      SINEW_THROW(InvalidArgument, "exchangeInChunks: a ", dtypeName(t), " tensor of ", t.numel(),
                  " elements with rank ", op.peer, " is not contiguous");
    }
    const int64_t per = static_cast<int64_t>(chunkBytes / element);
    const int64_t n = t.numel();
    if (n <= per) {
      chunks.push_back(op);
      continue;
    }
    at::Tensor flat = t.view({n});
    for (int64_t off = 0; off < n; off += per) {
      chunks.push_back({op.kind, flat.narrow(0, off, std::min(per, n - off)), op.peer, op.tag});
    }
  }
  comm.exchange(chunks, timeout);
}

std::unique_ptr<Communicator> createCommunicator(const std::string& deviceType,
                                                 const std::shared_ptr<Store>& store,
                                                 const CommunicatorOptions& options) {
  if (deviceType == "cpu") return createGlooCommunicator(store, options);
  if (deviceType == "cuda") return createNcclCommunicator(store, options);
  SINEW_THROW(InvalidArgument, "no communicator backend for device type '", deviceType,
              "' (expected cpu or cuda)");
}

#if !SINEW_WITH_NCCL
std::unique_ptr<Communicator> createNcclCommunicator(const std::shared_ptr<Store>&,
                                                     const CommunicatorOptions& options) {
  SINEW_THROW(InvalidArgument, "communicator '", options.name,
              "': this Sinew was built without NCCL (SINEW_WITH_NCCL=OFF); rebuild with a "
              "CUDA toolkit that has NCCL to use CUDA tensors");
}

std::string ncclMembershipChange() { return "none (built without NCCL)"; }
#endif

}  // namespace collectives
}  // namespace sinew
