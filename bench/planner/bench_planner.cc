// sinew-bench-planner: wall time of the whole planning step (templates for every node count,
// instantiation and batch split) on synthetic profiles, for (layers L, nodes N, devices per
// node G) = (32, 32, 8), (96, 64, 8), (1000, 1024, 8). The last line is
//   RESULT plan_ms_32_32_8=<a> plan_ms_96_64_8=<b> plan_ms_1000_1024_8=<c>
//
// Synthetic profile (fixed seed): forward U(0.5, 1.5) ms, backward U(1, 3) ms, parameters
// U(0.9, 1.1) x 64 MiB per layer with Adam-like optimizer state (2 x parameters), activations
// U(0.5, 1.5) MiB and outputs 1 MiB per microbatch; each device holds the static bytes of one
// layer but not two (1.6 x the mean) plus L x 1.5 MiB of activations, so the model needs
// several nodes (n_min = 4, 8 and 20). Fault tolerance f = 1, B = 4 * N microbatches.
// (synthetic_profile.h; the planner tests use the same profile.)
//
// As a baseline in the same run, the (32, 32, 8) case is also planned by the straightforward
// exact search over both template families (baselineTemplates: every bottleneck candidate, a
// plain DP each, no pruning), and the two must agree on every node count's cost.
//
// Then, for each case, what the job does on a node's loss (issue 41: inside a second at 1,024
// nodes x 8 devices and 1,000 layers): the plan on all N nodes (makePlan, workers bound as
// node * G + device), the loss of a node in the middle of the first pipeline (reconfigure),
// the layer copies every worker computes for the new plan from the survivors' live layers
// (liveLayerCopies), and the new plan's epoch message (planToJson once at the coordinator,
// planFromJson at each worker). `loss_ms` is reconfigure + copies + one planFromJson: the
// planning a survivor waits for; the last line adds
//   loss_ms_1000_1024_8=<ms> plan_json_kib_1000_1024_8=<k>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sinew/pipeline/cost_model.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/reconfiguration.h"
#include "sinew/pipeline/template_planner.h"
#include "synthetic_profile.h"

namespace {

using sinew::pipeline::CostModel;
using sinew::pipeline::Instantiation;
using sinew::pipeline::Plan;
using sinew::pipeline::Profile;
using sinew::pipeline::TemplateSet;

double msSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The baseline: a plain exact search over both template families of docs/planner.md, for every
// n at once. Uniform: every width, every stage count, every candidate bottleneck T (every
// stage's compute time), an O(S * L^2) least-fill DP each. Mixed (chain widths 1, 2, 4, 8): for
// every candidate T, a plain DP over (stages k, first layer i, devices W); the best on n nodes
// is the least over T of (least fill with S >= n, W <= n * G) + (M - 1) * T, which is exact
// because the optimum's own bottleneck is one of the candidates. No pruning of any kind.
std::vector<int64_t> baselineTemplates(const CostModel& m, int n_lo, int n_hi, int64_t B, int N) {
  const int L = m.numLayers();
  const int G = m.devicesPerNode();
  const int64_t kInf = INT64_MAX / 4;
  std::vector<int64_t> best(n_hi + 1, kInf);
  auto M = [&](int n) { return sinew::pipeline::templateMicrobatches(B, n, N); };
  for (size_t w = 0; w < m.widths().size(); ++w) {
    const int per_node = G / m.widths()[w];
    std::vector<int64_t> candidates;
    for (int i = 0; i < L; ++i) {
      for (int j = i + 1; j <= L; ++j) candidates.push_back(m.computeTicks(i, j, w));
    }
    std::sort(candidates.rbegin(), candidates.rend());
    candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
    for (int n = n_lo; n <= n_hi; ++n) {
      for (int S = (n - 1) * per_node + 1; S <= std::min(n * per_node, L); ++S) {
        std::vector<int64_t> prev(L + 1), cur(L + 1);
        for (int64_t T : candidates) {
          std::fill(prev.begin(), prev.end(), kInf);
          prev[L] = 0;
          for (int k = 1; k <= S; ++k) {
            std::fill(cur.begin(), cur.end(), kInf);
            for (int i = 0; i < L; ++i) {
              for (int j = i + 1; j <= L; ++j) {
                if (prev[j] >= kInf || m.computeTicks(i, j, w) > T || !m.fits(i, j, w, k)) continue;
                cur[i] = std::min(cur[i], m.fillTicks(i, j, w) + prev[j]);
              }
            }
            std::swap(prev, cur);
          }
          if (prev[0] >= kInf) break;  // lower bounds only make it worse
          best[n] = std::min(best[n], prev[0] + (M(n) - 1) * T);
        }
      }
    }
  }
  // Mixed: widths are the divisors of G = 8, a chain.
  std::vector<int64_t> candidates;
  for (size_t w = 0; w < m.widths().size(); ++w) {
    for (int i = 0; i < L; ++i) {
      for (int j = i + 1; j <= L; ++j) candidates.push_back(m.computeTicks(i, j, w));
    }
  }
  std::sort(candidates.rbegin(), candidates.rend());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  const int Wmax = n_hi * G;
  // V[k][i][W], k = 0..L, i = 0..L, W = 0..Wmax.
  auto at = [&](int k, int i, int W) {
    return (static_cast<size_t>(k) * (L + 1) + i) * (Wmax + 1) + W;
  };
  std::vector<int64_t> V(static_cast<size_t>(L + 1) * (L + 1) * (Wmax + 1));
  for (int64_t T : candidates) {
    std::fill(V.begin(), V.end(), kInf);
    V[at(0, L, 0)] = 0;
    bool any = false;
    for (int k = 1; k <= L; ++k) {
      for (int i = 0; i < L; ++i) {
        for (size_t w = 0; w < m.widths().size(); ++w) {
          const int d = m.widths()[w];
          for (int j = i + 1; j <= L; ++j) {
            if (m.computeTicks(i, j, w) > T || !m.fits(i, j, w, k)) continue;
            const int64_t c = m.fillTicks(i, j, w);
            for (int W = 0; W + d <= Wmax; ++W) {
              const int64_t rest = V[at(k - 1, j, W)];
              if (rest < kInf) V[at(k, i, W + d)] = std::min(V[at(k, i, W + d)], c + rest);
            }
          }
        }
      }
    }
    for (int n = n_lo; n <= n_hi; ++n) {
      int64_t least = kInf;
      for (int S = n; S <= L; ++S) {
        for (int W = 0; W <= n * G; ++W) least = std::min(least, V[at(S, 0, W)]);
      }
      if (least < kInf) {
        any = true;
        best[n] = std::min(best[n], least + (M(n) - 1) * T);
      }
    }
    if (!any) break;  // lower bounds only make it worse
  }
  return best;
}

}  // namespace

