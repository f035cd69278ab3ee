#include "sinew/pipeline/plan.h"

#include <algorithm>

#include "sinew/collectives/error.h"

namespace sinew {
namespace pipeline {

Plan Plan::dataParallel(int64_t epoch, const std::vector<int>& members, int numLayers,
                        int64_t microbatchesPerStep) {
  SINEW_ENFORCE(!members.empty(), "a plan needs at least one member");
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  Plan p;
  p.epoch = epoch;
  p.numLayers = numLayers;
  p.microbatchesPerStep = microbatchesPerStep;
  const int64_t w = static_cast<int64_t>(sorted.size());
  for (int64_t r = 0; r < w; ++r) {
    PipelinePlan pp;
    pp.nodes = 1;
    pp.nodeIds = {sorted[r]};
    WorkerAssignment a;
    a.worker = sorted[r];
    a.node = sorted[r];
    a.pipeline = static_cast<int>(r);
    a.stage = 0;
    a.firstLayer = 0;
    a.endLayer = numLayers;
    for (int64_t m = microbatchesPerStep * r / w; m < microbatchesPerStep * (r + 1) / w; ++m) {
      a.microbatches.push_back(m);
    }
    pp.microbatches = static_cast<int64_t>(a.microbatches.size());
    p.pipelines.push_back(std::move(pp));
    p.workers.push_back(std::move(a));
  }
  return p;
}

const WorkerAssignment& Plan::of(int worker) const {
  for (const auto& a : workers) {
    if (a.worker == worker) return a;
  }
  SINEW_THROW(InvalidArgument, "worker ", worker, " is not in the plan of epoch ", epoch);
}

}  // namespace pipeline
}  // namespace sinew
