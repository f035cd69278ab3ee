#include "sinew/runtime/optimizer_state.h"

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <cstring>

#include <sstream>
#include <type_traits>

#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

namespace {

// An optimizer's per-parameter state is keyed by the parameter's TensorImpl: its address as
// text in libtorch 1.x, the address itself (void*) in 2.x.
template <typename StateMap>
typename StateMap::key_type stateKey(const StateMap&, const at::Tensor& p) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << static_cast<const void*>(p.unsafeGetTensorImpl());
    return os.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

}  // namespace

bool optimizerStateSupported(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
         dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr;
}

void captureParameterState(const std::string& name, const at::Tensor& param,
                           torch::optim::Optimizer& optimizer,
                           std::vector<checkpoint::NamedTensor>* out) {
  out->push_back({name, param.detach()});
  auto& st = optimizer.state();
  auto it = st.find(stateKey(st, param));
  if (it == st.end()) return;
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
    out->push_back({name + ".exp_avg", a->exp_avg()});
    out->push_back({name + ".exp_avg_sq", a->exp_avg_sq()});
    if (a->max_exp_avg_sq().defined()) {
      out->push_back({name + ".max_exp_avg_sq", a->max_exp_avg_sq()});
    }
    out->push_back({name + ".step", at::full({1}, a->step(), at::kLong)});
  } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
    if (s->momentum_buffer().defined()) {
      out->push_back({name + ".momentum_buffer", s->momentum_buffer()});
    }
  }
}

checkpoint::ShardState captureState(const torch::nn::Sequential& layers,
                                    torch::optim::Optimizer& optimizer) {
  checkpoint::ShardState out;
  for (const auto& child : layers->named_children()) {
    checkpoint::LayerState layer;
    layer.name = child.key();
    for (const auto& np : child.value()->named_parameters(/*recurse=*/true)) {
      captureParameterState(np.key(), np.value(), optimizer, &layer.tensors);
    }
    if (!layer.tensors.empty()) out.push_back(std::move(layer));
  }
  return out;
}

void loadState(const torch::nn::Sequential& layers, torch::optim::Optimizer& optimizer,
               const std::map<std::string, checkpoint::RestoredLayer>& saved,
               const std::string& source) {
  at::NoGradGuard noGrad;
  auto& st = optimizer.state();
  for (const auto& child : layers->named_children()) {
    auto params = child.value()->named_parameters(/*recurse=*/true);
    if (params.size() == 0) continue;
    auto lit = saved.find(child.key());
    if (lit == saved.end()) {
      SINEW_THROW(InvalidArgument, source, " has no layer '", child.key(),
                  "' (a checkpoint of another model?)");
    }
    const auto& tensors = lit->second;
    auto get = [&](const std::string& n) -> const at::Tensor* {
      auto it = tensors.find(n);
      return it == tensors.end() ? nullptr : &it->second;
    };
    // A state tensor that must come with another one, shaped as the parameter.
    auto need = [&](const std::string& n, const std::string& with,
                    const at::Tensor& p) -> const at::Tensor& {
      const at::Tensor* t = get(n);
      if (t == nullptr) {
        SINEW_THROW(Corruption, source, ", layer '", child.key(), "': tensor '", with, "' has no '",
                    n, "' (incomplete optimizer state)");
      }
      if (t->sizes() != p.sizes()) {
        SINEW_THROW(Corruption, source, ", layer '", child.key(), "': tensor '", n, "' has shape ",
                    t->sizes(), ", its parameter ", p.sizes());
      }
      return *t;
    };
    for (const auto& np : params) {
      at::Tensor p = np.value();
      const std::string& n = np.key();
      const at::Tensor* v = get(n);
      if (v == nullptr || v->sizes() != p.sizes()) {
        SINEW_THROW(InvalidArgument, source, ", layer '", child.key(), "' tensor '", n,
                    "' is missing or has another shape (a checkpoint of another model?)");
      }
      p.detach().copy_(*v);
      auto onParam = [&](const at::Tensor& t) { return t.to(p.device(), p.scalar_type()).clone(); };
      if (get(n + ".exp_avg") != nullptr) {
        auto a = std::make_unique<torch::optim::AdamParamState>();
        a->exp_avg(onParam(need(n + ".exp_avg", n, p)));
        a->exp_avg_sq(onParam(need(n + ".exp_avg_sq", n + ".exp_avg", p)));
        if (get(n + ".max_exp_avg_sq") != nullptr) {
          a->max_exp_avg_sq(onParam(need(n + ".max_exp_avg_sq", n + ".exp_avg", p)));
        }
        const at::Tensor* step = get(n + ".step");
        if (step == nullptr || step->numel() != 1 || at::isFloatingType(step->scalar_type())) {
          SINEW_THROW(Corruption, source, ", layer '", child.key(), "': tensor '", n,
                      ".exp_avg' has ", step == nullptr ? "no" : "a malformed", " '", n,
                      ".step' (one integer)");
        }
        a->step(step->item<int64_t>());
        st[stateKey(st, p)] = std::move(a);
      } else if (get(n + ".momentum_buffer") != nullptr) {
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(onParam(need(n + ".momentum_buffer", n, p)));
        st[stateKey(st, p)] = std::move(s);
      } else {
        // No state saved: the optimizer starts this parameter afresh, as it did before its
        // first step.
        st.erase(stateKey(st, p));
      }
    }
  }
}

void broadcastState(collectives::Communicator& comm, int root, std::vector<at::Tensor>& params,
                    torch::optim::Optimizer& optimizer, at::Device device,
                    std::chrono::milliseconds timeout) {
  at::NoGradGuard noGrad;
  for (auto& p : params) {
    at::Tensor d = p.detach();
    comm.broadcast(d, root, timeout);
  }
  std::string bytes;
  if (comm.rank() == root) {
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream os;
    archive.save_to(os);
    bytes = os.str();
  }
  // Through the communicator's device (NCCL moves CUDA tensors only).
  at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()),
                            at::TensorOptions().dtype(at::kLong).device(device));
  comm.broadcast(len, root, timeout);
  const int64_t n = len.item<int64_t>();
  at::Tensor host = at::zeros({(n + 7) / 8}, at::kLong);
  if (comm.rank() == root) std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
  at::Tensor buf = host.to(device);
  comm.broadcast(buf, root, timeout);
  if (comm.rank() != root) {
    host = buf.cpu();
    std::string received(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(n));
    std::istringstream is(received);
    torch::serialize::InputArchive archive;
    archive.load_from(is, device);  // The state onto this worker's device.
    optimizer.load(archive);
  }
}

}  // namespace runtime
}  // namespace sinew
