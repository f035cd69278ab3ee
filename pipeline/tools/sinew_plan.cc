// sinew-plan: plans a job from a layer profile (docs/profile_format.md) and prints the
// templates, the chosen instantiation and the batch split (docs/planner.md).
//
//   sinew-plan profile.json --nodes N --fault-tolerance f --microbatches B [--table]
//
// Prints JSON by default (deterministic: the same input gives the same bytes) and a table for
// humans with --table. Exit status: 0 on success, 1 for an invalid profile or an infeasible
// plan (the message says why), 2 for bad command-line arguments.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/template_planner.h"

namespace {

using nlohmann::json;
using namespace sinew::pipeline;

constexpr const char* kUsage =
    "usage: sinew-plan PROFILE.json --nodes N --fault-tolerance F --microbatches B [--table]\n"
    "  PROFILE.json        layer profile (docs/profile_format.md)\n"
    "  --nodes N           live nodes (>= 1)\n"
    "  --fault-tolerance F pipelines that may be lost; the plan runs >= F + 1 (default 0)\n"
    "  --microbatches B    microbatches in the global batch (>= 1)\n"
    "  --table             print tables for humans instead of JSON\n";

struct Args {
  std::string profile;
  int64_t nodes = -1;
  int64_t fault_tolerance = 0;
  int64_t microbatches = -1;
  bool table = false;
};

[[noreturn]] void usageError(const std::string& what) {
  std::cerr << "sinew-plan: " << what << "\n" << kUsage << "Run with --help for more.\n";
  std::exit(2);
}

// Command-line numbers go through the same strict parser as the rest of Sinew.
int64_t parseInt(const std::string& flag, const std::string& text, int64_t min, int64_t max) {
  int64_t v = 0;
  const std::string error = sinew::detail::parseIntOrError(text, flag, min, max, &v);
  if (!error.empty()) usageError(error);
  return v;
}

Args parseArgs(int argc, char** argv) {
  Args a;
  CLI::App app("Plans a job from a layer profile: templates, instantiation and batch split.",
               "sinew-plan");
  app.footer(
      "Prints JSON (deterministic) or, with --table, tables. Exit status: 0 on success, 1 for\n"
      "an invalid profile or an infeasible plan, 2 for bad command-line arguments.");
  std::string nodes, faultTolerance = "0", microbatches;
  app.add_option("profile", a.profile, "layer profile (docs/profile_format.md)")
      ->type_name("PROFILE.json");
  app.add_option("--nodes", nodes, "live nodes, in [1, 2^20]")->type_name("N");
  app.add_option("--fault-tolerance", faultTolerance,
                 "pipelines that may be lost; the plan runs >= F + 1 (default 0)")
      ->type_name("F");
  app.add_option("--microbatches", microbatches, "microbatches in the global batch (>= 1)")
      ->type_name("B");
  app.add_flag("--table", a.table, "print tables for humans instead of JSON");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) std::exit(app.exit(e));  // --help
    usageError(e.what());
  }
  if (a.profile.empty()) usageError("no profile given");
  if (nodes.empty()) usageError("--nodes is required");
  if (microbatches.empty()) usageError("--microbatches is required");
  a.nodes = parseInt("--nodes", nodes, 1, 1 << 20);
  a.fault_tolerance = parseInt("--fault-tolerance", faultTolerance, 0, a.nodes - 1);
  a.microbatches = parseInt("--microbatches", microbatches, 1, std::numeric_limits<int32_t>::max());
  return a;
}

// Ticks are 1/G ns (sinew/pipeline/cost_model.h).
sinew::pipeline::TemplateOptions options(const Args& a) {
  sinew::pipeline::TemplateOptions o;
  o.nodes = static_cast<int>(a.nodes);
  o.fault_tolerance = static_cast<int>(a.fault_tolerance);
  o.global_microbatches = a.microbatches;
  return o;
}

double ticksToMs(int64_t ticks, int G) { return static_cast<double>(ticks) / G / 1e6; }

json templateJson(const PipelineTemplate& t, int G) {
  json stages = json::array();
  for (const StageAssignment& s : t.stages) {
    stages.push_back({{"first_layer", s.first_layer},
                      {"end_layer", s.end_layer},
                      {"node", s.node},
                      {"first_device", s.first_device},
                      {"devices", s.devices},
                      {"compute_ms", ticksToMs(s.compute_ticks, G)},
                      {"fill_ms", ticksToMs(s.fill_ticks, G)},
                      {"memory_bytes", s.memory_bytes}});
  }
  return {{"nodes", t.nodes},
          {"stage_devices", t.stage_devices},
          {"microbatches", t.microbatches},
          {"fill_ticks", t.fill_ticks},
          {"bottleneck_ticks", t.bottleneck_ticks},
          {"iteration_ms", ticksToMs(t.iterationTicks(t.microbatches), G)},
          {"stages", stages}};
}

