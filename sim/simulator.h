#pragma once

// The failure-trace simulator behind sinew-sim (docs/goodput.md): replays a node trace (which
// nodes are there at each moment) against a model of a job and accounts for every second of
// wall time: training that stays committed, and what the rest went to (detection,
// reconfiguration, redone partial steps, steps undone by a rollback to a peer-RAM version,
// steps undone by a restore or a restart from disk, idling below the smallest runnable size,
// checkpoint pauses). Three job models:
//   - Sinew's own (simulateSinew): the planner's templates, instantiation and reconfiguration
//     for a layer profile, the step time from the cost model or a measured table, layer copies
//     by bytes, Gemini's group placement deciding whether a loss rolls back to peer RAM or to
//     disk, joins taken at the next step boundary;
//   - fixed cost (simulateFixedCost): a throughput table, a constant pause per lost node, the
//     step in flight lost, added nodes used only at the next loss (Oobleck's simulator);
//   - restart from checkpoint (simulateRestart): a checkpoint every K steps pausing C seconds,
//     a restart of R seconds on every loss, the work since the last checkpoint lost (a
//     Varuna- or torchrun-style job).
// docs/goodput.md states every rule. The simulation is deterministic: the same inputs give the
// same result bit for bit.
//
// Thread safety: pure functions over plain values.

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "sinew/pipeline/profile.h"

namespace sinew {
namespace sim {

// One line of a trace: at time_ms, node `node` is added (becomes available) or removed (lost).
struct TraceEvent {
  int64_t time_ms = 0;
  bool add = false;
  std::string node;
};

// Parses a trace: one "time_ms,add|remove,node" per line, times non-decreasing; blank lines and
// lines starting with '#' are skipped. An add of a node that is there, or a remove of one that is
// not, is an error. Throws InvalidArgument naming `source`, the line number and what is wrong.
std::vector<TraceEvent> parseTrace(const std::string& text, const std::string& source);
// parseTrace of a file's contents; IoError if it cannot be read.
std::vector<TraceEvent> loadTrace(const std::string& path);

// A trace drawn from a failure rate: `nodes` nodes at time 0, each failing after an
// exponentially distributed time with mean mtbf_s (a Poisson process per node), and coming back
// return_after_s after its failure (0: never), up to duration_s. Seeded and independent of the
// standard library's distributions, so a seed gives the same trace everywhere.
struct PoissonTraceOptions {
  int nodes = 1;
  double mtbf_s = 6 * 3600.0;
  double return_after_s = 0;
  double duration_s = 24 * 3600.0;
  uint64_t seed = 1;
};
std::vector<TraceEvent> poissonTrace(const PoissonTraceOptions& options);

// Samples per second by node count (measured, or computed from the cost model).
struct ThroughputTable {
  std::map<int, double> samples_per_s;
  // The most listed nodes that n live nodes can use (the largest listed count <= n); 0 if n is
  // below every listed count.
  int usedNodes(int n) const;
  // The throughput at usedNodes(n); 0 if that is 0.
  double at(int n) const;
};
// {"samples_per_s": {"8": 812.5, "16": 1590.0, ...}}: node counts in [1, 2^20], throughputs
// finite and > 0. Throws InvalidArgument naming `source` and the field.
ThroughputTable parseThroughputTable(const std::string& text, const std::string& source);

enum class Cause : int {
  kTraining = 0,     // steps that stayed committed
  kDetection,        // from a loss to the start of the recovery
  kReconfiguration,  // forming epochs and copying layers (losses and joins)
  kRedone,           // the partial steps a loss or a restart threw away
  kRollback,         // steps undone by a rollback to a peer-RAM version, and its restore
  kRestart,          // steps undone by a restore or restart from disk, and its time
  kIdle,             // the job waiting for nodes: fewer than its smallest runnable size
  kCheckpoint,       // training paused for a checkpoint (the restart model)
};
constexpr int kCauses = 8;
const char* causeName(Cause cause);  // "training", "detection", ...

struct Account {
  double samples = 0;  // committed samples
  std::array<double, kCauses> seconds{};
  double seconds_of(Cause c) const { return seconds[static_cast<int>(c)]; }
};

struct Bucket {
  double start_s = 0;
  double end_s = 0;
  Account account;
};

struct SimResult {
  std::string model;  // "sinew", "fixed-cost", "restart"
  double wall_s = 0;
  Account total;
  // The failure-free throughput at each moment's live node count, integrated over the run:
  // the samples an ideal job would have committed.
  double ideal_samples = 0;
  int losses = 0;                // trace removals of nodes the job was using
  int joins = 0;                 // additions the job took in
  int rollbacks = 0;             // rollbacks to a peer-RAM version
  int restarts = 0;              // restores from disk, in the job or by a restart
  std::vector<Bucket> timeline;  // consecutive buckets of SimOptions::bucket_s

