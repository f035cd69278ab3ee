#pragma once

// Instantiation and batch split (docs/architecture.md section 4): how many pipelines of each
// template to run on the live nodes, and how many of the global batch's B microbatches each
// pipeline runs. Both are exact (docs/planner.md, "Instantiation" and "Batch split").
//
// The iteration time of a set of pipelines is the slowest pipeline's 1F1B time for its
// microbatches, PipelineTemplate::iterationTicks(b); the throughput is B / iteration time. The
// global batch B never changes, so maximising throughput is minimising that iteration time.
//
// Thread safety: pure functions over plain values.

#include <cstdint>
#include <vector>

#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/template_planner.h"

namespace sinew {
namespace pipeline {

struct PlanOptions {
  // f: the plan runs at least f + 1 pipelines, so that every layer survives f pipeline losses.
  int fault_tolerance = 0;
  // B: microbatches in the global batch. >= 1.
  int64_t global_microbatches = 1;
};

// The microbatches of each pipeline: sum is exactly B, and the slowest pipeline is as fast as
// any integer split allows.
struct BatchSplit {
  std::vector<int64_t> microbatches;  // one per pipeline, in the order given
  int64_t iteration_ticks = 0;        // max over pipelines of iterationTicks(microbatches)
};

// Splits B microbatches over pipelines of the given templates, exactly minimising the slowest
// pipeline's time: binary search on the makespan Z, each pipeline taking the most microbatches
// that finish by Z (time is non-decreasing in b). Among optimal splits it returns the one that
// gives every pipeline the most it can take by Z* - 1 and hands the rest out in pipeline order.
// Throws sinew::InvalidArgument if a template is missing, B < 1 or no pipelines are given.
BatchSplit splitBatch(const TemplateSet& templates, const std::vector<int>& pipeline_nodes,
                      int64_t global_microbatches);

struct PipelineInstance {
  int nodes = 0;  // its template
  int64_t microbatches = 0;
  int64_t iteration_ticks = 0;
};

struct Instantiation {
  // Largest templates first.
  std::vector<PipelineInstance> pipelines;
  // Nodes left unused: 0 unless no combination of the templates covers all N nodes with
  // f + 1 pipelines (possible only when memory leaves gaps in the template sizes).
  int idle_nodes = 0;
  int64_t iteration_ticks = 0;
};

// Chooses the pipelines (a multiset of template sizes summing to N, or to the largest coverable
// N' <= N, with at least f + 1 pipelines) and their batch split that minimise the iteration time
// over all such choices and all integer splits of B: binary search on the makespan Z with an
// exact unbounded knapsack "most microbatches finishable by Z" over (nodes, pipelines). Among
// optimal choices it takes the one that can finish the most microbatches by the optimum.
// O(N * (f + 2) * |templates| * log(Z)) time.
// Throws sinew::InvalidArgument for nodes < 1, f < 0, B < 1, or when f + 1 pipelines do not
// fit on N nodes ("fault tolerance too large").
Instantiation instantiate(const TemplateSet& templates, int nodes, const PlanOptions& options);

// instantiate() over the given nodes, which go to the pipelines in order (the first pipeline
// gets the first nodes), with its worker assignments (workerAssignments). Throws
// sinew::InvalidArgument as instantiate() or for repeated or negative node ids.
Plan makePlan(const TemplateSet& templates, const std::vector<int>& node_ids,
              const PlanOptions& options);

// makePlan with as many of options.fault_tolerance + 1 pipelines as the nodes can hold: while
// makePlan finds no plan (too few nodes, or gaps in the template sizes), f is lowered by one.
// The plan's faultTolerance is the f it was made with. Throws as makePlan does at f = 0.
Plan makePlanLoweringFaultTolerance(const TemplateSet& templates, const std::vector<int>& node_ids,
                                    PlanOptions options);

// Every worker of the plan, by pipeline, then stage, then device (Plan::workers): pipeline p
// runs the global batch's microbatches after those of pipelines 0..p-1, every stage of it the
// same ones; worker ids stay -1. Throws
// sinew::InvalidArgument if a pipeline's template is missing or its node count differs.
std::vector<WorkerAssignment> workerAssignments(const TemplateSet& templates, const Plan& plan);

}  // namespace pipeline
}  // namespace sinew
