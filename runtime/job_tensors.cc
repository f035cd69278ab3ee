#include "sinew/runtime/job_tensors.h"

#include <ATen/ATen.h>

#include <cctype>
#include <utility>

#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

void JobTensors::add(Entry entry) {
  if (entry.name.size() < 2 || entry.name[0] != '@') {
    SINEW_THROW(InvalidArgument, "a job tensor's name must start with '@': '", entry.name, "'");
  }
  for (const Entry& e : entries_) {
    if (e.name == entry.name) {
      SINEW_THROW(InvalidArgument, "the job tensor '", entry.name, "' is kept twice");
    }
  }
  entry.like = entry.like.detach().cpu().clone();
  current_.push_back(entry.like);
  entries_.push_back(std::move(entry));
}

void JobTensors::commit(int64_t step) {
  std::vector<at::Tensor> values;
  values.reserve(entries_.size());
  for (const Entry& e : entries_) {
    at::Tensor value;
    try {
      value = e.save(step);
    } catch (const std::exception& ex) {
      SINEW_THROW(InvalidArgument, "the save of the job tensor '", e.name, "' after step ", step,
                  " failed: ", ex.what());
    }
    if (!value.defined()) {
      SINEW_THROW(InvalidArgument, "the job tensor '", e.name, "' saved after step ", step,
                  " is undefined");
    }
    if (value.sizes() != e.like.sizes() || value.scalar_type() != e.like.scalar_type()) {
      SINEW_THROW(InvalidArgument, "the job tensor '", e.name, "' saved after step ", step,
                  " has shape ", value.sizes(), " and dtype ", value.scalar_type(),
                  "; it was registered as ", e.like.sizes(), " and ", e.like.scalar_type());
    }
    values.push_back(value.detach().cpu().clone());
  }
  current_ = std::move(values);
  step_ = step;
}

void JobTensors::appendTo(checkpoint::ShardState& state) const {
  for (size_t i = 0; i < entries_.size(); ++i) {
    for (auto& layer : state) layer.tensors.push_back({entries_[i].name, current_[i]});
  }
}

bool JobTensors::take(const std::map<std::string, at::Tensor>& restored, const std::string& source,
                      int64_t step) {
  std::vector<at::Tensor> values;
  for (const Entry& e : entries_) {
    auto it = restored.find(e.name);
    if (it == restored.end()) return false;
    const at::Tensor& t = it->second;
    if (t.sizes() != e.like.sizes() || t.scalar_type() != e.like.scalar_type()) {
      SINEW_THROW(Corruption, source, ": the job tensor '", e.name, "' has shape ", t.sizes(),
                  " and dtype ", t.scalar_type(), ", not ", e.like.sizes(), " and ",
                  e.like.scalar_type());
    }
    values.push_back(t.cpu().clone());
  }
  load(std::move(values), step);
  return true;
}

void JobTensors::load(std::vector<at::Tensor> values, int64_t step) {
  current_ = std::move(values);
  step_ = step;
  for (size_t i = 0; i < entries_.size(); ++i) entries_[i].load(step, current_[i]);
}

void JobTensors::agree(collectives::Communicator& world, int64_t step, at::Device device,
                       std::chrono::milliseconds timeout, int preferredRoot) {
  if (entries_.empty()) return;
  const bool known = step_ == step;
  at::Tensor flags = at::zeros({world.size()}, at::kDouble);
  if (known) flags[world.rank()] = 1.0;
  flags = flags.to(device);
  world.allreduce(flags, collectives::ReduceOp::kSum, timeout);
  flags = flags.cpu();
  auto knows = [&](int r) { return r >= 0 && r < world.size() && flags[r].item<double>() > 0.5; };
  int root = knows(preferredRoot) ? preferredRoot : -1;
  for (int r = 0; r < world.size() && root < 0; ++r) {
    if (knows(r)) root = r;
  }
  if (root < 0) return;
  std::vector<at::Tensor> values;
  for (size_t i = 0; i < entries_.size(); ++i) {
    at::Tensor value = world.rank() == root ? current_[i] : at::empty_like(entries_[i].like);
    at::Tensor onDevice = value.to(device).contiguous();
    world.broadcast(onDevice, root, timeout);
    values.push_back(onDevice.cpu());
  }
  if (!known) load(std::move(values), step);
}

JobTensors::Entry keptStateEntry(const KeptState& k) {
  bool plain = !k.name.empty() && k.name.size() <= 128;
  for (char c : k.name) {
    plain =
        plain && (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-');
  }
  if (!plain) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::keptState has the name '", k.name,
                "'; a kept state's name is 1 to 128 of [A-Za-z0-9_.-]");
  }
  if (!k.initial.defined() || !k.save || !k.load) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::keptState '", k.name,
                "' needs an initial tensor, a save and a load function");
  }
  return {"@user." + k.name, k.initial, k.save, k.load};
}

}  // namespace runtime
}  // namespace sinew