struct LossTimes {
  double makePlanMs = 0, reconfigureMs = 0, copiesMs = 0, toJsonMs = 0, fromJsonMs = 0;
  size_t copies = 0;
  size_t jsonBytes = 0;
  std::string kind;
  bool ok = true;
};

// Binds every worker of a plan made from templates to node * G + device.
void bindWorkers(Plan& plan, int G) {
  for (auto& w : plan.workers) w.worker = w.node * G + w.device;
}

LossTimes timeLoss(const TemplateSet& set, const Profile& p, int N, int G, int f, int64_t B) {
  LossTimes t;
  std::vector<int> ids(N);
  for (int i = 0; i < N; ++i) ids[i] = i;
  auto t0 = std::chrono::steady_clock::now();
  Plan plan = sinew::pipeline::makePlan(set, ids, {f, B});
  t.makePlanMs = msSince(t0);
  bindWorkers(plan, G);
  const auto& first = plan.pipelines.front().nodeIds;
  const int lost = first[first.size() / 2];

  t0 = std::chrono::steady_clock::now();
  sinew::pipeline::Reconfiguration r = sinew::pipeline::reconfigure(set, plan, {lost});
  t.reconfigureMs = msSince(t0);
  t.kind = sinew::pipeline::reconfigurationKindName(r.kind);
  bindWorkers(r.plan, G);

  // The survivors' live layers under the old plan, in increasing worker id order.
  const int L = static_cast<int>(p.layers.size());
  std::vector<std::vector<int>> live(L);
  std::vector<const sinew::pipeline::WorkerAssignment*> byWorker(static_cast<size_t>(N) * G);
  for (const auto& w : plan.workers) byWorker[w.worker] = &w;
  for (const auto* w : byWorker) {
    if (w == nullptr || w->node == lost) continue;
    for (int l = w->firstLayer; l < w->endLayer; ++l) live[l].push_back(w->worker);
  }
  std::vector<int64_t> bytes(L);
  for (int l = 0; l < L; ++l) bytes[l] = sinew::pipeline::copyBytes(p.layers[l]);
  t0 = std::chrono::steady_clock::now();
  t.copies = sinew::pipeline::liveLayerCopies(r.plan, live, bytes).size();
  t.copiesMs = msSince(t0);

  t0 = std::chrono::steady_clock::now();
  const std::string json = sinew::pipeline::planToJson(r.plan);
  t.toJsonMs = msSince(t0);
  t.jsonBytes = json.size();
  t0 = std::chrono::steady_clock::now();
  Plan parsed = sinew::pipeline::planFromJson(json);
  t.fromJsonMs = msSince(t0);
  t.ok = parsed.workers.size() == r.plan.workers.size() &&
         parsed.pipelines.size() == r.plan.pipelines.size();
  return t;
}

