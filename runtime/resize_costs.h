#pragma once

// What a change of the job's size would cost and gain (docs/control_api.md, "GET /v1/scaling"
// and "Costs"): the scaling curve (throughput by node count, measured and predicted), the cost
// of a resize to n nodes (pause, state bytes to move, whether it forces a rollback) and of
// removing given workers or each node. A scheduler reads these before it resizes or drains the
// job. Computed from a snapshot of the job-state machine's state (JobState::costInputs()),
// valid while that state does not change: nothing here changes the job.
//
// Internal to sinew_runtime. Thread safety: none; the job-state machine serializes every call.

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/template_planner.h"
#include "sinew/runtime/control_api.h"
#include "sinew/runtime/epoch_changes.h"
#include "sinew/runtime/job_measures.h"
#include "sinew/runtime/scaling_curve.h"

namespace sinew {
namespace runtime {

// What ResizeCosts reads of the job. Pointers and references into the job-state machine.
struct CostInputs {
  // A member of the current epoch, in member order.
  struct Member {
    int id = -1;
    const std::string* node = nullptr;  // null: no longer a live worker (declared dead)
    bool leaving = false;               // released, drained or resized away at this boundary
    double computeSeconds = -1;         // its last step's forward and backward (-1: not known)
  };
  std::vector<Member> members;
  int nextWorkerId = 0;  // the id the next worker to join gets
  bool running = false;  // an epoch formed and the job has not finished
  int64_t globalBatch = 0;
  int64_t microbatch = 0;
  int64_t totalSteps = 0;  // 0: not known
  int64_t committed = -1;
  // A pipeline job: its profile, templates and plan options, the current epoch's plan (null
  // before the first), and the plan the coordinator would make on the given nodes (each
  // node's first worker id; throws pipeline's errors when none fits).
  bool pipeline = false;
  const pipeline::Profile* profile = nullptr;
  const pipeline::TemplateSet* templates = nullptr;
  const pipeline::PlanOptions* planOptions = nullptr;
  const pipeline::Plan* plan = nullptr;
  std::function<pipeline::Plan(const std::vector<int>&)> planOnNodes;
  const EpochChanges* changes = nullptr;
  const JobMeasures* measures = nullptr;
  const control::JobLimits* limits = nullptr;
};

// The distinct nodes among `nodes` (null: none), in order of first appearance.
std::vector<std::string> distinctNodes(const std::vector<const std::string*>& nodes);

class ResizeCosts {
 public:
  explicit ResizeCosts(CostInputs in) : in_(std::move(in)) {}

  // Nodes the job keeps when `going` leave too (besides the members already leaving): a
  // pipeline job counts whole nodes of devices_per_node workers, a data-parallel one the
  // nodes its staying workers are on.
  int nodesKept(const std::set<int>& going) const;
  // Workers per node (a pipeline job's devices_per_node; data parallel: the staying
  // members over their nodes, rounded).
  int workersPerNode() const;
  // The cost of a resize to `nodes` from the present size: {pause_s, bytes, rollback, basis,
  // bytes_basis}.
  nlohmann::json resizeCost(int nodes) const;
  // The cost of the present members less `going`: the resize's, with the throughput before and
  // after and whether the rest can train at all.
  nlohmann::json removalCost(const std::set<int>& going) const;
  // Each node's removalCost() with its name and workers, cheapest first: a node whose removal
  // forces no rollback, then the most throughput kept, then the fewest bytes to move.
  nlohmann::json nodeCosts() const;
  // GET /v1/scaling's body.
  nlohmann::json scaling() const;

 private:
  // Pipelines: the state bytes the members of `next` must copy in from the present plan, and
  // whether a layer of it has no live holder among the nodes that stay (a rollback).
  std::pair<int64_t, bool> layerMoves(const pipeline::Plan& next) const;
  // The members' median compute time of their last step and their count ({0, 0}: not every
  // member reported one).
  std::pair<int, double> medianCompute() const;
  // The model's step time by worker count for the curve, from the sizes `measured`, and the
  // node counts it lists; fills `body`'s model fields and, for pipelines, `plans` (nodes ->
  // the plan's facts or why none).
  std::function<double(int)> stepModel(const std::map<int, MeasuredSize>& measured,
                                       nlohmann::json& body, std::map<int, nlohmann::json>& plans,
                                       int& lastNodes) const;

  CostInputs in_;
};

}  // namespace runtime
}  // namespace sinew
