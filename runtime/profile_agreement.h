#pragma once

// Internal: the layer profile a pipeline job plans from (docs/pipeline.md, "Profiles"), and the
// // request for the job's first plan. When TrainerOptions::profilePath does not give a profile,
// every member of the job's first pipeline epoch profiles every layer at once, so the layers are
// timed under the same load as training (on a shared machine running them one at a time measured
// them a third faster than they then ran); the first member publishes, once for the job, the
// per-layer median of everyone's times, and all members plan from that.
//
// Thread safety: used by the training thread.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "sinew/model.h"
#include "sinew/pipeline/activation.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

// Throws InvalidArgument, prefixed by `where`, unless `profile` has one entry per layer of a
// model of `layers` layers and devices_per_node <= microbatch.
void checkProfile(const pipeline::Profile& profile, size_t layers, int64_t microbatch,
                  const std::string& where);

class ProfileAgreement {
 public:
  // The first microbatch of step 0 (inputs and targets on the worker's device).
  using FirstMicrobatch = std::function<std::pair<pipeline::Activation, at::Tensor>()>;

  // REQUIRES: services and spec outlive this object. Throws InvalidArgument naming
  // TrainerOptions::profilePath if the profile it names cannot be read or does not fit the
  // model.
  ProfileAgreement(const TrainerServices& services, const ModelSpec& spec, at::Device device,
                   FirstMicrobatch data);

  // The profile the job plans from: TrainerOptions::profilePath's, read and checked at
  // construction in pipeline mode, else agree()'s once it ran; empty before.
  const pipeline::Profile& profile() const { return profile_; }

  // Whether layer l has parameters (from the profile; without one, assume it has).
  bool hasParameters(int l) const;

  // The plan epoch `info` carries, checked against the model and the members. The job's first
  // epoch carries none: the members agree on the profile (unless one was given), the first
  // member asks the coordinator to plan for it, and all throw EpochChanged to wait for the
  // epoch that carries the plan.
  pipeline::Plan planOf(const EpochInfo& info, collectives::Store& store);

  // The job's profile, agreed by the members of epoch `info` (its first pipeline epoch) over
  // `store` (that epoch's abortable store): measured by this worker once (kept across retries),
  // combined by the first member, read back by all. Logs a "profiled" event.
  pipeline::Profile agree(const EpochInfo& info, collectives::Store& store);

 private:
  // This worker's profile of every layer on the first microbatch of step 0.
  pipeline::Profile measure();

  const TrainerServices& s_;  // The trainer's; outlives this object.
  const ModelSpec& spec_;     // The trainer's; outlives this object.
  const at::Device device_;
  const FirstMicrobatch data_;
  // The most workers the job may grow to (TrainerOptions::maxWorkers): the option, else
  // SINEW_MAX_WORKERS, else twice the `members` it starts with.
  int64_t grownWorkers(int64_t members) const;

  pipeline::Profile mine_;     // This worker's measurement, once made.
  pipeline::Profile profile_;  // The job's (see profile()).
};

}  // namespace runtime
}  // namespace sinew