int main(int argc, char** argv) {
  struct Case {
    int L, N, G;
  };
  const Case cases[] = {{32, 32, 8}, {96, 64, 8}, {1000, 1024, 8}};
  const int f = 1;
  std::printf("%-18s %6s %6s %10s %12s %12s %12s\n", "case (L,N,G)", "n_min", "n_max", "templates",
              "templates_ms", "instance_ms", "plan_ms");
  std::string result = "RESULT";
  std::string loss_kv;
  bool ok = true;
  for (const Case& c : cases) {
    Profile p = sinew::pipeline::syntheticProfile(c.L, c.G, 42);
    const int64_t B = 4 * static_cast<int64_t>(c.N);
    auto t0 = std::chrono::steady_clock::now();
    TemplateSet set = sinew::pipeline::planTemplates(p, {c.N, f, B});
    double templates_ms = msSince(t0);
    auto t1 = std::chrono::steady_clock::now();
    Instantiation inst = sinew::pipeline::instantiate(set, c.N, {f, B});
    double instance_ms = msSince(t1);
    double total_ms = msSince(t0);
    char name[64];
    std::snprintf(name, sizeof(name), "(%d,%d,%d)", c.L, c.N, c.G);
    int mixed = 0;
    for (const auto& t : set.templates) mixed += t.stage_devices == 0;
    std::printf(
        "%-18s %6d %6d %10zu %12.1f %12.1f %12.1f   %zu pipelines, makespan %.3f ms, "
        "%d mixed-width templates%s\n",
        name, set.min_nodes, set.max_nodes, set.templates.size(), templates_ms, instance_ms,
        total_ms, inst.pipelines.size(), static_cast<double>(inst.iteration_ticks) / c.G / 1e6,
        mixed, set.mixed_widths ? "" : " (mixed widths not searched: table over 2^23 entries)");
    std::fflush(stdout);
    char kv[96];
    std::snprintf(kv, sizeof(kv), " plan_ms_%d_%d_%d=%.1f", c.L, c.N, c.G, total_ms);
    result += kv;
    const LossTimes lt = timeLoss(set, p, c.N, c.G, f, B);
    const double loss_ms = lt.reconfigureMs + lt.copiesMs + lt.fromJsonMs;
    std::printf(
        "%-18s a node's loss: makePlan %.1f ms; reconfigure %.1f ms (%s), %zu layer copies "
        "%.1f ms, plan JSON %.1f KiB: to %.1f ms, from %.1f ms; loss_ms %.1f%s\n",
        name, lt.makePlanMs, lt.reconfigureMs, lt.kind.c_str(), lt.copies, lt.copiesMs,
        static_cast<double>(lt.jsonBytes) / 1024.0, lt.toJsonMs, lt.fromJsonMs, loss_ms,
        lt.ok ? "" : " (the parsed plan DIFFERS)");
    ok = ok && lt.ok;
    if (c.L == 1000) {
      loss_kv = "";
      char lk[128];
      std::snprintf(lk, sizeof(lk), " loss_ms_%d_%d_%d=%.1f plan_json_kib_%d_%d_%d=%.0f", c.L, c.N,
                    c.G, loss_ms, c.L, c.N, c.G, static_cast<double>(lt.jsonBytes) / 1024.0);
      loss_kv = lk;
    }
    if (c.L == 32) {
      CostModel model(p);
      auto tb = std::chrono::steady_clock::now();
      std::vector<int64_t> base = baselineTemplates(model, set.min_nodes, set.max_nodes, B, c.N);
      size_t found = 0;
      for (int n = set.min_nodes; n <= set.max_nodes; ++n) {
        const sinew::pipeline::PipelineTemplate* t = set.find(n);
        const int64_t planned = t == nullptr ? INT64_MAX / 4 : t->iterationTicks(t->microbatches);
        found += t != nullptr;
        if (base[n] != planned) {
          std::printf("MISMATCH n=%d: planner %lld, baseline %lld\n", n,
                      static_cast<long long>(planned), static_cast<long long>(base[n]));
          ok = false;
        }
      }
      std::printf(
          "%-18s baseline (plain exact search) templates_ms %.1f, same costs for all %zu: %s\n",
          name, msSince(tb), found, ok ? "yes" : "NO");
    }
  }
  std::printf("%s%s\n", result.c_str(), loss_kv.c_str());
  return ok ? 0 : 1;
}