// "0-3 4-7 ..." for a uniform template; with mixed widths each range carries its width,
// "0-3x4 4-5x2 ...".
std::string layerRanges(const PipelineTemplate& t) {
  std::ostringstream os;
  for (size_t s = 0; s < t.stages.size(); ++s) {
    if (s) os << ' ';
    os << t.stages[s].first_layer << '-' << t.stages[s].end_layer - 1;
    if (t.stage_devices == 0) os << 'x' << t.stages[s].devices;
  }
  return os.str();
}

std::string widthName(const PipelineTemplate& t) {
  return t.stage_devices == 0 ? std::string("mixed") : std::to_string(t.stage_devices);
}

void printTable(const Profile& p, const TemplateSet& set, const Plan& plan, const Args& a) {
  const int G = set.devices_per_node;
  std::printf("profile %s: %d layers, %d devices per node, %lld bytes per device\n",
              a.profile.c_str(), set.num_layers, G,
              static_cast<long long>(p.job.device_memory_bytes));
  std::printf("nodes %lld, fault tolerance %lld, microbatches %lld; templates for %d..%d nodes\n\n",
              static_cast<long long>(a.nodes), static_cast<long long>(a.fault_tolerance),
              static_cast<long long>(a.microbatches), set.min_nodes, set.max_nodes);
  std::printf("%6s %6s %7s %6s %13s %13s  %s\n", "nodes", "width", "stages", "M", "iteration_ms",
              "bottleneck_ms", "layers per stage");
  for (const PipelineTemplate& t : set.templates) {
    std::printf("%6d %6s %7zu %6lld %13.3f %13.3f  %s\n", t.nodes, widthName(t).c_str(),
                t.stages.size(), static_cast<long long>(t.microbatches),
                ticksToMs(t.iterationTicks(t.microbatches), G), ticksToMs(t.bottleneck_ticks, G),
                layerRanges(t).c_str());
  }
  for (int n = 1; n <= static_cast<int>(a.nodes); ++n) {
    std::string why = explainNoTemplate(p, set, options(a), n);
    if (!why.empty()) std::printf("  no template on %d nodes: %s\n", n, why.c_str());
  }
  std::printf("\n%8s %6s %13s %13s  %s\n", "pipeline", "nodes", "microbatches", "iteration_ms",
              "node ids");
  for (size_t i = 0; i < plan.pipelines.size(); ++i) {
    const PipelinePlan& pp = plan.pipelines[i];
    std::ostringstream ids;
    for (size_t k = 0; k < pp.nodeIds.size(); ++k) ids << (k ? "," : "") << pp.nodeIds[k];
    std::printf("%8zu %6d %13lld %13.3f  %s\n", i, pp.nodes,
                static_cast<long long>(pp.microbatches), ticksToMs(pp.iterationTicks, G),
                ids.str().c_str());
  }
  std::printf("\niteration %.3f ms, %zu idle nodes\n", ticksToMs(plan.iterationTicks, G),
              plan.idleNodeIds.size());
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parseArgs(argc, argv);
  try {
    Profile profile = loadProfile(a.profile);
    const int N = static_cast<int>(a.nodes);
    const int f = static_cast<int>(a.fault_tolerance);
    TemplateSet set = planTemplates(profile, options(a));
    std::vector<int> node_ids(N);
    for (int i = 0; i < N; ++i) node_ids[i] = i;
    Plan plan = makePlan(set, node_ids, {f, a.microbatches});
    if (a.table) {
      printTable(profile, set, plan, a);
      return 0;
    }
    const int G = set.devices_per_node;
    json templates = json::array();
    for (const PipelineTemplate& t : set.templates) templates.push_back(templateJson(t, G));
    json noTemplate = json::array();
    for (int n = 1; n <= N; ++n) {
      std::string why = explainNoTemplate(profile, set, options(a), n);
      if (!why.empty()) noTemplate.push_back({{"nodes", n}, {"why", why}});
    }
    json pipelines = json::array();
    for (const PipelinePlan& pp : plan.pipelines) {
      pipelines.push_back({{"nodes", pp.nodes},
                           {"node_ids", pp.nodeIds},
                           {"microbatches", pp.microbatches},
                           {"iteration_ticks", pp.iterationTicks},
                           {"iteration_ms", ticksToMs(pp.iterationTicks, G)}});
    }
    json out = {{"layers", set.num_layers},
                {"devices_per_node", G},
                {"ticks_per_ns", G},
                {"nodes", N},
                {"fault_tolerance", f},
                {"microbatches", a.microbatches},
                {"min_nodes", set.min_nodes},
                {"max_nodes", set.max_nodes},
                {"templates", templates},
                {"no_template", noTemplate},
                {"plan",
                 {{"pipelines", pipelines},
                  {"idle_node_ids", plan.idleNodeIds},
                  {"iteration_ticks", plan.iterationTicks},
                  {"iteration_ms", ticksToMs(plan.iterationTicks, G)}}}};
    std::cout << out.dump(2) << "\n";
  } catch (const sinew::Error& e) {
    std::cerr << "sinew-plan: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
