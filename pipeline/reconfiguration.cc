#include "sinew/pipeline/reconfiguration.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "sinew/base/error.h"

namespace sinew {
namespace pipeline {
namespace {

// A pipeline while the next plan is being built.
struct Draft {
  std::vector<int> node_ids;
  bool alive = true;
  bool deficient = false;  // no template for its node count yet
};

std::string joinIds(const std::vector<int>& ids) {
  std::ostringstream os;
  for (size_t i = 0; i < ids.size(); ++i) os << (i ? "," : "") << ids[i];
  return os.str();
}

// Re-plans all survivors, keeping as many of f + 1 pipelines as they can hold.
Plan replan(const TemplateSet& templates, const std::vector<int>& survivors, const Plan& current) {
  const int n = static_cast<int>(survivors.size());
  if (n < templates.min_nodes) {
    SINEW_THROW(InvalidArgument, "reconfigure: ", n,
                " surviving nodes cannot hold the model (n_min = ", templates.min_nodes,
                "); restore from a checkpoint on more nodes");
  }
  // Gaps in the template sizes can leave no combination with f + 1 pipelines: fewer then.
  const int f = std::min(current.faultTolerance, n / templates.min_nodes - 1);
  return makePlanLoweringFaultTolerance(templates, survivors, {f, current.microbatchesPerStep});
}

void note(Reconfiguration& r, ReconfigurationKind kind, const std::string& step) {
  r.kind = std::max(r.kind, kind);
  r.steps.push_back(step);
}

// Step 3a: deficient pipeline p (m nodes) takes the fewest idle nodes that give it a template.
bool takeIdle(const TemplateSet& templates, size_t p, Draft& dp, std::vector<int>& idle,
              Reconfiguration& r) {
  const int m = static_cast<int>(dp.node_ids.size());
  for (int k = 1; k <= static_cast<int>(idle.size()); ++k) {
    if (templates.find(m + k) == nullptr) continue;
    std::vector<int> taken(idle.begin(), idle.begin() + k);
    idle.erase(idle.begin(), idle.begin() + k);
    dp.node_ids.insert(dp.node_ids.end(), taken.begin(), taken.end());
    note(r, ReconfigurationKind::kUseIdle,
         "pipeline " + std::to_string(p) + " takes idle node" + (k > 1 ? "s " : " ") +
             joinIds(taken) + ": " + std::to_string(m + k) + "-node template");
    return true;
  }
  return false;
}

// Step 3b: deficient pipeline p borrows the fewest nodes from the largest other pipeline with
// a template (ties: the first) that leave both with one.
bool borrow(const TemplateSet& templates, size_t p, std::vector<Draft>& drafts,
            Reconfiguration& r) {
  Draft& dp = drafts[p];
  const int m = static_cast<int>(dp.node_ids.size());
  int q = -1;
  for (size_t o = 0; o < drafts.size(); ++o) {
    if (o == p || !drafts[o].alive || drafts[o].deficient) continue;
    if (q < 0 || drafts[o].node_ids.size() > drafts[q].node_ids.size()) q = static_cast<int>(o);
  }
  if (q < 0) return false;
  Draft& dq = drafts[q];
  const int nq = static_cast<int>(dq.node_ids.size());
  for (int k = 1; k < nq; ++k) {
    if (templates.find(m + k) == nullptr || templates.find(nq - k) == nullptr) continue;
    std::vector<int> taken(dq.node_ids.end() - k, dq.node_ids.end());
    dq.node_ids.resize(nq - k);
    dp.node_ids.insert(dp.node_ids.end(), taken.begin(), taken.end());
    note(r, ReconfigurationKind::kBorrow,
         "pipeline " + std::to_string(p) + " borrows node" + (k > 1 ? "s " : " ") + joinIds(taken) +
             " from pipeline " + std::to_string(q) + ": " + std::to_string(m + k) + " and " +
             std::to_string(nq - k) + "-node templates");
    return true;
  }
  return false;
}

// Step 3c: deficient pipeline p merges into the smallest other pipeline whose combined size
// has a template.
bool merge(const TemplateSet& templates, size_t p, std::vector<Draft>& drafts, Reconfiguration& r) {
  Draft& dp = drafts[p];
  const int m = static_cast<int>(dp.node_ids.size());
  int q = -1;
  for (size_t o = 0; o < drafts.size(); ++o) {
    if (o == p || !drafts[o].alive) continue;
    int combined = m + static_cast<int>(drafts[o].node_ids.size());
    if (templates.find(combined) == nullptr) continue;
    if (q < 0 || drafts[o].node_ids.size() < drafts[q].node_ids.size()) q = static_cast<int>(o);
  }
  if (q < 0) return false;
  Draft& dq = drafts[q];
  dq.node_ids.insert(dq.node_ids.end(), dp.node_ids.begin(), dp.node_ids.end());
  dq.deficient = false;
  dp.alive = false;
  note(r, ReconfigurationKind::kMerge,
       "pipeline " + std::to_string(p) + " merges into pipeline " + std::to_string(q) + ": " +
           std::to_string(dq.node_ids.size()) + "-node template");
  return true;
}

// Step 5: the plan of the live drafts and `idle`, with the unchanged global batch re-split.
Plan assemble(const TemplateSet& templates, const Plan& current, const std::vector<Draft>& drafts,
              const std::vector<int>& idle) {
  Plan plan;
  plan.faultTolerance = current.faultTolerance;
  plan.microbatchesPerStep = current.microbatchesPerStep;
  plan.idleNodeIds = idle;
  std::vector<int> sizes;
  for (const Draft& d : drafts) {
    if (!d.alive) continue;
    PipelinePlan pp;
    pp.nodes = static_cast<int>(d.node_ids.size());
    pp.nodeIds = d.node_ids;
    sizes.push_back(pp.nodes);
    plan.pipelines.push_back(std::move(pp));
  }
  BatchSplit split = splitBatch(templates, sizes, current.microbatchesPerStep);
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    plan.pipelines[p].microbatches = split.microbatches[p];
    plan.pipelines[p].iterationTicks =
        templates.find(sizes[p])->iterationTicks(split.microbatches[p]);
  }
  plan.iterationTicks = split.iteration_ticks;
  plan.numLayers = templates.num_layers;
  plan.workers = workerAssignments(templates, plan);
  return plan;
}

}  // namespace

const char* reconfigurationKindName(ReconfigurationKind kind) {
  switch (kind) {
    case ReconfigurationKind::kUnchanged:
      return "unchanged";
    case ReconfigurationKind::kShrink:
      return "shrink";
    case ReconfigurationKind::kUseIdle:
      return "use-idle";
    case ReconfigurationKind::kBorrow:
      return "borrow";
    case ReconfigurationKind::kMerge:
      return "merge";
    case ReconfigurationKind::kReplan:
      return "replan";
  }
  return "unknown";
}

Reconfiguration reconfigure(const TemplateSet& templates, const Plan& current,
                            const std::vector<int>& lost_node_ids) {
  std::set<int> in_plan(current.idleNodeIds.begin(), current.idleNodeIds.end());
  for (const PipelinePlan& p : current.pipelines)
    in_plan.insert(p.nodeIds.begin(), p.nodeIds.end());
  std::set<int> lost;
  for (int id : lost_node_ids) {
    if (!in_plan.count(id)) {
      SINEW_THROW(InvalidArgument, "reconfigure: lost node ", id, " is not in the plan");
    }
    lost.insert(id);
  }
  Reconfiguration r;

  // 1. Remove the lost nodes; pipelines keep their survivors in order.
  std::vector<Draft> drafts(current.pipelines.size());
  std::vector<int> idle;
  std::vector<int> survivors;  // all surviving nodes, pipelines first, in plan order
  bool any_pipeline_hit = false;
  for (size_t p = 0; p < current.pipelines.size(); ++p) {
    std::vector<int> lost_here;
    for (int id : current.pipelines[p].nodeIds) {
      if (lost.count(id)) {
        lost_here.push_back(id);
      } else {
        drafts[p].node_ids.push_back(id);
        survivors.push_back(id);
      }
    }
    if (lost_here.empty()) continue;
    any_pipeline_hit = true;
    const int m = static_cast<int>(drafts[p].node_ids.size());
    std::ostringstream os;
    os << "pipeline " << p << " lost node" << (lost_here.size() > 1 ? "s " : " ")
       << joinIds(lost_here);
    // 2. Shrink to the template for the survivors, if there is one.
    if (m == 0) {
      drafts[p].alive = false;
      os << ": no node left, pipeline removed";
      note(r, ReconfigurationKind::kShrink, os.str());
    } else if (templates.find(m) != nullptr) {
      os << ": shrinks to the " << m << "-node template";
      note(r, ReconfigurationKind::kShrink, os.str());
    } else {
      drafts[p].deficient = true;
      os << ": " << m << " nodes left, no template";
      r.steps.push_back(os.str());
    }
  }
  for (int id : current.idleNodeIds) {
    if (!lost.count(id)) {
      idle.push_back(id);
      survivors.push_back(id);
    }
  }
  if (!any_pipeline_hit) {
    r.plan = current;
    r.plan.idleNodeIds = idle;
    return r;
  }

  bool need_replan = false;
  // 3. Fix pipelines without a template: idle nodes, then borrow, then merge.
  for (size_t p = 0; p < drafts.size() && !need_replan; ++p) {
    Draft& dp = drafts[p];
    if (!dp.alive || !dp.deficient) continue;
    const bool fixed = takeIdle(templates, p, dp, idle, r) || borrow(templates, p, drafts, r) ||
                       merge(templates, p, drafts, r);
    if (fixed) {
      dp.deficient = false;
    } else {
      need_replan = true;
    }
  }
  int alive = 0;
  for (const Draft& d : drafts) alive += d.alive ? 1 : 0;
  const int total = static_cast<int>(survivors.size());
  // 4. Keep f + 1 pipelines whenever the survivors can hold them.
  if (!need_replan && alive < current.faultTolerance + 1 &&
      total >= (current.faultTolerance + 1) * templates.min_nodes) {
    need_replan = true;
  }
  if (need_replan || alive == 0) {
    r.plan = replan(templates, survivors, current);
    r.plan.faultTolerance = current.faultTolerance;  // keep aiming for f + 1 pipelines
    note(r, ReconfigurationKind::kReplan,
         "re-plan all " + std::to_string(total) +
             " surviving nodes: " + std::to_string(r.plan.pipelines.size()) + " pipelines");
  } else {
    // 5. Assemble the plan and re-split the unchanged global batch.
    r.plan = assemble(templates, current, drafts, idle);
  }
  r.plan.epoch = current.epoch;
  return r;
}

std::vector<LiveLayerCopy> liveLayerCopies(const Plan& next,
                                           const std::vector<std::vector<int>>& live,
                                           const std::vector<int64_t>& layer_bytes) {
  const int L = next.numLayers;
  if (static_cast<int>(live.size()) != L || static_cast<int>(layer_bytes.size()) != L) {
    SINEW_THROW(InvalidArgument, "liveLayerCopies: the plan has ", L, " layers, but live has ",
                live.size(), " entries and layer_bytes ", layer_bytes.size());
  }
  std::vector<WorkerAssignment> ws = next.workers;
  std::sort(ws.begin(), ws.end(), [](const auto& a, const auto& b) { return a.worker < b.worker; });
  // The workers of each layer in increasing id order: O(sum of the ranges), not O(L * W).
  std::vector<std::vector<int>> holders(static_cast<size_t>(L));
  for (const auto& w : ws) {
    for (int l = std::max(0, w.firstLayer); l < std::min(L, w.endLayer); ++l) {
      holders[static_cast<size_t>(l)].push_back(w.worker);
    }
  }
  // What each worker receives here, known before any source is chosen.
  std::unordered_map<int, int64_t> traffic;
  std::vector<LiveLayerCopy> copies;
  for (int l = 0; l < L; ++l) {
    if (live[l].empty()) continue;
    const bool sorted = std::is_sorted(live[l].begin(), live[l].end());
    for (int w : holders[static_cast<size_t>(l)]) {
      const bool held = sorted ? std::binary_search(live[l].begin(), live[l].end(), w)
                               : std::find(live[l].begin(), live[l].end(), w) != live[l].end();
      if (!held) {
        copies.push_back({l, -1, w});
        traffic[w] += layer_bytes[l];
      }
    }
  }
  for (auto& c : copies) {
    int best = -1;
    int64_t bestTraffic = 0;
    for (int w : live[c.layer]) {
      const int64_t t = traffic[w];
      if (best < 0 || t < bestTraffic || (t == bestTraffic && w < best)) {
        best = w;
        bestTraffic = t;
      }
    }
    c.from = best;
    traffic[best] += layer_bytes[c.layer];
  }
  return copies;
}

}  // namespace pipeline
}  // namespace sinew
