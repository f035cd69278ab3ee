#pragma once

// A pipeline job's plans on the coordinator (docs/pipeline.md): the templates, planned once
// from the profile and options a worker sent, the plan of the current epoch, and the plan the
// next epoch's members get (the current one reconfigured after losses, or the templates
// instantiated). The job-state machine (job_state.h) owns one; a data-parallel job's stays
// off.
//
// Internal to sinew_runtime. Thread safety: none; the job-state machine serializes every call.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/template_planner.h"

namespace sinew {
namespace runtime {

class PipelinePlans {
 public:
  // A plan and how it was made.
  struct EpochPlan {
    pipeline::Plan plan;
    std::string how;                 // "instantiated", "unchanged" or a reconfiguration's kind
    std::vector<std::string> steps;  // a reconfiguration's steps, for the log
  };

  // Whether the templates were planned: a pipeline job.
  bool on() const { return on_; }
  // Plans the templates from a pipeline request (its profile, fault_tolerance, microbatches
  // and max_workers) for `nodes` nodes (-1: `workers` / devices_per_node) up to the workers the
  // job may grow to. Returns the error ("bad profile: ...", a field missing or out of bounds,
  // fewer workers than a node, a planner's), or "" with `*summary` saying what was planned. A
  // failed request leaves the plans off.
  std::string plan(const nlohmann::json& request, int nodes, size_t workers, std::string* summary);
  // The plan for `members` (ascending ids) in `epoch`: with G devices per node, node k is
  // members [kG, kG + G) (its id the first of them, device i the i-th); members beyond the
  // last full node stay idle. Throws the planner's errors when the templates cannot cover them.
  EpochPlan forMembers(const std::vector<int>& members, int64_t epoch) const;
  // The plan forMembers would make for nodes `nodeIds` (each node's first worker id), its
  // workers unbound: the current plan reconfigured when the nodes are its nodes less some lost
  // ones (one device per node), the current plan itself on the same nodes, otherwise the
  // templates instantiated.
  EpochPlan onNodes(const std::vector<int>& nodeIds) const;

  // The current epoch's plan (none before the first, nor on a new leader until its first
  // epoch unless its predecessor persisted one).
  const pipeline::Plan* current() const { return current_ ? &*current_ : nullptr; }
  void setCurrent(pipeline::Plan plan) { current_ = std::move(plan); }

  // REQUIRE: on().
  int devicesPerNode() const { return profile_.job.devices_per_node; }
  const pipeline::Profile& profile() const { return profile_; }
  const pipeline::TemplateSet& templates() const { return templates_; }
  const pipeline::PlanOptions& options() const { return options_; }
  // The request the templates were planned from, and for how many nodes (persisted by high
  // availability: a new leader plans the same templates again).
  const nlohmann::json& request() const { return request_; }
  int requestNodes() const { return requestNodes_; }

 private:
  bool on_ = false;
  nlohmann::json request_;
  int requestNodes_ = 0;
  pipeline::Profile profile_;
  pipeline::PlanOptions options_;
  pipeline::TemplateSet templates_;
  std::optional<pipeline::Plan> current_;
};

}  // namespace runtime
}  // namespace sinew
