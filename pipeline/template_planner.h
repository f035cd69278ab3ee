#pragma once

// Pipeline templates (docs/architecture.md section 4, after Oobleck): for every node count n the
// job may give one pipeline, the best way to run the model on n nodes, exact under the cost model
// of sinew/pipeline/cost_model.h. docs/planner.md states the model, the algorithm and the proof
// that it is exact.
//
// A template on n nodes is S contiguous, non-empty layer ranges (stages), each on d_s devices
// of one node (d_s divides devices_per_node G), every one of the n nodes holding at least one
// stage; devices may stay idle. Two families are searched (docs/planner.md):
//   - uniform: every stage has the same width d, any divisor of G, and
//     (n - 1) * G / d < S <= n * G / d; node i holds stages i*G/d .. (i+1)*G/d - 1;
//   - mixed: each stage's width from the chain 1 = c_0 | c_1 | ... of divisors of G (all of them
//     when G is a prime power, e.g. 1, 2, 4, 8), with S >= n and sum of widths <= n * G, so that
//     a node may hold stages of different widths. Searched when its table has at most 2^23
//     entries (TemplateSet::mixed_widths).
// Among all candidates whose stages fit in memory, the template minimises the 1F1B iteration
// time for M_n microbatches, the pipeline's share of the global batch (TemplateOptions); a
// mixed template is kept only where it is strictly faster than every uniform one.
//
// Thread safety: planTemplates() is a pure function; results are plain values.

#include <cstdint>
#include <string>
#include <vector>

#include "sinew/pipeline/cost_model.h"
#include "sinew/pipeline/profile.h"

namespace sinew {
namespace pipeline {

// One stage of a template.
struct StageAssignment {
  int first_layer = 0;  // layers [first_layer, end_layer)
  int end_layer = 0;
  int node = 0;               // index of the node within the pipeline, 0-based
  int first_device = 0;       // devices [first_device, first_device + devices) of that node
  int devices = 0;            // the stage's width d_s
  int64_t compute_ticks = 0;  // forward + backward of one microbatch
  int64_t fill_ticks = 0;     // compute + in-node allreduce + transfer to the next stage
  int64_t memory_bytes = 0;   // per device, at this stage's 1F1B in-flight count
};

struct PipelineTemplate {
  int nodes = 0;
  int stage_devices = 0;     // every stage's width if they share one, else 0
  int64_t microbatches = 0;  // M_n the template was optimised for
  std::vector<StageAssignment> stages;
  int64_t fill_ticks = 0;        // sum of the stages' fill ticks
  int64_t bottleneck_ticks = 0;  // max of the stages' compute ticks

  // 1F1B iteration time for b microbatches: 0 for b = 0, else
  // fill_ticks + (b - 1) * bottleneck_ticks. REQUIRES: b >= 0 and no int64 overflow
  // (guaranteed for b <= the global_microbatches the templates were planned for).
  int64_t iterationTicks(int64_t b) const {
    return b <= 0 ? 0 : fill_ticks + (b - 1) * bottleneck_ticks;
  }
};

struct TemplateOptions {
  // N: the nodes the job starts with. >= 1.
  int nodes = 1;
  // f: pipelines that may be lost without losing the model; the job runs >= f + 1 pipelines,
  // so templates go up to n_max = N - f * n_min nodes. >= 0.
  int fault_tolerance = 0;
  // B: microbatches in one global batch. >= 1. The template for n nodes is optimised for
  // M_n = max(1, round(B * n / N)) microbatches, the share a pipeline of n nodes gets when the
  // batch is split in proportion to nodes.
  int64_t global_microbatches = 1;
  // The most nodes the job may grow to by joins (0: N). Templates go up to
  // n_max = min(max(N, max_nodes) - f * n_min, L), so that a joined node gets a stage; the
  // templates of counts up to N - f * n_min, and n_min, do not depend on it (where the
  // mixed-width table for max_nodes would exceed its limit but N's fits, the growth is cut to
  // the most nodes whose table fits).
  int max_nodes = 0;
};

struct TemplateSet {
  int devices_per_node = 0;
  int num_layers = 0;
  // Whether mixed-width templates were searched (G has more than one chain width and the
  // table fits 2^23 entries); if not, every template is uniform.
  bool mixed_widths = false;
  // n_min: the fewest nodes on which some template fits in memory.
  int min_nodes = 0;
  // n_max = min(max(N, max_nodes) - f * n_min, L): above L nodes a pipeline would need more
  // stages than layers.
  int max_nodes = 0;
  // One template per node count in [min_nodes, max_nodes] that has a feasible template
  // (memory can make a count infeasible, e.g. a deep pipeline's first stage keeping too many
  // microbatches), in increasing order of nodes.
  std::vector<PipelineTemplate> templates;

  // The template for n nodes, or nullptr if there is none.
  const PipelineTemplate* find(int nodes) const;
};

// Plans every template. Throws sinew::InvalidArgument if the options are out of range, if no
// template fits on up to N - f nodes, if (f + 1) * n_min > N ("fault tolerance too large"), or
// if B * (max fill ticks) could overflow int64.
//
// Cost (docs/planner.md, "Complexity"): O(sum over widths d of K_d * L * w) for the bottleneck
// tables (K_d = min(L, (N - f) * G / d) stage counts, w the stage ends scanned per state, at most
// L), plus, per (n, d, S), r banded least-fill DPs of O(L * band) each, r the bottleneck bounds
// the exact search visits; O(L * K_d) memory per width. Mixed widths: per bound visited, one
// run of a table of at most 2^23 entries (64 MiB), O(entries * |chain| * w).
TemplateSet planTemplates(const Profile& profile, const TemplateOptions& options);

// Why `set` (planned from profile and options) has no template on n nodes, in one sentence
// naming the limit (memory, layers, fault tolerance); "" if it has one.
std::string explainNoTemplate(const Profile& profile, const TemplateSet& set,
                              const TemplateOptions& options, int n);

// Microbatches the template for n nodes is optimised for: max(1, round(B * n / N)).
int64_t templateMicrobatches(int64_t global_microbatches, int nodes, int total_nodes);

}  // namespace pipeline
}  // namespace sinew
