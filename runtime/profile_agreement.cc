#include "sinew/runtime/profile_agreement.h"

#include <ATen/ATen.h>

#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "sinew/base/parse.h"
#include "sinew/pipeline/profiler.h"
#include "sinew/runtime/layer_calls.h"
#include "sinew/runtime/mixed_precision.h"
#include "sinew/runtime/optimizer_state.h"
#include "sinew/runtime/trainer_options.h"

namespace sinew {
namespace runtime {

void checkProfile(const pipeline::Profile& profile, size_t layers, int64_t microbatch,
                  const std::string& where) {
  if (profile.layers.size() != layers) {
    SINEW_THROW(InvalidArgument, where, ": the profile has ", profile.layers.size(),
                " layers but the model has ", layers);
  }
  if (profile.job.devices_per_node > microbatch) {
    SINEW_THROW(InvalidArgument, where, ": devices_per_node = ", profile.job.devices_per_node,
                " is more than TrainerOptions::microbatch = ", microbatch,
                ": a stage as wide as a node could not give every worker a sample");
  }
}

ProfileAgreement::ProfileAgreement(const TrainerServices& services, const ModelSpec& spec,
                                   at::Device device, FirstMicrobatch data)
    : s_(services), spec_(spec), device_(device), data_(std::move(data)) {
  const TrainerOptions& o = s_.options;
  if (o.parallelism == Parallelism::kPipeline && !o.profilePath.empty()) {
    profile_ = pipeline::loadProfile(o.profilePath);
    checkProfile(profile_, spec_.layers.size(), o.microbatch,
                 "TrainerOptions::profilePath = '" + o.profilePath + "'");
  }
}

bool ProfileAgreement::hasParameters(int l) const {
  return profile_.layers.size() != spec_.layers.size() || profile_.layers[l].param_bytes > 0;
}

int64_t ProfileAgreement::grownWorkers(int64_t members) const {
  if (s_.options.maxWorkers > 0) return s_.options.maxWorkers;
  if (const char* env = std::getenv("SINEW_MAX_WORKERS")) {
    return sinew::detail::parseInt(env, "SINEW_MAX_WORKERS", 1, 1 << 20);
  }
  return 2 * members;
}

pipeline::Plan ProfileAgreement::planOf(const EpochInfo& info, collectives::Store& store) {
  if (info.plan.empty()) {
    if (profile_.layers.empty()) profile_ = agree(info, store);
    if (info.members.front() == s_.worker()) {
      const TrainerOptions& o = s_.options;
      s_.client.requestPipelines(info.epoch, pipeline::profileToJson(profile_), o.faultTolerance,
                                 o.globalBatch / o.microbatch,
                                 grownWorkers(static_cast<int64_t>(info.members.size())));
    }
    SINEW_THROW(EpochChanged, "epoch ", info.epoch,
                " has no pipeline plan yet; waiting for the coordinator's");
  }
  return checkedPlan(info.plan, info.epoch, info.members, spec_.layers.size());
}

pipeline::Profile ProfileAgreement::agree(const EpochInfo& info, collectives::Store& store) {
  const std::string key = "sinew/pipeline/profile";
  if (!store.check({key})) {
    auto t0 = TrainerClock::now();
    if (mine_.layers.empty()) {
      mine_ = measure();  // Once, even on retries.
      // The profile built every layer of the model and its gradients; glibc keeps such freed
      // memory (tensors below its mmap threshold, 32 MiB at most) resident unless told to
      // return it, which a worker that holds one stage of a large model needs.
#ifdef __GLIBC__
      malloc_trim(0);
#endif
    }
    const std::string prefix = key + "/e" + std::to_string(info.epoch) + "/w";
    store.set(prefix + std::to_string(s_.worker()),
              collectives::toBytes(pipeline::profileToJson(mine_)));
    if (info.members.front() == s_.worker()) {
      std::vector<pipeline::Profile> all;
      for (int w : info.members) {
        all.push_back(pipeline::parseProfileJson(
            collectives::toString(store.get(prefix + std::to_string(w), s_.recoveryTimeout()))));
      }
      pipeline::Profile agreed = mine_;
      for (size_t l = 0; l < agreed.layers.size(); ++l) {
        std::vector<int64_t> f, b;
        for (const auto& p : all) {
          f.push_back(p.layers.at(l).forward_ns);
          b.push_back(p.layers.at(l).backward_ns);
        }
        std::sort(f.begin(), f.end());
        std::sort(b.begin(), b.end());
        agreed.layers[l].forward_ns = f[f.size() / 2];
        agreed.layers[l].backward_ns = b[b.size() / 2];
      }
      // The first combined profile of the job wins, should two epochs race.
      store.compareSet(key, {}, collectives::toBytes(pipeline::profileToJson(agreed)));
    }
    s_.event({{"event", "profiled"},
              {"layers", mine_.layers.size()},
              {"duration_s", seconds(TrainerClock::now() - t0)},
              {"profile", nlohmann::json::parse(pipeline::profileToJson(mine_))}});
  }
  pipeline::Profile profile =
      pipeline::parseProfileJson(collectives::toString(store.get(key, s_.recoveryTimeout())));
  checkProfile(profile, spec_.layers.size(), s_.options.microbatch, "the measured profile");
  return profile;
}

pipeline::Profile ProfileAgreement::measure() {
  const TrainerOptions& o = s_.options;
  const int L = static_cast<int>(spec_.layers.size());
  std::vector<pipeline::ProfiledLayer> layers;
  for (int i = 0; i < L; ++i) {
    torch::nn::Sequential m = buildLayers(spec_, o.seed, o.dtype, i, i + 1);
    m->to(device_);
    layers.push_back({spec_.layers[i].name,
                      [m, this](const pipeline::Activation& x) {
                        AutocastScope autocast(device_, s_.options.computeDtype);
                        return runLayers(m, x);
                      },
                      m->parameters(), spec_.layers[i].activationBytes,
                      spec_.layers[i].workspaceBytes});
  }
  pipeline::ProfilerOptions po;
  po.job.devices_per_node = o.devicesPerNode;
  po.job.device_memory_bytes = o.deviceMemoryBytes > 0 ? o.deviceMemoryBytes : int64_t{1} << 50;
  po.job.inter_stage_gbps = 10;  // Loopback TCP between workers of one host.
  // A stage's in-node allreduce runs over the same loopback TCP (Gloo), with a ring step's
  // latency of a few tens of microseconds.
  po.job.allreduce.bandwidth_gbps = 10;
  po.job.allreduce.latency_us = 50;
  po.microbatch_size = o.microbatch;
  po.measure_memory = o.measureActivationMemory;
  // optimizer_bytes: each parameter's gradient and its optimizer's state tensors.
  std::vector<at::Tensor> all;
  for (const auto& l : layers) all.insert(all.end(), l.parameters.begin(), l.parameters.end());
  po.optimizer_state_factor = stateBytesPerParameterByte(*spec_.optimizer(all));
  // workspace_bytes: the optimizer step's temporaries, measured once on the CPU (the same
  // algorithm allocates the same temporaries on a device).
  if (o.measureActivationMemory) {
    po.update_workspace_factor = measureStepWorkspacePerParameterByte(spec_.optimizer, o.dtype);
  }
  // Medians over many whole-microbatch runs: a short profile on a busy machine can be off
  // by half, and the plan and its predicted iteration time rest on it. A model whose
  // microbatch takes seconds gets a few runs within a minute instead (three or more).
  po.warmup = 3;
  po.repeats = 21;
  po.time_budget_s = 60;
  // The last stage computes the loss after its layers: its time is the last layer's.
  auto [input, target] = data_();
  po.loss = [this](const at::Tensor& y, const at::Tensor& t) {
    AutocastScope autocast(device_, s_.options.computeDtype);
    return spec_.loss(y, t);
  };
  po.target = target;
  return pipeline::profileLayers(layers, input, po);
}

}  // namespace runtime
}  // namespace sinew
