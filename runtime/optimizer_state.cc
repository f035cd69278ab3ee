#include "sinew/runtime/optimizer_state.h"

#include <ATen/ATen.h>
#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cstring>

#include <functional>
#include <sstream>
#include <type_traits>
#include <typeinfo>

#include "sinew/base/error.h"
#include "sinew/pipeline/memory_meter.h"

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

// The codec of an optimizer type Opt whose per-parameter state is State and whose options
// are Options, from a table of fields.
template <typename Opt, typename State, typename Options>
class TypedCodec final : public OptimizerStateCodec {
 public:
  struct Field {
    std::string name;
    bool count;  // one int64, else a tensor shaped as the parameter
    std::function<at::Tensor(const State&)> get;
    std::function<void(State&, const at::Tensor&)> set;
  };

  TypedCodec(std::string name, std::vector<Field> fields,
             std::function<int64_t(const Options&)> required)
      : name_(std::move(name)), fields_(std::move(fields)), required_(std::move(required)) {
    for (size_t i = 0; i < fields_.size(); ++i) {
      layout_.fields.push_back(fields_[i].name);
      if (fields_[i].count) layout_.countField = static_cast<int>(i);
    }
  }

  const std::string& name() const override { return name_; }
  const StateLayout& layout() const override { return layout_; }
  bool matches(const torch::optim::Optimizer& o) const override {
    return dynamic_cast<const Opt*>(&o) != nullptr;
  }
  int64_t required(const torch::optim::OptimizerOptions& options) const override {
    const auto* typed = dynamic_cast<const Options*>(&options);
    return typed == nullptr ? layout_.allFields() : required_(*typed);
  }
  at::Tensor field(const torch::optim::OptimizerParamState& state, size_t i) const override {
    const auto* typed = dynamic_cast<const State*>(&state);
    if (typed == nullptr) {
      SINEW_THROW(InternalError, "a parameter's optimizer state is not the state of ", name_);
    }
    return fields_.at(i).get(*typed);
  }
  std::unique_ptr<torch::optim::OptimizerParamState> make(
      const std::vector<at::Tensor>& values) const override {
    auto state = std::make_unique<State>();
    for (size_t i = 0; i < fields_.size(); ++i) {
      if (values.at(i).defined()) fields_[i].set(*state, values[i]);
    }
    return state;
  }

 private:
  std::string name_;
  std::vector<Field> fields_;
  std::function<int64_t(const Options&)> required_;
  StateLayout layout_;
};

#define SINEW_TENSOR_FIELD(State, f)                                                             \
  {                                                                                              \
#f, false, [](const State& s) { return s.f(); },                                             \
                                                  [](State & s, const at::Tensor& t) { s.f(t); } \
  }
#define SINEW_COUNT_FIELD(State, f)                                                               \
  {                                                                                               \
#f, true,                                                                                     \
        [](const State&                                                                           \
               s) { return at::full({1}, s.f(), at::kLong); },                                    \
                                                            [](State & s,                         \
                                                               const at::Tensor&                  \
                                                                   t) { s.f(t.item<int64_t>()); } \
  }

// Adam and AdamW: the same fields; max_exp_avg_sq only with AMSGrad.
template <typename Opt, typename State, typename Options>
std::unique_ptr<OptimizerStateCodec> adamCodec(const char* name) {
  using Codec = TypedCodec<Opt, State, Options>;
  return std::make_unique<Codec>(
      name,
      std::vector<typename Codec::Field>{
          SINEW_TENSOR_FIELD(State, exp_avg), SINEW_TENSOR_FIELD(State, exp_avg_sq),
          SINEW_TENSOR_FIELD(State, max_exp_avg_sq), SINEW_COUNT_FIELD(State, step)},
      [](const Options& o) -> int64_t { return o.amsgrad() ? 0b1111 : 0b1011; });
}

