#pragma once

// Internal: an epoch's pipeline plan as the trainer reports it: a "plan" event (pipelines,
// their stages' workers and layer ranges, idle nodes, the cost model's iteration time) and
// the lines the epoch's first member prints.
//
// Thread safety: pure functions.

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sinew/model.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

struct PlanReport {
  nlohmann::json event;  // {"event": "plan", ...}
  std::string text;      // "sinew: epoch 3 plan: 2 pipelines\n  pipeline 0: ..."
};

// The report of `plan` in `epoch`; `predictedSeconds` is the cost model's 1F1B time of its
// slowest pipeline. With `profile` (the one the plan was made from; a joiner's is empty and
// ignored), each worker's entry also
// has `memory_bytes`, the cost model's memory for its stage: its layers' parameters,
// gradients and optimizer state, and the activations of the microbatches 1F1B keeps in flight
// at its position (docs/planner.md). REQUIRES: the plan's layer ranges are within spec.layers
// and the profile's layers.
PlanReport reportPlan(const pipeline::Plan& plan, const ModelSpec& spec, int64_t epoch,
                      double predictedSeconds, const pipeline::Profile* profile = nullptr);

// Logs the report of epoch `epoch`'s `plan`, made from `profile`, as an event and, on the
// epoch's first member (of `members`), prints it. The predicted time is the plan's iteration
// ticks (nanoseconds per device of a node of the profile's devices_per_node).
void announcePlan(const TrainerServices& services, const pipeline::Plan& plan,
                  const ModelSpec& spec, int64_t epoch, const std::vector<int>& members,
                  const pipeline::Profile& profile);

}  // namespace runtime
}  // namespace sinew
