#include "sinew/runtime/plan_report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include "sinew/pipeline/cost_model.h"

namespace sinew {
namespace runtime {

PlanReport reportPlan(const pipeline::Plan& plan, const ModelSpec& spec, int64_t epoch,
                      double predictedSeconds, const pipeline::Profile* profile) {
  // A joiner plans nothing and holds no profile (it enters with the plan of its epoch).
  std::optional<pipeline::CostModel> costs;
  if (profile != nullptr && profile->layers.size() == spec.layers.size()) costs.emplace(*profile);
  // Per (pipeline, stage): its workers (the stage's width) and the pipeline's stages.
  std::map<std::pair<int, int>, int> width;
  std::map<int, int> stagesOf;
  for (const auto& w : plan.workers) {
    width[{w.pipeline, w.stage}]++;
    stagesOf[w.pipeline] = std::max(stagesOf[w.pipeline], w.stage + 1);
  }
  nlohmann::json pipes = nlohmann::json::array();
  std::ostringstream os;
  os << "sinew: epoch " << epoch << " plan: " << plan.pipelines.size() << " pipelines";
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    nlohmann::json stages = nlohmann::json::array();
    std::ostringstream ps;
    for (const auto& w : plan.workers) {
      if (w.pipeline != static_cast<int>(p)) continue;
      nlohmann::json entry = {{"worker", w.worker},
                              {"stage", w.stage},
                              {"first_layer", w.firstLayer},
                              {"end_layer", w.endLayer}};
      const int wi = costs ? costs->widthIndex(width[{w.pipeline, w.stage}]) : -1;
      if (wi >= 0) {
        entry["memory_bytes"] =
            costs->memoryBytes(w.firstLayer, w.endLayer, wi, stagesOf[w.pipeline] - w.stage);
      }
      stages.push_back(std::move(entry));
      ps << " w" << w.worker << "[" << spec.layers[w.firstLayer].name << ".."
         << spec.layers[w.endLayer - 1].name << "]";
    }
    pipes.push_back({{"nodes", plan.pipelines[p].nodes},
                     {"stages", stages},
                     {"microbatches", plan.pipelines[p].microbatches}});
    const int nodes = plan.pipelines[p].nodes;
    os << "\n  pipeline " << p << ": " << nodes << (nodes == 1 ? " node, " : " nodes, ")
       << stagesOf[static_cast<int>(p)] << " stages, " << plan.pipelines[p].microbatches
       << " microbatches:" << ps.str();
  }
  PlanReport r;
  r.event = {{"event", "plan"},
             {"epoch", epoch},
             {"pipelines", pipes},
             {"idle", plan.idleNodeIds},
             {"predicted_iteration_s", predictedSeconds}};
  r.text = os.str();
  return r;
}

void announcePlan(const TrainerServices& services, const pipeline::Plan& plan,
                  const ModelSpec& spec, int64_t epoch, const std::vector<int>& members,
                  const pipeline::Profile& profile) {
  const double predicted = static_cast<double>(plan.iterationTicks) /
                           (1e9 * static_cast<double>(std::max(1, profile.job.devices_per_node)));
  const PlanReport report = reportPlan(plan, spec, epoch, predicted, &profile);
  services.event(report.event);
  if (!members.empty() && members.front() == services.worker()) {
    std::printf("%s\n", report.text.c_str());
    std::fflush(stdout);
  }
}

}  // namespace runtime
}  // namespace sinew