const std::vector<std::unique_ptr<OptimizerStateCodec>>& codecs() {
  static const std::vector<std::unique_ptr<OptimizerStateCodec>> all = [] {
    namespace o = torch::optim;
    std::vector<std::unique_ptr<OptimizerStateCodec>> v;
    using SgdCodec = TypedCodec<o::SGD, o::SGDParamState, o::SGDOptions>;
    v.push_back(std::make_unique<SgdCodec>(
        "torch::optim::SGD",
        std::vector<SgdCodec::Field>{SINEW_TENSOR_FIELD(o::SGDParamState, momentum_buffer)},
        [](const o::SGDOptions&) -> int64_t { return 0b1; }));
    v.push_back(adamCodec<o::Adam, o::AdamParamState, o::AdamOptions>("torch::optim::Adam"));
    v.push_back(adamCodec<o::AdamW, o::AdamWParamState, o::AdamWOptions>("torch::optim::AdamW"));
    using RmsCodec = TypedCodec<o::RMSprop, o::RMSpropParamState, o::RMSpropOptions>;
    v.push_back(std::make_unique<RmsCodec>(
        "torch::optim::RMSprop",
        std::vector<RmsCodec::Field>{SINEW_TENSOR_FIELD(o::RMSpropParamState, square_avg),
                                     SINEW_TENSOR_FIELD(o::RMSpropParamState, momentum_buffer),
                                     SINEW_TENSOR_FIELD(o::RMSpropParamState, grad_avg),
                                     SINEW_COUNT_FIELD(o::RMSpropParamState, step)},
        [](const o::RMSpropOptions& opts) -> int64_t {
          return 0b1001 | (opts.momentum() > 0 ? 0b0010 : 0) | (opts.centered() ? 0b0100 : 0);
        }));
    using AdagradCodec = TypedCodec<o::Adagrad, o::AdagradParamState, o::AdagradOptions>;
    v.push_back(std::make_unique<AdagradCodec>(
        "torch::optim::Adagrad",
        std::vector<AdagradCodec::Field>{SINEW_TENSOR_FIELD(o::AdagradParamState, sum),
                                         SINEW_COUNT_FIELD(o::AdagradParamState, step)},
        [](const o::AdagradOptions&) -> int64_t { return 0b11; }));
    return v;
  }();
  return all;
}

#undef SINEW_TENSOR_FIELD
#undef SINEW_COUNT_FIELD

}  // namespace

const OptimizerStateCodec* findOptimizerStateCodec(const torch::optim::Optimizer& optimizer) {
  for (const auto& c : codecs()) {
    if (c->matches(optimizer)) return c.get();
  }
  return nullptr;
}

const OptimizerStateCodec& optimizerStateCodec(const torch::optim::Optimizer& optimizer,
                                               const std::string& what) {
  if (const OptimizerStateCodec* c = findOptimizerStateCodec(optimizer)) return *c;
  std::string supported;
  for (const auto& c : codecs()) supported += (supported.empty() ? "" : ", ") + c->name();
  SINEW_THROW(InvalidArgument, what, " made ", c10::demangle(typeid(optimizer).name()),
              ", whose state Sinew cannot capture for checkpoints, peer-RAM versions, layer "
              "copies and rollbacks; use one of ",
              supported);
}

bool optimizerStateSupported(const torch::optim::Optimizer& optimizer) {
  return findOptimizerStateCodec(optimizer) != nullptr;
}

namespace {

// captureParameterState() with the optimizer's codec already found.
void appendParameterState(const OptimizerStateCodec& codec, const std::string& name,
                          const at::Tensor& param, torch::optim::Optimizer& optimizer,
                          std::vector<checkpoint::NamedTensor>* out) {
  out->push_back({name, param.detach()});
  auto& st = optimizer.state();
  auto it = st.find(stateKey(st, param));
  if (it == st.end()) return;
  const StateLayout& layout = codec.layout();
  for (size_t i = 0; i < layout.fields.size(); ++i) {
    at::Tensor t = codec.field(*it->second, i);
    if (t.defined()) out->push_back({name + "." + layout.fields[i], std::move(t)});
  }
}

}  // namespace

void captureParameterState(const std::string& name, const at::Tensor& param,
                           torch::optim::Optimizer& optimizer,
                           std::vector<checkpoint::NamedTensor>* out) {
  appendParameterState(optimizerStateCodec(optimizer, "the optimizer"), name, param, optimizer,
                       out);
}

double stateBytesPerParameterByte(const torch::optim::Optimizer& optimizer) {
  const OptimizerStateCodec& codec = optimizerStateCodec(optimizer, "the optimizer");
  const torch::optim::OptimizerOptions& options = optimizer.param_groups().at(0).options();
  // SGD without momentum keeps no state at all (required() is what a state must have when a
  // parameter has one).
  const auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(&options);
  if (sgd != nullptr && sgd->momentum() == 0) return 1;
  const int64_t required = codec.required(options);
  double factor = 1;  // The gradient.
  for (size_t i = 0; i < codec.layout().fields.size(); ++i) {
    if ((required >> i & 1) && !codec.layout().isCount(i)) factor += 1;
  }
  return factor;
}

double measureStepWorkspacePerParameterByte(
    const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>& make,
    at::ScalarType dtype) {
  pipeline::CpuMemoryMeter meter;
  if (!meter.installed()) return 0;
  constexpr int64_t kElements = int64_t{1} << 18;
  const auto options = at::TensorOptions().dtype(dtype);
  at::Tensor p = at::full({kElements}, 0.25, options).requires_grad_(true);
  p.mutable_grad() = at::full({kElements}, 0.5, options);
  std::unique_ptr<torch::optim::Optimizer> optimizer = make({p});
  optimizer->step();  // Makes the state.
  const int64_t before = meter.live();
  meter.resetPeak();
  optimizer->step();
  const int64_t extra = std::max<int64_t>(0, meter.peak() - before);
  return static_cast<double>(extra) / static_cast<double>(p.numel() * p.element_size());
}

