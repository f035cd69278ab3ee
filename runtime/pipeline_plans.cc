#include "sinew/runtime/pipeline_plans.h"

#include <algorithm>
#include <cstdint>
#include <set>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/reconfiguration.h"

namespace sinew {
namespace runtime {

using nlohmann::json;

std::string PipelinePlans::plan(const json& request, int nodes, size_t workers,
                                std::string* summary) {
  using sinew::detail::jsonField;
  using sinew::detail::jsonInt;
  const std::string what = "the pipeline request";
  pipeline::Profile profile;
  try {
    profile = pipeline::parseProfileJson(
        sinew::detail::jsonString(jsonField(request, "profile", what), "profile"));
  } catch (const Error& e) {
    return std::string("bad profile: ") + e.what();
  }
  const int G = profile.job.devices_per_node;
  if (nodes < 0) nodes = static_cast<int>(workers) / G;
  pipeline::PlanOptions options;
  // The most workers the job may grow to by joins (absent or 0: the workers it starts with).
  int64_t maxWorkers = 0;
  pipeline::TemplateSet templates;
  try {
    // The bounds a worker's pipeline message is held to (runtime/wire.cc); a persisted request
    // a new leader reads is checked the same way.
    options.fault_tolerance = static_cast<int>(
        jsonInt(jsonField(request, "fault_tolerance", what), "fault_tolerance", 0, 1 << 24));
    options.global_microbatches =
        jsonInt(jsonField(request, "microbatches", what), "microbatches", 1, INT32_MAX);
    if (request.contains("max_workers")) {
      maxWorkers = sinew::detail::jsonInt(request["max_workers"], "max_workers", 0, 1 << 20);
    }
    if (nodes < 1) {
      SINEW_THROW(InvalidArgument, workers, " workers are fewer than one node of ",
                  "devices_per_node = ", G);
    }
    pipeline::TemplateOptions to;
    to.nodes = nodes;
    to.max_nodes = static_cast<int>(maxWorkers / G);
    to.fault_tolerance = options.fault_tolerance;
    to.global_microbatches = options.global_microbatches;
    templates = pipeline::planTemplates(profile, to);
  } catch (const Error& e) {
    return e.what();
  }
  on_ = true;
  request_ = request;
  requestNodes_ = nodes;
  profile_ = std::move(profile);
  options_ = options;
  templates_ = std::move(templates);
  *summary = "planned pipeline templates for " + std::to_string(templates_.min_nodes) + ".." +
             std::to_string(templates_.max_nodes) + " nodes (" + std::to_string(nodes) +
             " nodes of " + std::to_string(G) + " workers, up to " +
             std::to_string(std::max<int64_t>(nodes, maxWorkers / G)) +
             " nodes by joins, fault tolerance " + std::to_string(options_.fault_tolerance) + ")";
  return "";
}

PipelinePlans::EpochPlan PipelinePlans::forMembers(const std::vector<int>& members,
                                                   int64_t epoch) const {
  const int G = devicesPerNode();
  const int nodes = static_cast<int>(members.size()) / G;
  std::vector<int> nodeIds;
  for (int k = 0; k < nodes; ++k) nodeIds.push_back(members[k * G]);
  EpochPlan out = onNodes(nodeIds);
  out.plan.epoch = epoch;
  for (auto& w : out.plan.workers) {
    const int k =
        static_cast<int>(std::find(nodeIds.begin(), nodeIds.end(), w.node) - nodeIds.begin());
    w.worker = members[k * G + w.device];
  }
  return out;
}

PipelinePlans::EpochPlan PipelinePlans::onNodes(const std::vector<int>& nodeIds) const {
  const int G = devicesPerNode();
  EpochPlan out;
  if (G == 1 && current_) {
    std::set<int> before(current_->idleNodeIds.begin(), current_->idleNodeIds.end());
    for (const auto& p : current_->pipelines) before.insert(p.nodeIds.begin(), p.nodeIds.end());
    bool onlyLosses = true;
    for (int id : nodeIds) onlyLosses = onlyLosses && before.count(id) > 0;
    std::vector<int> lost;
    for (int id : before) {
      if (std::find(nodeIds.begin(), nodeIds.end(), id) == nodeIds.end()) lost.push_back(id);
    }
    if (onlyLosses && lost.empty()) {
      // The same nodes (a rollback, or a reconfiguration tried again): the same plan, so that
      // no layer moves for nothing.
      out.plan = *current_;
      out.how = "unchanged";
    } else if (onlyLosses) {
      try {
        pipeline::Reconfiguration r = pipeline::reconfigure(templates_, *current_, lost);
        out.plan = std::move(r.plan);
        out.how = pipeline::reconfigurationKindName(r.kind);
        out.steps = std::move(r.steps);
      } catch (const InvalidArgument&) {
        // Too few survivors for the templates: makePlan says so below, in its own words.
      }
    }
  }
  if (out.how.empty()) {
    // After the first epoch, with fewer pipelines than f + 1 if the nodes cannot hold that
    // many (as pipeline::reconfigure's re-plan and its borrows and merges may leave the job):
    // training goes on with every node it has.
    out.plan = current_ ? pipeline::makePlanLoweringFaultTolerance(templates_, nodeIds, options_)
                        : pipeline::makePlan(templates_, nodeIds, options_);
    if (out.plan.faultTolerance < options_.fault_tolerance) {
      out.steps.push_back("no plan of " + std::to_string(options_.fault_tolerance + 1) +
                          " pipelines for these nodes: " +
                          std::to_string(out.plan.faultTolerance + 1) + " instead");
    }
    out.plan.faultTolerance = options_.fault_tolerance;  // keep aiming for f + 1
    out.how = "instantiated";
  }
  return out;
}

}  // namespace runtime
}  // namespace sinew
