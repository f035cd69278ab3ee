#include "sinew/runtime/trainer_options.h"

#include <algorithm>

#include "sinew/base/error.h"
#include "sinew/communicator.h"

namespace sinew {
namespace runtime {

void checkTrainerOptions(const TrainerOptions& o, const ModelSpec& spec) {
  if (!o.checkpointDir.empty() && (o.checkpointEvery < 0 || o.checkpointKeep < 1)) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::checkpointEvery = ", o.checkpointEvery,
                " must be >= 0 and checkpointKeep = ", o.checkpointKeep, " >= 1");
  }
  if (o.globalBatch <= 0 || o.microbatch <= 0 || o.globalBatch % o.microbatch != 0) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::microbatch = ", o.microbatch,
                " must be positive and divide globalBatch = ", o.globalBatch);
  }
  if (!spec.loss || !spec.optimizer || !spec.dataset) {
    SINEW_THROW(InvalidArgument, "ModelSpec needs a loss, an optimizer and a dataset; missing:",
                spec.loss ? "" : " loss", spec.optimizer ? "" : " optimizer",
                spec.dataset ? "" : " dataset");
  }
  if (spec.datasetSize <= 0) {
    SINEW_THROW(InvalidArgument, "ModelSpec::datasetSize = ", spec.datasetSize,
                " must be positive");
  }
}

void checkPipelineOptions(const TrainerOptions& o) {
  if (o.faultTolerance < 0) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::faultTolerance = ", o.faultTolerance,
                " must be >= 0");
  }
  if (o.deviceMemoryBytes < 0) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::deviceMemoryBytes = ", o.deviceMemoryBytes,
                " must be >= 0 (0: unlimited)");
  }
  if (o.devicesPerNode < 1 || o.devicesPerNode > 4096) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::devicesPerNode = ", o.devicesPerNode,
                " must be in [1, 4096]");
  }
  if (o.maxWorkers < 0 || o.maxWorkers > (1 << 20)) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::maxWorkers = ", o.maxWorkers,
                " must be in [0, 2^20] (0: SINEW_MAX_WORKERS, else twice the start)");
  }
  if (o.peerCheckpointEvery < 0 || o.replicas < 1) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::peerCheckpointEvery = ", o.peerCheckpointEvery,
                " must be >= 0 and replicas = ", o.replicas, " >= 1");
  }
  if (o.profilePath.empty() && o.devicesPerNode > o.microbatch) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::devicesPerNode = ", o.devicesPerNode,
                " is more than microbatch = ", o.microbatch,
                ": a stage as wide as a node could not give every worker a sample");
  }
}
pipeline::Plan checkedPlan(const std::string& json, int64_t epoch, const std::vector<int>& members,
                           size_t layers) {
  pipeline::Plan plan = pipeline::planFromJson(json);
  if (plan.numLayers != static_cast<int>(layers)) {
    SINEW_THROW(InvalidArgument, "the coordinator's plan of epoch ", epoch, " has ", plan.numLayers,
                " layers but the model has ", layers,
                " (workers of one job must train the same ModelSpec)");
  }
  for (const auto& w : plan.workers) {
    if (std::find(members.begin(), members.end(), w.worker) == members.end()) {
      SINEW_THROW(Corruption, "the coordinator's plan of epoch ", epoch, " assigns layers to ",
                  "worker ", w.worker, ", which is not a member");
    }
  }
  return plan;
}

}  // namespace runtime
}  // namespace sinew