checkpoint::ShardState captureState(const torch::nn::Sequential& layers,
                                    torch::optim::Optimizer& optimizer) {
  checkpoint::ShardState out;
  const OptimizerStateCodec& codec = optimizerStateCodec(optimizer, "the optimizer");
  for (const auto& child : layers->named_children()) {
    checkpoint::LayerState layer;
    layer.name = child.key();
    for (const auto& np : child.value()->named_parameters(/*recurse=*/true)) {
      appendParameterState(codec, np.key(), np.value(), optimizer, &layer.tensors);
    }
    if (!layer.tensors.empty()) out.push_back(std::move(layer));
  }
  return out;
}

void loadState(const torch::nn::Sequential& layers, torch::optim::Optimizer& optimizer,
               const std::map<std::string, checkpoint::RestoredLayer>& saved,
               const std::string& source,
               const std::function<bool(const std::string&)>& adoptable) {
  at::NoGradGuard noGrad;
  const OptimizerStateCodec& codec = optimizerStateCodec(optimizer, "the optimizer");
  const StateLayout& layout = codec.layout();
  // Each parameter's group options decide which fields its state needs.
  std::map<const void*, const torch::optim::OptimizerOptions*> optionsOf;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) optionsOf[p.unsafeGetTensorImpl()] = &group.options();
  }
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
    const bool adopt = adoptable && adoptable(child.key());
    for (const auto& np : params) {
      at::Tensor p = np.value();
      const std::string& n = np.key();
      auto vit = tensors.find(n);
      if (vit == tensors.end() || vit->second.sizes() != p.sizes()) {
        SINEW_THROW(InvalidArgument, source, ", layer '", child.key(), "' tensor '", n,
                    "' is missing or has another shape (a checkpoint of another model?)");
      }
      const at::Tensor& src = vit->second;
      const bool itself = adopt && src.data_ptr() == p.data_ptr() &&
                          src.scalar_type() == p.scalar_type() && src.strides() == p.strides();
      if (!itself) p.detach().copy_(src);
      std::vector<at::Tensor> values(layout.fields.size());
      int64_t present = 0;
      for (size_t i = 0; i < layout.fields.size(); ++i) {
        auto fit = tensors.find(n + "." + layout.fields[i]);
        if (fit == tensors.end()) continue;
        present |= int64_t{1} << i;
        const at::Tensor& t = fit->second;
        const std::string tname = n + "." + layout.fields[i];
        if (layout.isCount(i)) {
          if (t.numel() != 1 || at::isFloatingType(t.scalar_type())) {
            SINEW_THROW(Corruption, source, ", layer '", child.key(), "': tensor '", tname,
                        "' is not one integer (", t.numel(), " elements of ", t.scalar_type(), ")");
          }
          values[i] = t.to(at::kLong);
        } else {
          if (t.sizes() != p.sizes()) {
            SINEW_THROW(Corruption, source, ", layer '", child.key(), "': tensor '", tname,
                        "' has shape ", t.sizes(), ", its parameter ", p.sizes());
          }
          // Cloned unless adoptable: a checkpoint's or an arena's memory is not ours to keep.
          values[i] = t.to(p.device(), p.scalar_type());
          if (!adopt) values[i] = values[i].clone();
        }
      }
      if (present == 0) {
        // No state saved: the optimizer starts this parameter afresh, as it did before its
        // first step.
        st.erase(stateKey(st, p));
        continue;
      }
      auto oit = optionsOf.find(p.unsafeGetTensorImpl());
      const int64_t needed =
          codec.required(oit == optionsOf.end() ? optimizer.defaults() : *oit->second);
      for (size_t i = 0; i < layout.fields.size(); ++i) {
        if ((needed & ~present & (int64_t{1} << i)) != 0) {
          SINEW_THROW(Corruption, source, ", layer '", child.key(), "': parameter '", n, "' has ",
                      codec.name(), " state without '", n, ".", layout.fields[i],
                      "' (incomplete optimizer state)");
        }
      }
      st[stateKey(st, p)] = codec.make(values);
    }
  }
}

std::map<std::string, at::Tensor> jobTensors(
    const std::map<std::string, checkpoint::RestoredLayer>& saved) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [layer, tensors] : saved) {
    for (const auto& [name, t] : tensors) {
      if (!name.empty() && name[0] == '@') out.emplace(name, t);
    }
    if (!out.empty()) break;
  }
  return out;
}

int64_t broadcastState(collectives::Communicator& comm, int root, std::vector<at::Tensor>& params,
                       torch::optim::Optimizer& optimizer, at::Device device,
                       std::chrono::milliseconds timeout) {
  at::NoGradGuard noGrad;
  int64_t tensorBytes = 0;
  for (auto& p : params) {
    at::Tensor d = p.detach();
    comm.broadcast(d, root, timeout);
    tensorBytes += static_cast<int64_t>(d.nbytes());
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
    return tensorBytes + n;
  }
  return 0;
}

}  // namespace runtime
}  // namespace sinew
