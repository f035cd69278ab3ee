#pragma once

// The plan (docs/architecture.md sections 1 and 4): which worker holds which layers and runs which
// microbatches of each step. One type, two views of it:
//   - pipelines on nodes, as makePlan() and reconfigure() build them from the templates
//     (which nodes run each pipeline, its share of the global batch, idle nodes);
//   - the per-worker assignments the runtime executes (worker, node, device, pipeline, stage,
//     layers, microbatch indices), which makePlan() and reconfigure() derive from the first
//     view (workerAssignments) and Plan::dataParallel() builds directly.
// Data parallelism is the special case of one-stage pipelines, one per worker.
//
// Thread safety: plain values.

#include <cstdint>
#include <string>
#include <vector>

namespace sinew {
namespace pipeline {

// A pipeline placed on nodes.
struct PipelinePlan {
  int nodes = 0;             // its template
  std::vector<int> nodeIds;  // nodeIds[i] runs the template's node i
  int64_t microbatches = 0;
  int64_t iterationTicks = 0;
};

// One worker (one device) of a plan: the layers it holds and the microbatches it runs.
struct WorkerAssignment {
  // The worker id; -1 in plans made from templates until the runtime binds (node, device) to
  // a worker.
  int worker = -1;
  int node = -1;  // node id (the failure domain)
  int device = 0;
  int pipeline = 0;    // index in Plan::pipelines (or the worker's rank in a data-parallel plan)
  int stage = 0;       // index in the pipeline template's stages
  int firstLayer = 0;  // layers [firstLayer, endLayer)
  int endLayer = 0;
  std::vector<int64_t> microbatches;  // indices into the step's global batch
};

struct Plan {
  int64_t epoch = -1;
  int numLayers = 0;
  // B: microbatches in the global batch; never changed by a reconfiguration.
  int64_t microbatchesPerStep = 0;
  // The f the plan aims for: it runs >= f + 1 pipelines unless a reconfiguration left too few
  // nodes for that.
  int faultTolerance = 0;
  std::vector<PipelinePlan> pipelines;
  std::vector<int> idleNodeIds;
  int64_t iterationTicks = 0;
  // Every worker, by pipeline, then stage, then device.
  std::vector<WorkerAssignment> workers;

  // Every member holds every layer and runs a contiguous, near-equal share of the
  // microbatches (members in ascending id order): one one-stage pipeline per member, each
  // member its own node (node = worker id). REQUIRES: members is not empty.
  static Plan dataParallel(int64_t epoch, const std::vector<int>& members, int numLayers,
                           int64_t microbatchesPerStep);
  // Throws InvalidArgument naming the worker if it is not in the plan.
  const WorkerAssignment& of(int worker) const;
  // The assignment of `worker`, or null if the plan leaves it out (idle, or not a member).
  const WorkerAssignment* find(int worker) const;
};

// The plan as compact JSON (docs/pipeline.md, "The plan on the wire"): what the coordinator
// sends in every epoch message of a pipeline job. Worker microbatches are not listed; they
// follow from the pipelines' counts (pipeline p runs those after pipelines 0..p-1).
std::string planToJson(const Plan& plan);
// Parses and checks planToJson()'s format: every field present and in range, layer ranges
// within [0, num_layers), stages of each pipeline numbered from 0, the pipelines'
// microbatches summing to the global batch's, no worker listed twice. Throws Corruption naming
// the field.
Plan planFromJson(const std::string& text);

}  // namespace pipeline
}  // namespace sinew
