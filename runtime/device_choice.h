#pragma once

// Internal: where a worker trains and how its communicators move tensors (docs/gpu.md).
// resolveDevice() turns TrainerOptions::device into a device this process can use;
// BackendChooser publishes this worker's device and asked-for backend in the job's store and
// makes each communicator with the backend every member chooses alike from what all of them
// published: NCCL when every member has a GPU of its own and none asks for Gloo, else Gloo
// (through host memory for CUDA tensors).
//
// Thread safety: used by the training thread.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "sinew/collectives/gloo/gloo_options.h"
#include "sinew/communicator.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

// The local rank the launcher gives this process (its index among the workers of its
// machine: SINEW_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, MPI_LOCALRANKID or
// LOCAL_RANK), or -1 if none says.
int localRankFromEnv();

// TrainerOptions::device of `worker` as a device: "cpu", "cuda" (the GPU of the local rank
// modulo the GPUs seen, else of the worker id) or "cuda:N". Throws InvalidArgument naming the
// option, the worker and why (malformed, no CUDA in this build or libtorch, no such GPU).
at::Device resolveDevice(const std::string& device, int worker);

class BackendChooser {
 public:
  // REQUIRES: services outlive the chooser.
  BackendChooser(const TrainerServices& services, at::Device device);

  // Publishes this worker's device and asked-for backend (TrainerOptions::backend).
  void publish(collectives::Store& store);

  // The communicator of `co.members`: NCCL if every member chose it, else Gloo. Throws
  // InvalidArgument if TrainerOptions::backend is kNccl and NCCL cannot be used. Communicators
  // named "dp" or "pp" (the epoch's own) report a change of backend as an event and, on the
  // epoch's first member, a line on stdout.
  // `gloo`: the Gloo backend's options, where Gloo is chosen.
  std::unique_ptr<collectives::Communicator> make(const std::shared_ptr<collectives::Store>& store,
                                                  collectives::CommunicatorOptions co,
                                                  const collectives::GlooOptions& gloo = {});

  // The backend of the last epoch communicator: "gloo", "nccl", or empty before the first.
  const std::string& backend() const { return backend_; }

 private:
  static std::string key(int worker);
  bool ncclChosen(collectives::Store& store, const std::vector<int>& members, std::string* why);

  const TrainerServices& s_;  // The trainer's; outlives the chooser.
  const at::Device device_;
  std::string backend_;
  std::string backendWhy_;  // Why, as last reported.
};

}  // namespace runtime
}  // namespace sinew
