#include "sinew/runtime/job_state.h"

namespace sinew {
namespace runtime {

// The job-state machine's scaling view and costs (docs/control_api.md, "GET /v1/scaling" and
// "Costs"): what a scheduler reads before it resizes or drains the job, computed by
// ResizeCosts (resize_costs.h) from what costInputs() gives it.

CostInputs JobState::costInputs() const {
  CostInputs in;
  in.members.reserve(members_.size());
  for (int id : members_) {
    CostInputs::Member m;
    m.id = id;
    m.leaving = leaving_.count(id) > 0;
    if (auto w = workers_.find(id); w != workers_.end()) {
      m.node = &w->second.node;
      m.computeSeconds = w->second.computeSeconds;
    }
    in.members.push_back(m);
  }
  in.nextWorkerId = workers_.empty() ? 0 : workers_.rbegin()->first + 1;
  in.running = epoch_ >= 0 && !finished_;
  in.globalBatch = globalBatch_;
  in.microbatch = microbatch_;
  in.totalSteps = totalSteps_;
  in.committed = committed_;
  in.pipeline = plans_.on();
  in.profile = &plans_.profile();
  in.templates = &plans_.templates();
  in.planOptions = &plans_.options();
  in.plan = plans_.current();
  in.planOnNodes = [this](const std::vector<int>& nodeIds) { return plans_.onNodes(nodeIds).plan; };
  in.changes = &changes_;
  in.measures = &measures_;
  in.limits = &limits_;
  return in;
}

ControlReply JobState::scaling(Clock::time_point now) {
  now_ = now;
  ControlReply r;
  r.body = ResizeCosts(costInputs()).scaling();
  return r;
}

}  // namespace runtime
}  // namespace sinew
