#pragma once

// The next plan after node losses (docs/architecture.md section 4, "Reconfiguration"), as a pure
// function the runtime calls with the templates computed at start. Pipelines that lost no node
// keep their nodes and layers; an affected pipeline, in order of preference:
//   1. shrinks: runs the template for its surviving node count on its survivors;
//   2. takes idle nodes (left over by an earlier plan) up to the next template size;
//   3. borrows nodes from the largest pipeline, which shrinks to a smaller template;
//   4. merges with the smallest other pipeline whose combined size has a template.
// If none applies, or the plan would fall below f + 1 pipelines although the survivors could
// hold f + 1, all survivors are re-planned with instantiate(). The global batch is unchanged
// and re-split exactly (splitBatch). Then, for every worker, the layers it must now hold that
// it did not hold before, and where to copy them from.
//
// Thread safety: pure function over plain values.

#include <string>
#include <vector>

#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/template_planner.h"

namespace sinew {
namespace pipeline {

enum class ReconfigurationKind {
  kUnchanged,  // no node of the plan was lost (or only idle ones)
  kShrink,
  kUseIdle,
  kBorrow,
  kMerge,
  kReplan,
};

const char* reconfigurationKindName(ReconfigurationKind kind);

struct Reconfiguration {
  Plan plan;
  // The most drastic step taken (kReplan > kMerge > kBorrow > kUseIdle > kShrink).
  ReconfigurationKind kind = ReconfigurationKind::kUnchanged;
  // One line per step, for logs: e.g. "pipeline 1 lost node 7: shrinks to the 3-node template".
  std::vector<std::string> steps;
};

// REQUIRES: `current` was made from `templates` (makePlan or an earlier reconfigure).
// Throws sinew::InvalidArgument if a lost node id is not in the plan, or if the survivors are
// fewer than templates.min_nodes (the model no longer fits: restore from a checkpoint on more
// nodes).
Reconfiguration reconfigure(const TemplateSet& templates, const Plan& current,
                            const std::vector<int>& lost_node_ids);

// One layer copy of a running job's reconfiguration (docs/pipeline.md, "Reconfiguration, step
// by step"): worker `to` receives layer `layer`, parameters and optimizer state, from worker
// `from`, which holds it live (its state is after the step the job resumes from).
struct LiveLayerCopy {
  int layer = 0;
  int from = -1;
  int to = -1;
};

// The copies that give every worker of `next` each layer of its range that it does not hold
// live. live[l] lists the workers that hold layer l live, in increasing id order;
// layer_bytes[l] is its size (any unit, the same for every layer). A layer nobody holds live
// gets no copy. The copies are ordered by layer, then receiving worker id: the order in which
// every member posts their messages. Each copy's source is the live holder with the least
// traffic in this list so far, counting the bytes it already sends and every byte it receives
// here, the lowest id on ties. So no holder sends every copy while others that hold the same
// layers stay idle, and a worker that is itself receiving is asked to send last. Every member
// computes the same list from the same arguments.
// Throws sinew::InvalidArgument if live or layer_bytes do not have next.numLayers entries.
std::vector<LiveLayerCopy> liveLayerCopies(const Plan& next,
                                           const std::vector<std::vector<int>>& live,
                                           const std::vector<int64_t>& layer_bytes);

}  // namespace pipeline
}  // namespace sinew
