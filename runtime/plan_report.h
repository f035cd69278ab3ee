#pragma once

// Internal: an epoch's pipeline plan as the trainer reports it: a "plan" event (pipelines,
// their stages' workers and layer ranges, idle nodes, the cost model's iteration time) and
// the lines the epoch's first member prints.
//
// Thread safety: pure functions.

#include <string>

#include <nlohmann/json.hpp>

#include "sinew/model.h"
#include "sinew/pipeline/plan.h"

namespace sinew {
namespace runtime {

struct PlanReport {
  nlohmann::json event;  // {"event": "plan", ...}
  std::string text;      // "sinew: epoch 3 plan: 2 pipelines\n  pipeline 0: ..."
};

// The report of `plan` in `epoch`; `predictedSeconds` is the cost model's 1F1B time of its
// slowest pipeline. REQUIRES: the plan's layer ranges are within spec.layers.
PlanReport reportPlan(const pipeline::Plan& plan, const ModelSpec& spec, int64_t epoch,
                      double predictedSeconds);

}  // namespace runtime
}  // namespace sinew
