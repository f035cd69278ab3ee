// Sinew's own job model (sim/simulator.h, docs/goodput.md "Sinew's model"): the planner's
// plans on the live nodes, layer copies by bytes, Gemini placement for rollbacks, joins at the
// next step boundary.

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "sinew/base/error.h"
#include "sinew/checkpoint/placement.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/reconfiguration.h"
#include "sinew/pipeline/template_planner.h"
#include "sinew/sim/ledger.h"
#include "sinew/sim/simulator.h"
#include "sinew/sim/trace_replay.h"

namespace sinew {
namespace sim {

namespace {

using pipeline::Plan;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The nodes of a plan that hold layers (idle nodes excluded), in plan order.
std::vector<int> busyNodes(const Plan& plan) {
  std::vector<int> nodes;
  for (const auto& p : plan.pipelines)
    nodes.insert(nodes.end(), p.nodeIds.begin(), p.nodeIds.end());
  return nodes;
}

std::vector<int> allNodes(const Plan& plan) {
  std::vector<int> nodes = busyNodes(plan);
  nodes.insert(nodes.end(), plan.idleNodeIds.begin(), plan.idleNodeIds.end());
  return nodes;
}

class SinewRun {
 public:
  SinewRun(const SinewJobModel& job, const ReplayStart& start)
      : job_(job), c_(job.costs), G_(job.profile.job.devices_per_node) {
    if (job.global_microbatches < 1) {
      SINEW_THROW(InvalidArgument, "sinew model: global_microbatches = ", job.global_microbatches,
                  " must be >= 1");
    }
    if (job.profile.microbatch_size < 1) {
      SINEW_THROW(InvalidArgument, "sinew model: the profile's microbatch_size must be >= 1");
    }
    samplesPerStep_ = static_cast<double>(job.global_microbatches * job.profile.microbatch_size);
    pipeline::TemplateOptions to;
    to.nodes = start.initial_nodes;
    to.fault_tolerance = job.fault_tolerance;
    to.global_microbatches = job.global_microbatches;
    to.max_nodes = std::max(start.initial_nodes, start.peak_nodes);
    templates_ = pipeline::planTemplates(job.profile, to);
    for (const auto& l : job.profile.layers) layerBytes_.push_back(pipeline::copyBytes(l));
  }

  int minNodes() const { return templates_.min_nodes; }

