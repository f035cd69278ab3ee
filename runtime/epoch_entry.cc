#include "sinew/runtime/epoch_entry.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "sinew/base/error.h"
#include "sinew/pipeline/stage_executor.h"
#include "sinew/runtime/optimizer_state.h"
#include "sinew/runtime/plan_report.h"

namespace sinew {
namespace runtime {

std::shared_ptr<AbortableStore> EpochEntry::epochStore(int64_t e) const {
  CoordinatorClient& client = u_.services.client;
  return std::make_shared<AbortableStore>(u_.services.ctx.store(),
                                          [&client, e] { return client.latestEpoch().epoch > e; });
}

nlohmann::json EpochEntry::enter(const EpochInfo& info, WorkerState& w) {
  const int self = u_.services.worker();
  if (std::find(info.members.begin(), info.members.end(), self) == info.members.end()) {
    SINEW_THROW(Expelled, "worker ", self, " is not a member of epoch ", info.epoch);
  }
  if (u_.pipelineMode) return enterPipeline(info, w);
  enterDataParallel(info, w);
  return nlohmann::json::object();
}

void EpochEntry::enterDataParallel(const EpochInfo& info, WorkerState& w) {
  const int self = u_.services.worker();
  const TrainerOptions& o = u_.services.options;
  if (!info.sync && w.applied != info.resumeStep - 1) {
    SINEW_THROW(InvalidArgument, "worker ", self, " holds the state after step ", w.applied,
                " but epoch ", info.epoch, " resumes at step ", info.resumeStep,
                " without a state copy");
  }
  u_.comms.buildWorld(epochStore(info.epoch), info.epoch, info.members, "dp");
  w.epoch = info.epoch;
  w.members = info.members;
  w.plan = pipeline::Plan::dataParallel(info.epoch, info.members,
                                        static_cast<int>(u_.spec.layers.size()),
                                        o.globalBatch / o.microbatch);
  if (info.sync && info.source == self && w.applied < info.resumeStep - 1) {
    restoreFromDisk(info.resumeStep - 1, w);  // The first epoch of a resumed job.
  }
  if (info.sync) {
    SINEW_ENFORCE(info.source >= 0, "epoch ", info.epoch,
                  " has no surviving worker that holds the model state");
    const int root = static_cast<int>(
        std::find(info.members.begin(), info.members.end(), info.source) - info.members.begin());
    w.stateBytesIn = broadcastState(u_.comms.world(), root, w.params, *w.opt, u_.device,
                                    u_.services.opTimeout());
    u_.jobTensors.agree(u_.comms.world(), info.resumeStep - 1, u_.device, u_.services.opTimeout(),
                        root);
    w.applied = info.resumeStep - 1;
  }
  u_.progress.restart();
}

nlohmann::json EpochEntry::enterPipeline(const EpochInfo& info, WorkerState& w) {
  const int self = u_.services.worker();
  const TrainerOptions& o = u_.services.options;
  const int64_t e = info.epoch;
  auto store = epochStore(e);
  Laps laps;
  pipeline::Plan plan = u_.profiles.planOf(info, *store);
  laps.lap("plan");
  // Its predicted step time scales the deadlines until a step was measured (opTimeout()).
  u_.services.plannedStepMs.store(
      plan.iterationTicks /
      (int64_t{1000000} * std::max(1, u_.profiles.profile().job.devices_per_node)));
  const pipeline::WorkerAssignment* mine = plan.find(self);
  const int first = mine ? mine->firstLayer : 0;
  const int end = mine ? mine->endLayer : 0;
  const int64_t resumeApplied = info.resumeStep - 1;
  // What every member holds now, published for this epoch, so that all agree on who copies
  // which layers to whom (docs/pipeline.md, "Reconfiguration").
  std::map<int, Holding> held =
      exchangeHoldings(*store, e, info.members, self, {w.heldFirst, w.heldEnd, w.applied},
                       u_.services.recoveryTimeout());
  laps.lap("holdings");
  bool anyHeld = false, anyTrained = false;
  for (const auto& [worker, h] : held) {
    anyHeld = anyHeld || h.first < h.end;
    anyTrained = anyTrained || h.applied >= 0;
  }
  // The job's first plan (or the first since it restarted from disk): every worker builds
  // its own layers from their seeds, or reads them from the durable checkpoint. (Members
  // that trained but hold no layers, because every worker that held some is gone, are not
  // a first plan: they roll back to a version they can restore.)
  const bool firstPlan = !anyHeld && !anyTrained;
  // Every member is new in a job that committed steps: each worker that trained is gone, and
  // its RAM with it. With durable checkpoints the job goes back to the newest durable version
  // (the rollback below; when it is the resume step's own, nobody rolls back and the first
  // plan reads it); without, the first plan's restore fails naming the missing folder.
  const bool everyCopyLost = firstPlan && resumeApplied >= 0 && u_.durable.enabled();
  if ((!firstPlan || everyCopyLost) && resumeApplied >= 0) {
    u_.relayout.checkRollback(info, held, *store,
                              [this](int l) { return u_.profiles.hasParameters(l); });
  }
  laps.lap("rollback_check");
  // Activations, the loss sums and layer copies move on the world communicator (on the Gloo
  // backend's lanes, each transfer moved by the thread that waits for it).
  u_.comms.buildWorld(store, e, info.members, "pp", u_.pipelineGloo);
  laps.lap("world");
  u_.comms.buildGradGroups(store, e, plan, first, end);
  u_.comms.buildTies(store, e, plan, first, end, u_.ties);
  laps.lap("groups");
  // The layers this worker now holds that it did not (a reconfiguration), copied from live
  // workers that hold them, before anything of this worker's changes.
  u_.peers.waitSnapshots();  // Their copies read the tensors this epoch may replace or update.
  laps.lap("snapshots");
  if (!firstPlan) {
    std::optional<Relayout> relayout = u_.relayout.run(
        plan, held, first, end, resumeApplied, u_.comms.world(), {w.model, w.heldFirst, *w.opt});
    if (relayout) adoptLayers(std::move(*relayout), first, end, resumeApplied, e, w);
  } else {
    // The first plan this worker enters (its communicators are up): build this stage's
    // layers and nothing else.
    w.model =
        end > first ? buildLayers(u_.spec, o.seed, o.dtype, first, end) : torch::nn::Sequential();
    w.model->to(u_.device);
    w.params = w.model->parameters();
    w.opt = u_.spec.optimizer(w.params);
    w.heldFirst = first;
    w.heldEnd = end;
  }
  w.epoch = info.epoch;
  w.members = info.members;
  w.plan = std::move(plan);
  if (firstPlan && w.applied < info.resumeStep - 1) {
    // The first plan of a resumed job: every worker reads its own layers from disk.
    restoreFromDisk(info.resumeStep - 1, w);
  }
  laps.lap("layers");
  u_.jobTensors.agree(u_.comms.world(), info.resumeStep - 1, u_.device, u_.services.opTimeout());
  laps.lap("agree");
  w.applied = info.resumeStep - 1;
  u_.progress.restart();
  if (mine != nullptr) {
    pipeline::StageExecutorOptions eo;
    eo.microbatch = o.microbatch;
    eo.globalBatch = o.globalBatch;
    eo.device = u_.device;
    eo.lastLayerName = u_.spec.layers[end - 1].name;
    u_.comms.setExecutor(
        std::make_unique<pipeline::StageExecutor>(w.plan, self, u_.comms.world(), eo));
  }
  announcePlan(u_.services, w.plan, u_.spec, w.epoch, w.members, u_.profiles.profile());
  return laps.json();
}

void EpochEntry::adoptLayers(Relayout r, int first, int end, int64_t resumeApplied, int64_t epoch,
                             WorkerState& w) {
  auto t0 = TrainerClock::now();
  w.stateBytesIn = static_cast<int64_t>(r.bytesCopied);
  u_.durable.dropArena();  // Its shard layout is the old layers': the next version makes one.
  w.model = r.model ? r.model : torch::nn::Sequential();
  w.params = w.model->parameters();
  w.opt = u_.spec.optimizer(w.params);
  const std::string what = "the state of the layers moved in epoch " + std::to_string(epoch);
  loadState(w.model, *w.opt, r.state, what,
            [&r](const std::string& layer) { return r.adoptable.count(layer) > 0; });
  u_.jobTensors.take(jobTensors(r.state), what, resumeApplied);
  const int oldFirst = w.heldFirst, oldEnd = w.heldEnd;
  w.heldFirst = first;
  w.heldEnd = end;
  w.applied = resumeApplied;
  u_.durable.rolledBackTo(resumeApplied);  // After a rollback, those steps run again.
  u_.services.event(r.movedEvent(epoch, oldFirst, oldEnd, first, end, resumeApplied,
                                 seconds(TrainerClock::now() - t0)));
  std::printf("%s\n",
              r.describe(u_.services.worker(), u_.spec, first, end, epoch, resumeApplied).c_str());
  std::fflush(stdout);
}

void EpochEntry::restoreFromDisk(int64_t step, WorkerState& w) {
  u_.jobTensors.take(u_.durable.restoreInto(step, w.model, *w.opt),
                     "durable checkpoint " + std::to_string(step), step);
  w.applied = step;
}

}  // namespace runtime
}  // namespace sinew