  double goodput() const { return wall_s > 0 ? total.samples / wall_s : 0; }
  double effectiveShare() const {
    return wall_s > 0 ? total.seconds_of(Cause::kTraining) / wall_s : 0;
  }
  double goodputVsIdeal() const { return ideal_samples > 0 ? total.samples / ideal_samples : 0; }
};

struct SimOptions {
  // The run ends here; <= 0: at the trace's last event.
  double duration_s = 0;
  // Timeline buckets; <= 0: one bucket for the whole run.
  double bucket_s = 0;
};

// Costs of Sinew's recovery, measured on real jobs (docs/goodput.md says which benchmark gives
// each).
struct SinewCosts {
  double detection_s = 0.05;    // a loss noticed (closed connection) to the recovery's start
  double epoch_s = 0.25;        // forming an epoch: membership, communicators, plan
  double copy_gbps = 10.0;      // layer copies: per worker, sent plus received
  double ram_restore_s = 0.3;   // a rollback's restore from RAM, besides the steps redone
  double disk_restore_s = 5.0;  // a restore from the durable checkpoint inside the job
  double restart_s = 30.0;      // a job restarted from disk (launch, plan, load)
  int64_t peer_every = 1;       // steps between peer-RAM versions
  int64_t durable_every = 0;    // steps between durable versions; 0: none
  int replication = 2;          // m: each node's shard is in the RAM of m nodes
};
// Reads the JSON object of SinewCosts' fields (each optional; unknown fields are errors).
SinewCosts parseSinewCosts(const std::string& text, const std::string& source);

struct SinewJobModel {
  pipeline::Profile profile;
  int fault_tolerance = 1;          // f: the plans run >= f + 1 pipelines where they can
  int64_t global_microbatches = 1;  // B
  // The step time from this table (samples per second by nodes in use) instead of the cost
  // model's iteration time.
  std::optional<ThroughputTable> table;
  SinewCosts costs;
};

struct FixedCostModel {
  ThroughputTable table;
  double reconfiguration_s = 1.0;  // per lost node
  int64_t global_batch = 1;        // samples per step
};

struct RestartModel {
  ThroughputTable table;
  int64_t checkpoint_every = 100;  // K steps
  double checkpoint_s = 10.0;      // C
  double restart_s = 60.0;         // R
  int64_t global_batch = 1;        // samples per step
};

// Each throws InvalidArgument for an empty trace, a trace whose first events leave no node, or
// out-of-range model fields, naming them.
SimResult simulateSinew(const std::vector<TraceEvent>& trace, const SinewJobModel& job,
                        const SimOptions& options);
SimResult simulateFixedCost(const std::vector<TraceEvent>& trace, const FixedCostModel& model,
                            const SimOptions& options);
SimResult simulateRestart(const std::vector<TraceEvent>& trace, const RestartModel& model,
                          const SimOptions& options);

// The throughput Sinew's model gives on every node count from 1 to the most the trace has at
// once (the plan it makes there from the templates it plans for this trace, by the cost model
// or job.table): the table the reference models are compared on, and Sinew's ideal. Counts
// with no plan are left out.
ThroughputTable sinewThroughputTable(const SinewJobModel& job,
                                     const std::vector<TraceEvent>& trace);

}  // namespace sim
}  // namespace sinew
