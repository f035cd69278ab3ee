// The public checkpoint reader (include/sinew/checkpoint_reader.h) over the internal one of
// persist.h, which does the validation and checksums.

#include "sinew/checkpoint_reader.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "sinew/base/error.h"
#include "sinew/checkpoint/persist.h"

namespace sinew {

struct CheckpointReader::Impl {
  Impl(const std::string& dir, checkpoint::Manifest m) : reader(dir), manifest(std::move(m)) {}
  checkpoint::CheckpointReader reader;
  const checkpoint::Manifest manifest;  // Validated by Manifest::fromJson.

  const checkpoint::LayerLocation& layer(const std::string& name) const {
    auto it = manifest.layers.find(name);
    if (it == manifest.layers.end()) {
      SINEW_THROW(InvalidArgument, "checkpoint version ", manifest.step, " has no layer '", name,
                  "'");
    }
    return it->second;
  }
};

std::unique_ptr<CheckpointReader> CheckpointReader::open(const std::string& dir, int64_t step) {
  if (step < kLatest) SINEW_THROW(InvalidArgument, "checkpoint step must be >= 0, got ", step);
  checkpoint::CheckpointReader reader(dir);
  if (step == kLatest) {
    step = reader.latestStep();
    if (step < 0) SINEW_THROW(IoError, "checkpoint folder ", dir, " has no durable version");
  } else {
    const auto durable = reader.durableSteps();
    if (std::find(durable.begin(), durable.end(), step) == durable.end()) {
      SINEW_THROW(IoError, "checkpoint folder ", dir, " has no durable version ", step);
    }
  }
  return std::unique_ptr<CheckpointReader>(
      new CheckpointReader(std::make_unique<Impl>(dir, reader.manifest(step))));
}

std::vector<int64_t> CheckpointReader::steps(const std::string& dir) {
  return checkpoint::CheckpointReader(dir).durableSteps();
}

CheckpointReader::CheckpointReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CheckpointReader::~CheckpointReader() = default;

int64_t CheckpointReader::step() const { return impl_->manifest.step; }

std::vector<std::string> CheckpointReader::layers() const {
  std::vector<std::string> out;
  for (const auto& kv : impl_->manifest.layers) out.push_back(kv.first);
  return out;
}

std::vector<std::string> CheckpointReader::tensorNames(const std::string& layer) const {
  std::vector<std::string> out;
  const checkpoint::LayerLocation& loc = impl_->layer(layer);
  for (const auto& t : loc.tensors) out.push_back(t.name);
  for (const auto& kv : loc.sameAs) out.push_back(kv.first);  // Stored once, with the owner.
  return out;
}

std::map<std::string, at::Tensor> CheckpointReader::loadLayer(const std::string& layer) const {
  impl_->layer(layer);  // InvalidArgument naming the layer and version.
  auto got = impl_->reader.load(impl_->manifest.step, {layer});
  return std::move(got.at(layer));
}

int CheckpointReader::loadInto(torch::nn::Module& model) const {
  at::NoGradGuard noGrad;
  int loaded = 0;
  for (const auto& child : model.named_children()) {
    auto params = child.value()->named_parameters(/*recurse=*/true);
    if (params.size() == 0) continue;
    const std::map<std::string, at::Tensor> tensors = loadLayer(child.key());
    for (const auto& np : params) {
      auto it = tensors.find(np.key());
      if (it == tensors.end() || it->second.sizes() != np.value().sizes()) {
        SINEW_THROW(InvalidArgument, "checkpoint version ", step(), ", layer '", child.key(),
                    "': tensor '", np.key(),
                    it == tensors.end() ? "' is missing" : "' has another shape",
                    " (a checkpoint of another model?)");
      }
      np.value().detach().copy_(it->second);
    }
    ++loaded;
  }
  return loaded;
}

}  // namespace sinew
