#pragma once

// Internal: how a worker's trainer enters an epoch the coordinator announced (docs/architecture.md
// section 6, step 3; docs/pipeline.md, "Reconfiguration, step by step"). It builds the epoch's
// communicators and makes the worker hold what the epoch asks of it:
// - data parallel: the whole model, broadcast from the epoch's source when the epoch syncs (the
//   source first reads it from disk in a resumed job's first epoch);
// - pipeline: the plan's stage, its layers copied from live holders or rolled back to a version
//   in RAM or on disk (runtime/layer_relayout.h), or built from their seeds in the job's first
//   plan; then its stage executor.
// The step loop, the vote and recovery stay in the trainer (runtime/trainer.cc).
//
// Thread safety: used by the training thread; an EpochEntry belongs to one trainer.

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "sinew/collectives/gloo/gloo_options.h"
#include "sinew/model.h"
#include "sinew/pipeline/plan.h"
#include "sinew/runtime/durable_checkpoints.h"
#include "sinew/runtime/epoch_communicators.h"
#include "sinew/runtime/job_tensors.h"
#include "sinew/runtime/layer_relayout.h"
#include "sinew/runtime/peer_versions.h"
#include "sinew/runtime/profile_agreement.h"
#include "sinew/runtime/progress_reporter.h"
#include "sinew/runtime/tied_parameters.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

// What a worker holds between epochs, and the epoch it holds it in.
struct WorkerState {
  torch::nn::Sequential model;                   // its layers (data parallel: every layer)
  std::vector<at::Tensor> params;                // model's parameters
  std::unique_ptr<torch::optim::Optimizer> opt;  // over params
  int heldFirst = -1;                            // pipeline mode: holds [heldFirst, heldEnd)
  int heldEnd = -1;
  int64_t applied = -1;      // the last step whose update it holds
  int64_t epoch = -1;        // the epoch it is in (-1: none yet)
  std::vector<int> members;  // the epoch's, ascending
  pipeline::Plan plan;       // the epoch's
  int64_t stateBytesIn = 0;  // taken in to enter the epoch, for the next vote to report
};

class EpochEntry {
 public:
  // The trainer's units an entry uses; all outlive the EpochEntry.
  struct Units {
    const TrainerServices& services;
    const ModelSpec& spec;
    const std::vector<Tie>& ties;  // spec's, resolved
    at::Device device;
    bool pipelineMode;
    const collectives::GlooOptions& pipelineGloo;  // the pipeline communicator's (Gloo only)
    EpochCommunicators& comms;
    DurableCheckpoints& durable;
    PeerVersions& peers;
    LayerRelayout& relayout;
    ProfileAgreement& profiles;
    ProgressReporter& progress;
    JobTensors& jobTensors;
  };

  explicit EpochEntry(Units units) : u_(units) {}

  // Makes `w` epoch `info`'s: its communicators built, the state it holds the one after step
  // info.resumeStep - 1 (w.applied), and w.epoch, w.members and w.plan the epoch's. Returns the
  // seconds of each part of a pipeline entry ({} in data parallel mode). On a throw `w` may be
  // partly the new epoch's (its communicators did not all build, or a copy failed): the trainer
  // then enters a newer one. Throws Expelled if this worker is not a member, InvalidArgument if
  // a data parallel epoch resumes at a step whose state this worker does not hold and nobody
  // sends, and what the builds, copies and restores throw.
  nlohmann::json enter(const EpochInfo& info, WorkerState& w);

 private:
  void enterDataParallel(const EpochInfo& info, WorkerState& w);
  nlohmann::json enterPipeline(const EpochInfo& info, WorkerState& w);
  // Makes `r` the layers of `w` (after every copy of the epoch succeeded).
  void adoptLayers(Relayout r, int first, int end, int64_t resumeApplied, int64_t epoch,
                   WorkerState& w);
  // Loads durable version `step` into the layers and optimizer state of `w`.
  void restoreFromDisk(int64_t step, WorkerState& w);
  // The store of epoch e's rendezvous: its waits give up once a newer epoch is announced.
  std::shared_ptr<AbortableStore> epochStore(int64_t e) const;

  Units u_;
};

}  // namespace runtime
}  // namespace sinew
