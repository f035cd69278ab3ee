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
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    at::Tensor value = e.save(step).detach().cpu().clone();
    if (value.sizes() != e.like.sizes() || value.scalar_type() != e.like.scalar_type()) {
      SINEW_THROW(InvalidArgument, "the job tensor '", e.name, "' saved after step ", step,
                  " has shape ", value.sizes(), " and dtype ", value.scalar_type(),
                  "; it was registered as ", e.like.sizes(), " and ", e.like.scalar_type());
    }
    current_[i] = std::move(value);
  }
}

void JobTensors::appendTo(checkpoint::ShardState& state) const {
  for (size_t i = 0; i < entries_.size(); ++i) {
    for (auto& layer : state) layer.tensors.push_back({entries_[i].name, current_[i]});
  }
}

bool JobTensors::take(const std::map<std::string, at::Tensor>& restored,
                      const std::string& source) {
  bool all = true;
  for (const Entry& e : entries_) {
    auto it = restored.find(e.name);
    if (it == restored.end()) {
      all = false;
      continue;
    }
    const at::Tensor& t = it->second;
    if (t.sizes() != e.like.sizes() || t.scalar_type() != e.like.scalar_type()) {
      SINEW_THROW(Corruption, source, ": the job tensor '", e.name, "' has shape ", t.sizes(),
                  " and dtype ", t.scalar_type(), ", not ", e.like.sizes(), " and ",
                  e.like.scalar_type());
    }
    taken_[e.name] = t.cpu().clone();
  }
  return all;
}

void JobTensors::agree(collectives::Communicator& world, int64_t step, bool live, at::Device device,
                       std::chrono::milliseconds timeout) {
  if (entries_.empty()) return;
  const bool known = live || taken_.size() == entries_.size();
  at::Tensor flags = at::zeros({world.size()}, at::kDouble);
  if (known) flags[world.rank()] = 1.0;
  flags = flags.to(device);
  world.allreduce(flags, collectives::ReduceOp::kSum, timeout);
  flags = flags.cpu();
  int root = -1;
  for (int r = 0; r < world.size() && root < 0; ++r) {
    if (flags[r].item<double>() > 0.5) root = r;
  }
  std::map<std::string, at::Tensor> taken;
  taken.swap(taken_);
  if (root < 0) return;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    at::Tensor value;
    if (world.rank() == root) {
      auto it = taken.find(e.name);
      value = live || it == taken.end() ? current_[i] : it->second;
    } else {
      value = at::empty_like(e.like);
    }
    at::Tensor onDevice = value.to(device).contiguous();
    world.broadcast(onDevice, root, timeout);
    if (!live) {
      current_[i] = onDevice.cpu();
      e.load(step, current_[i]);
    }
  }
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
