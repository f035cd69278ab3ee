#pragma once

// Reads the durable checkpoints a Sinew job writes (docs/checkpoint_format.md), so that a
// plain C++ program can load a trained model's tensors by layer name, without a job,
// coordinator or communicator:
//
//   auto reader = sinew::CheckpointReader::open("/ckpt");  // The version LATEST names.
//   reader->loadInto(*model);  // every layer with parameters, by name; or one at a time:
//   std::map<std::string, at::Tensor> tensors = reader->loadLayer("fc1");  // "weight",
//                                                 // "bias", "weight.exp_avg", ...
//
// Every read is verified: the LATEST pointer's checksum of the manifest, the manifest's
// and each file's safetensors header against the file (dtypes, shapes, offsets within the
// file, no overlaps) and each tensor's crc32c. Damage is reported as sinew::Corruption and
// missing or unreadable files as sinew::IoError, both naming the file; a layer the version
// does not have is sinew::InvalidArgument.
//
// Thread safety: a CheckpointReader is immutable after open(); its const methods may be
// called from any number of threads at once. It reads the files at each load, so the
// version must stay on disk while it is used (a running job keeps its newest versions).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sinew/error.h"

namespace sinew {

class CheckpointReader {
 public:
  // The version LATEST names.
  static constexpr int64_t kLatest = -1;

  // Opens version `step` (kLatest: the newest durable one) of the checkpoint folder `dir`
  // and reads and validates its manifest. Throws IoError if the folder has no durable
  // version (or not that one), Corruption if its LATEST pointer or manifest is damaged.
  static std::unique_ptr<CheckpointReader> open(const std::string& dir, int64_t step = kLatest);
  // Versions of `dir` that have a manifest, newest first (empty if none).
  static std::vector<int64_t> steps(const std::string& dir);

  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  // The version: the state after this many optimizer steps (numbered from 0).
  int64_t step() const;
  // The layers the version holds, sorted by name.
  std::vector<std::string> layers() const;
  // The tensors of `layer`, in their order in the file. InvalidArgument for an unknown layer.
  std::vector<std::string> tensorNames(const std::string& layer) const;
  // Reads `layer` into new CPU tensors (tensor name -> tensor, each owning its memory),
  // verifying each tensor's crc32c. InvalidArgument for an unknown layer.
  std::map<std::string, at::Tensor> loadLayer(const std::string& layer) const;
  // Loads the version's parameters into `model` (e.g. the torch::nn::Sequential that
  // sinew::buildModel() makes): each child that has parameters from the layer of its name,
  // each parameter from the tensor of its name, cast to the parameter's dtype and device;
  // optimizer state is left out, and children without parameters (activations, Flatten) need
  // no layer. Returns the number of layers loaded. Throws InvalidArgument naming the layer and
  // tensor if one is missing or has another shape (a checkpoint of another model).
  int loadInto(torch::nn::Module& model) const;

 private:
  struct Impl;
  explicit CheckpointReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sinew
