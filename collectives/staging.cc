// A Gloo communicator that also takes tensors of other devices (CUDA), through host memory.
//
// Gloo moves CPU memory only. Jobs whose GPUs cannot form one NCCL communicator (several
// workers sharing a GPU, which NCCL refuses, or a job that mixes GPU and CPU workers) still
// keep their layers, activations and gradients on the GPU: each operation copies a device
// tensor into a host tensor (a synchronous copy, ordered after the work queued on the
// device's current stream), runs the host operation, and copies results back into the
// device tensor. Host tensors pass through untouched. Failures are the inner communicator's:
// abort(), error() and every typed error are forwarded unchanged.

#include <ATen/ATen.h>

#include "sinew/base/error.h"
#include "sinew/collectives/gloo/gloo_options.h"
#include "sinew/communicator.h"

namespace sinew {
namespace collectives {
namespace {

bool onHost(const at::Tensor& t) { return !t.defined() || t.device().is_cpu(); }

at::Tensor toHost(const at::Tensor& t) { return onHost(t) ? t : t.to(at::kCPU).contiguous(); }

class HostStagedCommunicator final : public Communicator {
 public:
  HostStagedCommunicator(std::unique_ptr<Communicator> inner, const CommunicatorOptions& options)
      : Communicator(options), inner_(std::move(inner)) {}

  const char* backend() const override { return inner_->backend(); }
  std::string setUp() const override { return inner_->setUp(); }

  void allreduce(at::Tensor& t, ReduceOp op, std::chrono::milliseconds timeout) override {
    if (onHost(t)) return inner_->allreduce(t, op, timeout);
    at::Tensor h = toHost(t);
    inner_->allreduce(h, op, timeout);
    t.copy_(h);
  }

  void broadcast(at::Tensor& t, int root, std::chrono::milliseconds timeout) override {
    if (onHost(t)) return inner_->broadcast(t, root, timeout);
    at::Tensor h = toHost(t);
    inner_->broadcast(h, root, timeout);
    t.copy_(h);
  }

  void allgather(at::Tensor& output, const at::Tensor& input,
                 std::chrono::milliseconds timeout) override {
    if (onHost(output) && onHost(input)) return inner_->allgather(output, input, timeout);
    at::Tensor out = toHost(output);
    inner_->allgather(out, toHost(input), timeout);
    if (!onHost(output)) output.copy_(out);
  }

  void send(const at::Tensor& t, int dst, uint32_t tag,
            std::chrono::milliseconds timeout) override {
    inner_->send(toHost(t), dst, tag, timeout);
  }

  void recv(at::Tensor& t, int src, uint32_t tag, std::chrono::milliseconds timeout) override {
    if (onHost(t)) return inner_->recv(t, src, tag, timeout);
    at::Tensor h = at::empty(t.sizes(), t.options().device(at::kCPU));
    inner_->recv(h, src, tag, timeout);
    t.copy_(h);
  }

  void exchange(const std::vector<P2POp>& ops, std::chrono::milliseconds timeout) override {
    std::vector<P2POp> host;
    host.reserve(ops.size());
    for (const P2POp& op : ops) {
      if (op.kind == P2POp::Kind::kSend || onHost(op.tensor)) {
        host.push_back({op.kind, toHost(op.tensor), op.peer, op.tag});
      } else {
        host.push_back({op.kind, at::empty(op.tensor.sizes(), op.tensor.options().device(at::kCPU)),
                        op.peer, op.tag});
      }
    }
    inner_->exchange(host, timeout);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind == P2POp::Kind::kRecv && !onHost(ops[i].tensor)) {
        // The P2POp holds a view of the caller's tensor (e.g. some rows of it): copying into
        // it writes the caller's memory.
        at::Tensor dst = ops[i].tensor;
        dst.copy_(host[i].tensor);
      }
    }
  }

  void barrier(std::chrono::milliseconds timeout) override { inner_->barrier(timeout); }
  void abort() override { inner_->abort(); }
  std::exception_ptr error() const override { return inner_->error(); }

 private:
  std::unique_ptr<Communicator> inner_;
};

}  // namespace

std::unique_ptr<Communicator> createHostStagedCommunicator(const std::shared_ptr<Store>& store,
                                                           const CommunicatorOptions& options,
                                                           const GlooOptions& gloo) {
  return std::make_unique<HostStagedCommunicator>(createGlooCommunicator(store, options, gloo),
                                                  options);
}

std::unique_ptr<Communicator> createHostStagedCommunicator(const std::shared_ptr<Store>& store,
                                                           const CommunicatorOptions& options) {
  return createHostStagedCommunicator(store, options, GlooOptions{});
}

}  // namespace collectives
}  // namespace sinew
