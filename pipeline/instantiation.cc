#include "sinew/pipeline/instantiation.h"

#include <algorithm>
#include <limits>
#include <set>

#include "sinew/base/error.h"

namespace sinew {
namespace pipeline {
namespace {

constexpr int64_t kSumLimit = std::numeric_limits<int64_t>::max() / 2;

// The most microbatches a pipeline of template `t` finishes within Z ticks, at most `limit`.
// iterationTicks(b) is 0 for b = 0 and fill + (b - 1) * bottleneck after, so it is
// non-decreasing in b and this is a closed form.
int64_t capacity(const PipelineTemplate& t, int64_t Z, int64_t limit) {
  if (Z < 0) return 0;
  if (Z < t.fill_ticks) return 0;
  if (t.bottleneck_ticks == 0) return limit;
  return std::min(limit, 1 + (Z - t.fill_ticks) / t.bottleneck_ticks);
}

const PipelineTemplate& requireTemplate(const TemplateSet& templates, int nodes) {
  const PipelineTemplate* t = templates.find(nodes);
  if (t == nullptr) {
    SINEW_THROW(InvalidArgument, "no pipeline template for ", nodes, " nodes (templates cover ",
                templates.min_nodes, "..", templates.max_nodes, " with gaps where memory forbids)");
  }
  return *t;
}

// Makespan search shared by splitBatch and instantiate: the least Z in [0, hi] with
// feasible(Z), given feasible(hi).
template <typename Feasible>
int64_t leastMakespan(int64_t hi, const Feasible& feasible) {
  int64_t lo = 0;
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    if (feasible(mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

BatchSplit splitOver(const std::vector<const PipelineTemplate*>& pipes, int64_t B) {
  int64_t hi = 0;
  for (const PipelineTemplate* t : pipes) hi = std::max(hi, t->iterationTicks(B));
  auto total = [&](int64_t Z) {
    int64_t sum = 0;
    for (const PipelineTemplate* t : pipes) sum += capacity(*t, Z, B);
    return sum;
  };
  int64_t z = leastMakespan(hi, [&](int64_t Z) { return total(Z) >= B; });
  BatchSplit split;
  split.microbatches.resize(pipes.size());
  int64_t rest = B;
  for (size_t p = 0; p < pipes.size(); ++p) {
    split.microbatches[p] = capacity(*pipes[p], z - 1, B);
    rest -= split.microbatches[p];
  }
  for (size_t p = 0; p < pipes.size() && rest > 0; ++p) {
    int64_t more = std::min(rest, capacity(*pipes[p], z, B) - split.microbatches[p]);
    split.microbatches[p] += more;
    rest -= more;
  }
  SINEW_ENFORCE(rest == 0, "batch split lost ", rest, " microbatches");
  for (size_t p = 0; p < pipes.size(); ++p) {
    split.iteration_ticks =
        std::max(split.iteration_ticks, pipes[p]->iterationTicks(split.microbatches[p]));
  }
  return split;
}

void checkOptions(int nodes, const PlanOptions& options) {
  if (nodes < 1) {
    SINEW_THROW(InvalidArgument, "plan: nodes must be >= 1, got ", nodes);
  }
  if (options.fault_tolerance < 0) {
    SINEW_THROW(InvalidArgument, "plan: fault_tolerance must be >= 0, got ",
                options.fault_tolerance);
  }
  if (options.global_microbatches < 1) {
    SINEW_THROW(InvalidArgument, "plan: global_microbatches must be >= 1, got ",
                options.global_microbatches);
  }
}

}  // namespace

BatchSplit splitBatch(const TemplateSet& templates, const std::vector<int>& pipeline_nodes,
                      int64_t global_microbatches) {
  if (global_microbatches < 1) {
    SINEW_THROW(InvalidArgument, "splitBatch: global_microbatches must be >= 1, got ",
                global_microbatches);
  }
  if (pipeline_nodes.empty()) {
    SINEW_THROW(InvalidArgument, "splitBatch: no pipelines");
  }
  std::vector<const PipelineTemplate*> pipes;
  for (int n : pipeline_nodes) pipes.push_back(&requireTemplate(templates, n));
  return splitOver(pipes, global_microbatches);
}

Instantiation instantiate(const TemplateSet& templates, int nodes, const PlanOptions& options) {
  checkOptions(nodes, options);
  const int N = nodes;
  const int f = options.fault_tolerance;
  const int64_t B = options.global_microbatches;
  const std::vector<PipelineTemplate>& tpl = templates.templates;
  if (tpl.empty()) {
    SINEW_THROW(InvalidArgument, "instantiate: no templates");
  }
  if (static_cast<int64_t>(f + 1) * templates.min_nodes > N) {
    SINEW_THROW(InvalidArgument, "instantiate: fault_tolerance=", f,
                " needs (f + 1) * n_min = ", static_cast<int64_t>(f + 1) * templates.min_nodes,
                " nodes (n_min = ", templates.min_nodes, ") but nodes=", N);
  }
  // State (u, c): u nodes used by pipelines, c = min(pipelines, f + 1). Index u * C + c.
  const int C = f + 2;
  const size_t states = static_cast<size_t>(N + 1) * C;
  if (states > (size_t{1} << 28)) {
    SINEW_THROW(InvalidArgument, "instantiate: nodes * (fault_tolerance + 2) = ", states,
                " is beyond the planner's table limit of 2^28");
  }
  auto next = [&](int c) { return std::min(c + 1, f + 1); };
  // 1. Which node totals are reachable with f + 1 pipelines (independent of the makespan).
  std::vector<char> reach(states, 0);
  reach[0] = 1;
  for (int u = 0; u <= N; ++u) {
    for (int c = 0; c < C; ++c) {
      if (!reach[u * C + c]) continue;
      for (const PipelineTemplate& t : tpl) {
        if (u + t.nodes <= N) reach[(u + t.nodes) * C + next(c)] = 1;
      }
    }
  }
  int used = N;
  while (used > 0 && !reach[used * C + f + 1]) --used;
  if (used == 0) {
    SINEW_THROW(InvalidArgument, "instantiate: no combination of templates (", tpl.front().nodes,
                "..", tpl.back().nodes, " nodes) forms ", f + 1, " pipelines on ", N, " nodes");
  }
  // 2. For a makespan Z: the most microbatches finishable by Z over all choices, by an unbounded
  // knapsack over (u, c); parent records the last template added for reconstruction.
  std::vector<int64_t> best(states);
  std::vector<int32_t> parent(states);
  auto knapsack = [&](int64_t Z) {
    std::fill(best.begin(), best.end(), -1);
    std::fill(parent.begin(), parent.end(), -1);
    best[0] = 0;
    std::vector<int64_t> cap(tpl.size());
    for (size_t i = 0; i < tpl.size(); ++i) cap[i] = capacity(tpl[i], Z, B);
    for (int u = 0; u <= used; ++u) {
      for (int c = 0; c < C; ++c) {
        int64_t v = best[u * C + c];
        if (v < 0) continue;
        for (size_t i = 0; i < tpl.size(); ++i) {
          int nu = u + tpl[i].nodes;
          if (nu > used) continue;
          size_t s = static_cast<size_t>(nu) * C + next(c);
          // Both terms are <= kSumLimit, so the sum cannot overflow; ties keep the first
          // (deterministic) choice.
          int64_t nv = std::min(kSumLimit, v + cap[i]);
          if (nv > best[s]) {
            best[s] = nv;
            parent[s] = static_cast<int32_t>(i * C + c);
          }
        }
      }
    }
    return best[static_cast<size_t>(used) * C + f + 1];
  };
  int64_t hi = 0;
  for (const PipelineTemplate& t : tpl) hi = std::max(hi, t.iterationTicks(B));
  int64_t z = leastMakespan(hi, [&](int64_t Z) { return knapsack(Z) >= B; });
  knapsack(z);
  // 3. Reconstruct the choice at the optimum and split B over it.
  std::vector<const PipelineTemplate*> pipes;
  size_t s = static_cast<size_t>(used) * C + f + 1;
  while (s != 0) {
    int32_t p = parent[s];
    SINEW_ENFORCE(p >= 0, "instantiate: broken reconstruction");
    const PipelineTemplate& t = tpl[p / C];
    pipes.push_back(&t);
    s = static_cast<size_t>(s / C - t.nodes) * C + p % C;
  }
  std::stable_sort(
      pipes.begin(), pipes.end(),
      [](const PipelineTemplate* a, const PipelineTemplate* b) { return a->nodes > b->nodes; });
  BatchSplit split = splitOver(pipes, B);
  SINEW_ENFORCE(split.iteration_ticks == z, "instantiate: split makespan ", split.iteration_ticks,
                " != optimum ", z);
  Instantiation result;
  result.idle_nodes = N - used;
  result.iteration_ticks = z;
  for (size_t p = 0; p < pipes.size(); ++p) {
    result.pipelines.push_back(
        {pipes[p]->nodes, split.microbatches[p], pipes[p]->iterationTicks(split.microbatches[p])});
  }
  return result;
}

Plan makePlan(const TemplateSet& templates, const std::vector<int>& node_ids,
              const PlanOptions& options) {
  std::set<int> seen;
  for (int id : node_ids) {
    if (id < 0) {
      SINEW_THROW(InvalidArgument, "makePlan: node ids must be >= 0, got ", id);
    }
    if (!seen.insert(id).second) {
      SINEW_THROW(InvalidArgument, "makePlan: node id ", id, " appears twice");
    }
  }
  Instantiation inst = instantiate(templates, static_cast<int>(node_ids.size()), options);
  Plan plan;
  plan.numLayers = templates.num_layers;
  plan.faultTolerance = options.fault_tolerance;
  plan.microbatchesPerStep = options.global_microbatches;
  plan.iterationTicks = inst.iteration_ticks;
  size_t next = 0;
  for (const PipelineInstance& p : inst.pipelines) {
    PipelinePlan pp;
    pp.nodes = p.nodes;
    pp.nodeIds.assign(node_ids.begin() + next, node_ids.begin() + next + p.nodes);
    next += p.nodes;
    pp.microbatches = p.microbatches;
    pp.iterationTicks = p.iteration_ticks;
    plan.pipelines.push_back(std::move(pp));
  }
  plan.idleNodeIds.assign(node_ids.begin() + next, node_ids.end());
  plan.workers = workerAssignments(templates, plan);
  return plan;
}

Plan makePlanLoweringFaultTolerance(const TemplateSet& templates, const std::vector<int>& node_ids,
                                    PlanOptions options) {
  while (true) {
    try {
      return makePlan(templates, node_ids, options);
    } catch (const InvalidArgument&) {
      if (options.fault_tolerance <= 0) throw;
      options.fault_tolerance--;
    }
  }
}

std::vector<WorkerAssignment> workerAssignments(const TemplateSet& templates, const Plan& plan) {
  std::vector<WorkerAssignment> workers;
  int64_t firstMicrobatch = 0;
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    const PipelinePlan& pp = plan.pipelines[p];
    const PipelineTemplate& t = requireTemplate(templates, pp.nodes);
    if (static_cast<int>(pp.nodeIds.size()) != t.nodes) {
      SINEW_THROW(InvalidArgument, "plan: pipeline ", p, " has ", pp.nodeIds.size(),
                  " node ids for a ", t.nodes, "-node template");
    }
    std::vector<int64_t> microbatches;
    for (int64_t m = firstMicrobatch; m < firstMicrobatch + pp.microbatches; ++m) {
      microbatches.push_back(m);
    }
    firstMicrobatch += pp.microbatches;
    for (size_t s = 0; s < t.stages.size(); ++s) {
      const StageAssignment& st = t.stages[s];
      for (int dev = st.first_device; dev < st.first_device + st.devices; ++dev) {
        WorkerAssignment w;
        w.node = pp.nodeIds[st.node];
        w.device = dev;
        w.pipeline = static_cast<int>(p);
        w.stage = static_cast<int>(s);
        w.firstLayer = st.first_layer;
        w.endLayer = st.end_layer;
        w.microbatches = microbatches;
        workers.push_back(std::move(w));
      }
    }
  }
  return workers;
}

}  // namespace pipeline
}  // namespace sinew