  // Samples per second of the plan Sinew makes on n nodes; 0 if it makes none.
  double throughputOn(int n) {
    if (n < templates_.min_nodes) return 0;
    auto it = throughput_.find(n);
    if (it != throughput_.end()) return it->second;
    std::vector<int> ids(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = i;
    double x = 0;
    try {
      x = samplesPerStep_ / stepSeconds(makePlan(ids));
    } catch (const InvalidArgument&) {
      x = 0;  // a gap in the template sizes
    }
    throughput_[n] = x;
    return x;
  }

  SimResult run(const std::vector<TraceEvent>& trace, const SimOptions& options);

 private:
  enum class Mode { kTraining, kRecovering, kDown };

  // makePlanLoweringFaultTolerance(nodes): the plan for ids 0..n-1, made once per n, with its
  // ids renamed (makePlan gives the nodes to the pipelines in the order given, so the plan of
  // any n nodes is that of 0..n-1 renamed).
  Plan makePlan(const std::vector<int>& nodes) {
    const int n = static_cast<int>(nodes.size());
    auto it = plans_.find(n);
    if (it == plans_.end()) {
      std::vector<int> ids(nodes.size());
      for (int i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = i;
      pipeline::PlanOptions po;
      po.fault_tolerance = job_.fault_tolerance;
      po.global_microbatches = job_.global_microbatches;
      it = plans_.emplace(n, pipeline::makePlanLoweringFaultTolerance(templates_, ids, po)).first;
    }
    Plan p = it->second;
    for (auto& pp : p.pipelines) {
      for (int& id : pp.nodeIds) id = nodes[static_cast<size_t>(id)];
    }
    for (int& id : p.idleNodeIds) id = nodes[static_cast<size_t>(id)];
    for (auto& w : p.workers) w.node = nodes[static_cast<size_t>(w.node)];
    return bind(std::move(p));
  }
  // Worker ids node * G + device, as a launcher of G workers a node numbers them.
  Plan bind(Plan p) const {
    for (auto& w : p.workers) w.worker = w.node * G_ + w.device;
    return p;
  }
  double stepSeconds(const Plan& p) const {
    if (job_.table) {
      const double x = job_.table->at(static_cast<int>(busyNodes(p).size()));
      if (x <= 0) {
        SINEW_THROW(InvalidArgument, "sinew model: the throughput table has no entry for ",
                    busyNodes(p).size(), " nodes or fewer");
      }
      return samplesPerStep_ / x;
    }
    const double s = static_cast<double>(p.iterationTicks) / (static_cast<double>(G_) * 1e9);
    if (!(s > 0)) {
      SINEW_THROW(InvalidArgument,
                  "sinew model: the profile gives a step time of 0 (its layers "
                  "take no time)");
    }
    return s;
  }

  void advance(double T);
  void onEvents(const std::vector<int>& added, const std::vector<int>& removed, double te);
  void startRecovery();
  void startJoin();
  void finishPhases();
  void fail();
  void tryRestart();
  bool inNext(int node) const {
    const std::vector<int> nodes = allNodes(next_);
    return std::find(nodes.begin(), nodes.end(), node) != nodes.end();
  }
  void repend();
  void noteVersions();
  bool ramVersionRestorable() const;
  double copySeconds(const Plan& next, const std::set<int>& lost) const;
  double recoveryEnd() const {
    double end = t_;
    for (const auto& p : phases_) end += p.second;
    return end;
  }
  // Committed steps of the newest durable version at or before `committed` - 1.
  int64_t durableBase() const {
    if (c_.durable_every <= 0) return 0;
    const int64_t last = std::max<int64_t>(0, ledger_.committed() - 1);
    return last / c_.durable_every * c_.durable_every;
  }

  const SinewJobModel& job_;
  const SinewCosts& c_;
  const int G_;
  double samplesPerStep_ = 0;
  pipeline::TemplateSet templates_;
  std::vector<int64_t> layerBytes_;
  std::map<int, double> throughput_;
  std::map<int, Plan> plans_;  // makePlan's plan for ids 0..n-1, by n

  Ledger ledger_;
  SimResult r_;
  Mode mode_ = Mode::kDown;
  double t_ = 0;          // the ledger is written up to here (a step boundary while training)
  std::set<int> live_;    // nodes present
  bool started_ = false;  // the job has started once
  bool trained_ = false;  // plan_ has trained (its workers hold live layers)
  Plan plan_;             // the plan trained in: the live holders
  double stepS_ = 0;
  int64_t planStart_ = 0;                         // committed steps when plan_ began
  std::set<int> lost_;                            // plan_'s nodes lost since it began
  std::set<int> pending_;                         // present, not in plan_
  std::vector<std::pair<Cause, double>> phases_;  // the recovery's remaining pauses
  Plan next_;                                     // the plan the recovery ends in
  bool joining_ = false;                          // the recovery is a join
  double joinAt_ = -1;                            // a join at this step boundary
  int64_t ramCount_ = 0;  // the peer-RAM version (committed steps it holds); 0: none
  std::vector<pipeline::WorkerAssignment> ramWorkers_;  // its workers, in placement order
  std::set<int> ramDead_;
};

void SinewRun::noteVersions() {
  if (c_.peer_every <= 0) return;
  // The version after step v commits once step v + 1 has (its replicas travel meanwhile).
  const int64_t last = ledger_.committed() - 1;
  if (last < 1) return;
  const int64_t count = last / c_.peer_every * c_.peer_every;
  if (count > ramCount_ && count > planStart_) {
    ramCount_ = count;
    ramDead_.clear();
    // The runtime's placement order: the workers that hold layers, by pipeline, stage, worker
    // (runtime/peer_versions.cc), so that a group holds different layers.
    ramWorkers_.clear();
    for (const auto& w : plan_.workers) {
      if (w.endLayer > w.firstLayer) ramWorkers_.push_back(w);
    }
    std::sort(ramWorkers_.begin(), ramWorkers_.end(), [](const auto& a, const auto& b) {
      return std::tie(a.pipeline, a.stage, a.worker) < std::tie(b.pipeline, b.stage, b.worker);
    });
  }
}

// Whether every layer of the peer-RAM version can still be restored: some worker that held it
// in the version's plan has a holder of its shard, in Gemini's placement over those workers,
// on a node not lost since (the rule of the runtime's rollback target, runtime/peer_versions.cc:
// a shard whose every holder died does not matter while another pipeline's shard of the same
// layer survives). Layers without state need nothing.
bool SinewRun::ramVersionRestorable() const {
  if (ramCount_ <= 0) return false;
  std::vector<int> order;
  std::map<int, int> nodeOf;
  for (const auto& w : ramWorkers_) {
    order.push_back(w.worker);
    nodeOf[w.worker] = w.node;
  }
  const checkpoint::ReplicaPlacement placement(order, c_.replication);
  std::vector<bool> covered(layerBytes_.size(), false);
  for (const auto& w : ramWorkers_) {
    const auto& holders = placement.holders(w.worker);
    if (std::none_of(holders.begin(), holders.end(),
                     [&](int h) { return ramDead_.count(nodeOf.at(h)) == 0; })) {
      continue;
    }
    for (int l = w.firstLayer; l < w.endLayer; ++l) covered[static_cast<size_t>(l)] = true;
  }
  for (size_t l = 0; l < covered.size(); ++l) {
    if (!covered[l] && layerBytes_[l] > 0) return false;
  }
  return true;
}

void SinewRun::advance(double T) {
  while (t_ < T) {
    if (mode_ == Mode::kDown) {
      ledger_.spend(t_, T - t_, Cause::kIdle);
      t_ = T;
      return;
    }
    if (mode_ == Mode::kRecovering) {
      if (phases_.empty()) return;
      auto& [cause, left] = phases_.front();
      const double d = std::min(left, T - t_);
      ledger_.spend(t_, d, cause);
      t_ += d;
      left -= d;
      if (left <= 1e-12) phases_.erase(phases_.begin());
      if (phases_.empty()) return;  // the caller finishes the recovery at t_
      continue;
    }
    const int64_t n = static_cast<int64_t>(std::floor((T - t_) / stepS_ + 1e-9));
    if (n <= 0) return;  // the step in flight ends after T
    ledger_.steps(t_, stepS_, n, samplesPerStep_);
    t_ += static_cast<double>(n) * stepS_;
    noteVersions();
    return;
  }
}

double SinewRun::copySeconds(const Plan& next, const std::set<int>& lost) const {
  std::vector<std::vector<int>> live(layerBytes_.size());
  if (trained_) {
    for (const auto& w : plan_.workers) {
      if (lost.count(w.node)) continue;
      for (int l = w.firstLayer; l < w.endLayer; ++l)
        live[static_cast<size_t>(l)].push_back(w.worker);
    }
    for (auto& holders : live) std::sort(holders.begin(), holders.end());
  }
  std::map<int, double> traffic;  // bytes each worker sends or receives
  for (const auto& copy : pipeline::liveLayerCopies(next, live, layerBytes_)) {
    const double bytes = static_cast<double>(layerBytes_[static_cast<size_t>(copy.layer)]);
    traffic[copy.from] += bytes;
    traffic[copy.to] += bytes;
  }
  double most = 0;
  for (const auto& [w, bytes] : traffic) most = std::max(most, bytes);
  return most * 8.0 / (c_.copy_gbps * 1e9);
}

void SinewRun::fail() {
  // Too few nodes for the model: the job ends, its RAM with it, and starts again from disk
  // once enough nodes are there.
  ledger_.undo(ledger_.committed() - durableBase(), Cause::kRestart);
  ++r_.restarts;
  ramCount_ = 0;
  ramWorkers_.clear();
  ramDead_.clear();
  trained_ = false;
  lost_.clear();
  mode_ = Mode::kDown;
  tryRestart();
}

void SinewRun::tryRestart() {
  joining_ = false;
  joinAt_ = -1;
  phases_.clear();
  pending_.clear();
  if (static_cast<int>(live_.size()) < minNodes()) {
    mode_ = Mode::kDown;
    return;
  }
  next_ = makePlan(std::vector<int>(live_.begin(), live_.end()));
  mode_ = Mode::kRecovering;
  if (!started_) {
    // The job's first start costs nothing: the ideal job starts then too.
    started_ = true;
    finishPhases();
    return;
  }
  phases_ = {{Cause::kRestart, c_.restart_s}};
}

void SinewRun::startRecovery() {
  joining_ = false;
  // A recovery this loss interrupts may have taken joiners into the plan it was forming: those
  // still there wait again like any joiner (before, they were counted nowhere, and a burst of
  // losses ended the job while the real one trained on: scripts/churn on the P3 trace).
  if (mode_ == Mode::kRecovering) {
    const std::vector<int> mine = allNodes(plan_);
    for (int n : allNodes(next_)) {
      if (live_.count(n) && std::find(mine.begin(), mine.end(), n) == mine.end()) {
        pending_.insert(n);
      }
    }
  }
  std::vector<int> survivors;
  for (int n : allNodes(plan_)) {
    if (!lost_.count(n)) survivors.push_back(n);
  }
  if (static_cast<int>(survivors.size() + pending_.size()) < minNodes()) return fail();
  bool orphan = false;
  for (size_t l = 0; l < layerBytes_.size() && !orphan; ++l) {
    bool held = false;
    for (const auto& w : plan_.workers) {
      held = held || (w.firstLayer <= static_cast<int>(l) && static_cast<int>(l) < w.endLayer &&
                      !lost_.count(w.node));
    }
    orphan = !held;
  }
  if (static_cast<int>(survivors.size()) >= minNodes()) {
    next_ =
        bind(pipeline::reconfigure(templates_, plan_, std::vector<int>(lost_.begin(), lost_.end()))
                 .plan);
  } else {
    // The survivors alone cannot hold the model; the nodes that joined meanwhile make up.
    std::vector<int> nodes = survivors;
    nodes.insert(nodes.end(), pending_.begin(), pending_.end());
    next_ = makePlan(nodes);
    for (int n : nodes) pending_.erase(n);
  }
  phases_ = {{Cause::kDetection, c_.detection_s}};
  if (!orphan) {
    phases_.push_back({Cause::kReconfiguration, c_.epoch_s + copySeconds(next_, lost_)});
  } else if (ramVersionRestorable()) {
    ledger_.undo(ledger_.committed() - ramCount_, Cause::kRollback);
    ++r_.rollbacks;
    phases_.push_back({Cause::kReconfiguration, c_.epoch_s});
    phases_.push_back({Cause::kRollback, c_.ram_restore_s});
  } else {
    ledger_.undo(ledger_.committed() - durableBase(), Cause::kRestart);
    ++r_.restarts;
    phases_.push_back({Cause::kReconfiguration, c_.epoch_s});
    phases_.push_back({Cause::kRestart, c_.disk_restore_s});
  }
  mode_ = Mode::kRecovering;
}

void SinewRun::startJoin() {
  std::vector<int> nodes = allNodes(plan_);
  nodes.insert(nodes.end(), pending_.begin(), pending_.end());
  next_ = makePlan(nodes);
  r_.joins += static_cast<int>(pending_.size());
  pending_.clear();
  joining_ = true;
  phases_ = {{Cause::kReconfiguration, c_.epoch_s + copySeconds(next_, {})}};
  mode_ = Mode::kRecovering;
  joinAt_ = -1;
}

void SinewRun::finishPhases() {
  plan_ = next_;
  trained_ = true;
  lost_.clear();
  planStart_ = ledger_.committed();
  stepS_ = stepSeconds(plan_);
  mode_ = Mode::kTraining;
  joining_ = false;
  if (!pending_.empty()) startJoin();  // at this step boundary
}

void SinewRun::repend() {
  // A join that did not finish: its nodes that are still there wait for the next boundary.
  const std::vector<int> mine = allNodes(plan_);
  for (int n : allNodes(next_)) {
    if (live_.count(n) && std::find(mine.begin(), mine.end(), n) == mine.end() &&
        pending_.insert(n).second) {
      --r_.joins;
    }
  }
  joining_ = false;
}

void SinewRun::onEvents(const std::vector<int>& added, const std::vector<int>& removed, double te) {
  std::vector<int> lostNow;
  bool nextHit = false;  // a node of the plan being formed is gone
  const std::vector<int> busy = trained_ ? busyNodes(plan_) : std::vector<int>();
  for (int n : removed) {
    live_.erase(n);
    pending_.erase(n);
    nextHit = nextHit || (mode_ == Mode::kRecovering && inNext(n));
    if (!trained_) continue;
    auto idle = std::find(plan_.idleNodeIds.begin(), plan_.idleNodeIds.end(), n);
    if (idle != plan_.idleNodeIds.end()) {
      plan_.idleNodeIds.erase(idle);  // it held nothing
      continue;
    }
    if (std::find(busy.begin(), busy.end(), n) != busy.end()) lostNow.push_back(n);
    ramDead_.insert(n);  // lost since the peer-RAM version (only its workers' nodes matter)
  }
  for (int n : added) {
    live_.insert(n);
    pending_.insert(n);
  }
  if (mode_ == Mode::kDown) return tryRestart();
  if (mode_ == Mode::kRecovering && !trained_) {
    if (nextHit) tryRestart();  // a restart from disk begins again on the nodes there now
    return;
  }
  if (mode_ == Mode::kRecovering && joining_ && (nextHit || !lostNow.empty())) {
    repend();
    if (lostNow.empty()) {
      if (pending_.empty()) {
        phases_.clear();  // every joiner left: train on as before
        mode_ = Mode::kTraining;
      } else {
        startJoin();  // the join again, without the node that left
      }
      return;
    }
  }
  if (!lostNow.empty() || (mode_ == Mode::kRecovering && nextHit)) {
    if (mode_ == Mode::kTraining) {
      ledger_.spend(t_, te - t_, Cause::kRedone);  // the step in flight
      t_ = te;
    }
    r_.losses += static_cast<int>(lostNow.size());
    lost_.insert(lostNow.begin(), lostNow.end());
    joinAt_ = -1;
    startRecovery();
    return;
  }
  if (!added.empty() && mode_ == Mode::kTraining && joinAt_ < 0) {
    joinAt_ = te - t_ < 1e-12 ? te : t_ + stepS_;  // the end of the step in flight
  }
}

SimResult SinewRun::run(const std::vector<TraceEvent>& trace, const SimOptions& options) {
  TraceReplay replay(trace, options);
  r_ = SimResult();
  std::vector<int> added, removed;
  double te = 0;
  const double end = replay.end();
  while (true) {
    te = replay.peek();
    double ti = kInf;
    if (mode_ == Mode::kRecovering) ti = recoveryEnd();
    if (mode_ == Mode::kTraining && joinAt_ >= 0) ti = joinAt_;
    if (ti <= te && ti < end) {
      advance(ti);
      if (mode_ == Mode::kRecovering) {
        finishPhases();
      } else {
        startJoin();
      }
      continue;
    }
    if (te >= end) break;
    advance(te);
    replay.next(&added, &removed);
    onEvents(added, removed, te);
  }
  advance(end);
  if (mode_ == Mode::kTraining && t_ < end) {
    ledger_.partialStep(t_, end - t_, (end - t_) / stepS_, samplesPerStep_);
  }
  SimResult result = ledger_.result("sinew", end, options.bucket_s);
  result.losses = r_.losses;
  result.joins = r_.joins;
  result.rollbacks = r_.rollbacks;
  result.restarts = r_.restarts;
  result.ideal_samples = replay.idealSamples([this](int n) { return throughputOn(n); });
  return result;
}

}  // namespace

SimResult simulateSinew(const std::vector<TraceEvent>& trace, const SinewJobModel& job,
                        const SimOptions& options) {
  SinewRun run(job, replayStart(trace));
  return run.run(trace, options);
}

ThroughputTable sinewThroughputTable(const SinewJobModel& job,
                                     const std::vector<TraceEvent>& trace) {
  const ReplayStart start = replayStart(trace);
  SinewRun run(job, start);
  ThroughputTable table;
  for (int n = 1; n <= start.peak_nodes; ++n) {
    const double x = run.throughputOn(n);
    if (x > 0) table.samples_per_s[n] = x;
  }
  return table;
}

}  // namespace sim
}  // namespace sinew
