// sinew-sim: replays node traces (or a failure rate) against Sinew's job model and the two
// reference models, and prints the goodput and where the rest of the wall time went
// (docs/goodput.md).
//
//   sinew-sim --trace FILE [--trace FILE ...] --profile P.json --microbatches B [options]
//   sinew-sim --nodes N --mtbf-hours H --hours D [--return-after-min M] [--seed S] ...
//   sinew-sim --cluster JOBS.json --pool N [--policy static|marginal|both] [--realloc-s R]
//             [--min-gain M]
//             [--grow-pause-s X] [--shrink-pause-s X] [--start-s X]
//
// The third form runs a job list on a pool of nodes under sinew-sched's allocation policies
// (sim/cluster.h, docs/scheduler.md).
//
// Exit status: 0 on success, 1 for an invalid input file or model (the message says which),
// 2 for bad command-line arguments.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/pipeline/profile.h"
#include "sinew/sim/cluster.h"
#include "sinew/sim/simulator.h"

namespace {

using nlohmann::json;
using namespace sinew::sim;

struct Args {
  std::vector<std::string> traces;
  std::string models = "sinew,fixed-cost,restart";
  std::string profile, costs, throughput, timeline;
  int64_t microbatches = 0, faultTolerance = 1, globalBatch = 0;
  int64_t nodes = 0, seed = 1;
  double mtbfHours = 0, hours = 0, returnAfterMin = 0;
  bool measuredStep = false, asJson = false;
  double reconfigurationS = -1, durationS = 0, bucketS = 0;
  int64_t checkpointEvery = 0;  // 0: Young's interval for the trace
  double checkpointS = 10, restartS = 60;
  // --cluster
  std::string cluster, policy = "both";
  int64_t pool = 0;
  double reallocS = 5, growPauseS = -1, shrinkPauseS = -1, startS = -1, minGain = 0.05;
};

[[noreturn]] void usageError(const std::string& what) {
  std::cerr << "sinew-sim: " << what << "\nRun with --help for the usage.\n";
  std::exit(2);
}

Args parseArgs(int argc, char** argv) {
  Args a;
  CLI::App app(
      "Replays node traces against Sinew's job model and two reference models and "
      "reports goodput and where the wall time went (docs/goodput.md).",
      "sinew-sim");
  app.add_option("--trace", a.traces, "node trace: time_ms,add|remove,node per line (repeatable)");
  app.add_option("--nodes", a.nodes, "with --mtbf-hours: nodes of a Poisson failure trace");
  app.add_option("--mtbf-hours", a.mtbfHours, "mean time between failures of one node");
  app.add_option("--hours", a.hours, "length of the Poisson trace");
  app.add_option("--return-after-min", a.returnAfterMin,
                 "a failed node comes back after this long (default 0: never)");
  app.add_option("--seed", a.seed, "seed of the Poisson trace (default 1)");
  app.add_option("--models", a.models, "comma-separated: sinew, fixed-cost, restart (default all)");
  app.add_option("--profile", a.profile, "layer profile (docs/profile_format.md): Sinew's model");
  app.add_option("--microbatches", a.microbatches, "B, microbatches per global batch");
  app.add_option("--fault-tolerance", a.faultTolerance, "f of Sinew's plans (default 1)");
  app.add_option("--costs", a.costs, "Sinew's measured costs, JSON (docs/goodput.md)");
  app.add_option("--throughput", a.throughput,
                 "samples/s by node count, JSON; default: Sinew's cost model for the profile");
  app.add_flag("--measured-step", a.measuredStep,
               "Sinew's model takes its step time from --throughput too");
  app.add_option("--global-batch", a.globalBatch,
                 "samples per step of the reference models (default: the profile's B x "
                 "microbatch_size)");
  app.add_option("--reconfiguration-s", a.reconfigurationS,
                 "fixed-cost pause per lost node (default: Sinew's detection + epoch)");
  app.add_option("--checkpoint-every", a.checkpointEvery,
                 "restart model: K steps (default 0: Young's interval sqrt(2 C M) for the "
                 "trace's mean time between losses M)");
  app.add_option("--checkpoint-s", a.checkpointS, "restart model: C seconds (default 10)");
  app.add_option("--restart-s", a.restartS, "restart model: R seconds (default 60)");
  app.add_option("--duration-s", a.durationS, "end of the run (default: the trace's last event)");
  app.add_option("--bucket-s", a.bucketS, "width of the timeline's buckets (default: none)");
  app.add_option("--timeline", a.timeline, "write the timeline as CSV to this file");
  app.add_flag("--json", a.asJson, "print JSON instead of tables");
  app.add_option("--cluster", a.cluster,
                 "a job list to run on --pool nodes under the scheduler's policies (JSON, "
                 "docs/scheduler.md)");
  app.add_option("--pool", a.pool, "with --cluster: nodes in the pool");
  app.add_option("--policy", a.policy, "with --cluster: static, marginal or both (default)")
      ->check(CLI::IsMember({"static", "marginal", "both"}));
  app.add_option("--realloc-s", a.reallocS, "with --cluster: reallocate at least this often (5)");
  app.add_option("--min-gain", a.minGain,
                 "with --cluster: the marginal policy keeps the sizes unless a new allocation "
                 "raises the summed rate of finishing by more than this share (0.05)");
  app.add_option("--grow-pause-s", a.growPauseS, "with --cluster: replaces costs.grow_pause_s");
  app.add_option("--shrink-pause-s", a.shrinkPauseS,
                 "with --cluster: replaces costs.shrink_pause_s");
  app.add_option("--start-s", a.startS, "with --cluster: replaces costs.start_s");
  app.footer(
      "The last line is RESULT sim_goodput_vs_fixed_cost=<r> sim_goodput_vs_restart=<r> "
      "for the last trace. Exit status: 0 on success, 1 for an invalid input, 2 for bad "
      "arguments.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) std::exit(app.exit(e));  // --help
    usageError(e.what());
  }
  if (!a.cluster.empty()) {
    if (a.pool < 1 || a.pool > (1 << 20)) usageError("--cluster needs --pool N, 1 <= N <= 2^20");
    if (!(a.reallocS > 0)) usageError("--realloc-s must be > 0");
    if (!(a.minGain >= 0)) usageError("--min-gain must be >= 0");
    return a;
  }
  const bool poisson = a.nodes > 0 || a.mtbfHours > 0 || a.hours > 0;
  if (a.traces.empty() && !poisson) usageError("give --trace FILE or --nodes/--mtbf-hours/--hours");
  if (poisson && !(a.nodes > 0 && a.mtbfHours > 0 && a.hours > 0)) {
    usageError("a Poisson trace needs --nodes, --mtbf-hours and --hours, each > 0");
  }
  if (a.profile.empty() && a.throughput.empty()) usageError("give --profile or --throughput");
  if (!a.profile.empty() && a.microbatches < 1) usageError("--microbatches B (>= 1) is required");
  if (a.measuredStep && a.throughput.empty()) usageError("--measured-step needs --throughput");
  return a;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw sinew::IoError("cannot read " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Named {
  std::string name;
  std::vector<TraceEvent> events;
};

std::vector<Named> traces(const Args& a) {
  std::vector<Named> out;
  for (const auto& path : a.traces) out.push_back({path, loadTrace(path)});
  if (a.nodes > 0) {
    PoissonTraceOptions o;
    o.nodes = static_cast<int>(a.nodes);
    o.mtbf_s = a.mtbfHours * 3600;
    o.duration_s = a.hours * 3600;
    o.return_after_s = a.returnAfterMin * 60;
    o.seed = static_cast<uint64_t>(a.seed);
    std::ostringstream name;
    name << "poisson(" << a.nodes << " nodes, mtbf " << a.mtbfHours << " h, seed " << a.seed << ")";
    out.push_back({name.str(), poissonTrace(o)});
  }
  return out;
}

json accountJson(const Account& acc) {
  json j = {{"samples", acc.samples}};
  for (int c = 0; c < kCauses; ++c)
    j[causeName(static_cast<Cause>(c)) + std::string("_s")] = acc.seconds[c];
  return j;
}

json resultJson(const SimResult& r) {
  return {{"model", r.model},
          {"wall_s", r.wall_s},
          {"goodput", r.goodput()},
          {"goodput_vs_ideal", r.goodputVsIdeal()},
          {"ettr", r.effectiveShare()},
          {"ideal_samples", r.ideal_samples},
          {"losses", r.losses},
          {"joins", r.joins},
          {"rollbacks", r.rollbacks},
          {"restarts", r.restarts},
          {"total", accountJson(r.total)}};
}

void printTable(const std::string& trace, const std::vector<TraceEvent>& events,
                const std::vector<SimResult>& results) {
  int removes = 0, adds = 0;
  for (const auto& e : events) (e.add ? adds : removes)++;
  std::printf("trace %s: %d adds, %d removes, %.2f h\n", trace.c_str(), adds, removes,
              results.empty() ? 0.0 : results[0].wall_s / 3600);
  std::printf("%-11s %11s %8s %6s", "model", "samples/s", "vs_ideal", "ettr");
  for (int c = 1; c < kCauses; ++c) std::printf(" %9.9s", causeName(static_cast<Cause>(c)));
  std::printf(" %6s %5s %5s %5s\n", "losses", "joins", "rollb", "rest");
  for (const SimResult& r : results) {
    std::printf("%-11s %11.2f %8.4f %6.4f", r.model.c_str(), r.goodput(), r.goodputVsIdeal(),
                r.effectiveShare());
    for (int c = 1; c < kCauses; ++c) std::printf(" %8.1fs", r.total.seconds[c]);
    std::printf(" %6d %5d %5d %5d\n", r.losses, r.joins, r.rollbacks, r.restarts);
  }
  std::printf("\n");
}

void writeTimeline(std::ofstream& out, const std::string& trace, const SimResult& r) {
  for (const Bucket& b : r.timeline) {
    const double width = b.end_s - b.start_s;
    out << trace << ',' << r.model << ',' << b.start_s << ',' << b.end_s << ','
        << (width > 0 ? b.account.samples / width : 0);
    for (int c = 0; c < kCauses; ++c) out << ',' << b.account.seconds[c];
    out << '\n';
  }
}

// Young's checkpoint interval sqrt(2 C M), C the checkpoint's cost and M the trace's mean time
// between losses, in steps at the starting size (at least 1).
int64_t youngInterval(const std::vector<TraceEvent>& events, const ThroughputTable& table,
                      const Args& a, int64_t batch) {
  int present = 0, removes = 0;
  for (const auto& e : events) {
    if (e.time_ms == events.front().time_ms) present += e.add ? 1 : -1;
    removes += e.add ? 0 : 1;
  }
  const double wall =
      a.durationS > 0 ? a.durationS : static_cast<double>(events.back().time_ms) / 1e3;
  const double mtbf = wall / std::max(1, removes);
  const double rate = table.at(present);
  if (rate <= 0) return 1;
  const double stepS = static_cast<double>(batch) / rate;
  return std::max<int64_t>(1, std::llround(std::sqrt(2 * a.checkpointS * mtbf) / stepS));
}

int runCluster(const Args& a) {
  ClusterInput in = parseClusterInput(slurp(a.cluster), a.cluster);
  if (a.growPauseS >= 0) in.costs.grow_pause_s = a.growPauseS;
  if (a.shrinkPauseS >= 0) in.costs.shrink_pause_s = a.shrinkPauseS;
  if (a.startS >= 0) in.costs.start_s = a.startS;
  std::vector<std::string> policies = {a.policy};
  if (a.policy == "both") policies = {"static", "marginal"};
  json all = json::array();
  std::map<std::string, ClusterResult> results;
  for (const std::string& p : policies) {
    ClusterOptions o;
    o.nodes = static_cast<int>(a.pool);
    o.policy = parseAllocationPolicy(p);
    o.realloc_s = a.reallocS;
    o.min_gain = a.minGain;
    const ClusterResult r = simulateCluster(in.jobs, in.costs, o);
    results[p] = r;
    json jobs = json::array();
    for (const ClusterJobResult& j : r.jobs) {
      jobs.push_back({{"name", j.name},
                      {"arrival_s", j.arrival_s},
                      {"started_s", j.started_s},
                      {"ended_s", j.ended_s},
                      {"jct_s", j.jct_s},
                      {"resizes", j.resizes},
                      {"paused_s", j.paused_s},
                      {"node_seconds", j.node_seconds}});
    }
    all.push_back({{"policy", p},
                   {"nodes", a.pool},
                   {"mean_jct_s", r.mean_jct_s},
                   {"makespan_s", r.makespan_s},
                   {"busy_share", r.busy_share},
                   {"jobs", jobs}});
    if (a.asJson) continue;
    std::printf("%s on %lld nodes (pauses: grow %.3g s, shrink %.3g s, start %.3g s):\n", p.c_str(),
                static_cast<long long>(a.pool), in.costs.grow_pause_s, in.costs.shrink_pause_s,
                in.costs.start_s);
    std::printf("  %-12s %9s %9s %9s %9s %7s %9s\n", "JOB", "ARRIVAL", "START", "END", "JCT_S",
                "RESIZES", "PAUSED_S");
    for (const ClusterJobResult& j : r.jobs) {
      std::printf("  %-12.12s %9.1f %9.1f %9.1f %9.1f %7d %9.2f\n", j.name.c_str(), j.arrival_s,
                  j.started_s, j.ended_s, j.jct_s, j.resizes, j.paused_s);
    }
    std::printf("CLUSTER policy=%s nodes=%lld mean_jct_s=%.2f makespan_s=%.2f busy_share=%.3f\n\n",
                p.c_str(), static_cast<long long>(a.pool), r.mean_jct_s, r.makespan_s,
                r.busy_share);
  }
  if (a.asJson) std::printf("%s\n", all.dump(2).c_str());
  if (results.count("static") && results.count("marginal")) {
    std::printf("RESULT sim_sched_mean_jct_vs_static=%.4f sim_sched_makespan_vs_static=%.4f\n",
                results["marginal"].mean_jct_s / results["static"].mean_jct_s,
                results["marginal"].makespan_s / results["static"].makespan_s);
  }
  return 0;
}

int run(const Args& a) {
  if (!a.cluster.empty()) return runCluster(a);
  SinewJobModel job;
  std::optional<ThroughputTable> table;
  if (!a.throughput.empty()) table = parseThroughputTable(slurp(a.throughput), a.throughput);
  if (!a.profile.empty()) {
    job.profile = sinew::pipeline::loadProfile(a.profile);
    job.global_microbatches = a.microbatches;
    job.fault_tolerance = static_cast<int>(a.faultTolerance);
    if (!a.costs.empty()) job.costs = parseSinewCosts(slurp(a.costs), a.costs);
    if (a.measuredStep) job.table = table;
  }
  const int64_t batch = a.globalBatch > 0
                            ? a.globalBatch
                            : a.microbatches * std::max<int64_t>(1, job.profile.microbatch_size);
  std::ofstream timeline;
  if (!a.timeline.empty()) {
    timeline.open(a.timeline);
    if (!timeline) throw sinew::IoError("cannot write " + a.timeline);
    timeline << "trace,model,start_s,end_s,samples_per_s";
    for (int c = 0; c < kCauses; ++c) timeline << ',' << causeName(static_cast<Cause>(c)) << "_s";
    timeline << '\n';
  }
  SimOptions so;
  so.duration_s = a.durationS;
  so.bucket_s = a.bucketS;
  json all = json::array();
  double vsFixed = 0, vsRestart = 0;
  for (const Named& t : traces(a)) {
    const ThroughputTable refTable = table ? *table : sinewThroughputTable(job, t.events);
    std::vector<SimResult> results;
    double sinew = -1, fixed = -1, restart = -1;
    std::istringstream models(a.models);
    for (std::string m; std::getline(models, m, ',');) {
      if (m == "sinew") {
        if (a.profile.empty()) throw sinew::InvalidArgument("the sinew model needs --profile");
        results.push_back(simulateSinew(t.events, job, so));
        sinew = results.back().goodput();
      } else if (m == "fixed-cost") {
        FixedCostModel f{refTable,
                         a.reconfigurationS >= 0 ? a.reconfigurationS
                                                 : job.costs.detection_s + job.costs.epoch_s,
                         batch};
        results.push_back(simulateFixedCost(t.events, f, so));
        fixed = results.back().goodput();
      } else if (m == "restart") {
        RestartModel r{
            refTable,
            a.checkpointEvery > 0 ? a.checkpointEvery : youngInterval(t.events, refTable, a, batch),
            a.checkpointS, a.restartS, batch};
        if (!a.asJson) {
          std::printf("restart model: a checkpoint every %lld steps\n",
                      static_cast<long long>(r.checkpoint_every));
        }
        results.push_back(simulateRestart(t.events, r, so));
        restart = results.back().goodput();
      } else {
        usageError("unknown model '" + m + "' in --models");
      }
    }
    json traceJ = {{"trace", t.name}, {"results", json::array()}};
    for (const auto& r : results) {
      traceJ["results"].push_back(resultJson(r));
      if (timeline.is_open()) writeTimeline(timeline, t.name, r);
    }
    all.push_back(traceJ);
    if (!a.asJson) printTable(t.name, t.events, results);
    vsFixed = sinew >= 0 && fixed > 0 ? sinew / fixed : 0;
    vsRestart = sinew >= 0 && restart > 0 ? sinew / restart : 0;
  }
  if (a.asJson) std::printf("%s\n", all.dump(2).c_str());
  std::printf("RESULT sim_goodput_vs_fixed_cost=%.4f sim_goodput_vs_restart=%.4f\n", vsFixed,
              vsRestart);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parseArgs(argc, argv);
  try {
    return run(a);
  } catch (const sinew::Error& e) {
    std::fprintf(stderr, "sinew-sim: %s\n", e.what());
    return 1;
  }
}
