#pragma once

// Internal: the checks of a Trainer's options and model spec that need nothing else (the
// device, the profile file and the optimizer are checked where they are made).
//
// Thread safety: pure functions.

#include <cstdint>
#include <string>
#include <vector>

#include "sinew/model.h"
#include "sinew/pipeline/plan.h"
#include "sinew/trainer.h"

namespace sinew {
namespace runtime {

// Throws InvalidArgument naming the first option (TrainerOptions::x = value) or ModelSpec
// field that is out of range or missing: batch sizes, the spec's loss, optimizer, dataset and
// its size.
void checkTrainerOptions(const TrainerOptions& options, const ModelSpec& spec);

// The same for the options of pipeline mode: fault tolerance, memory, devices per node (at
// most the microbatch when the profile is measured), the most workers, and the peer-RAM versions'
// period and replicas.
void checkPipelineOptions(const TrainerOptions& options);

// The coordinator's plan of epoch `epoch` (its JSON), checked against the model and the
// epoch: InvalidArgument if it plans another number of layers than `layers` (workers of one
// job training different ModelSpecs), Corruption if it gives layers to a non-member.
pipeline::Plan checkedPlan(const std::string& json, int64_t epoch, const std::vector<int>& members,
                           size_t layers);

}  // namespace runtime
}  // namespace sinew
