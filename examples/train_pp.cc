// train_pp: a pipeline-parallel Sinew trainer of a small GPT-style decoder (token and position
// embeddings, transformer blocks with causal self-attention, a vocabulary head) on a
// synthetic learnable token task (no downloads). Run it under sinew-run:
//
//   sinew-run -n 6 build/examples/train_pp
//
// Each worker may use 4.4 MB (--memory-bytes) and the model needs 3.4 MB for its parameters,
// gradients and Adam state alone, plus about 0.3 MB of activations per block for each
// microbatch in flight (measured by the profiler, attention weights and all), so no worker can
// hold it: the job trains as pipelines. Consecutive workers
// form nodes of two (--devices-per-node 2), as on a cluster of two-GPU nodes: a node is what
// the planner places, and a stage may run on both of a node's workers, each taking half of
// every microbatch. Under `sinew-run -n 6` the three nodes run two pipelines
// (fault tolerance 1), one of two nodes and one of one, the global batch split between them
// by their speed. --devices-per-node 1 makes every worker a node (three 2-stage pipelines).
//
// Each sequence counts up from a random token by a stride of 1, 2 or 3 (mod the vocabulary);
// the model learns to continue it, which needs attention to the previous tokens. Inputs and
// targets are token ids (int64), so the first stage runs an Embedding on integer tensors.
//
// The first member prints the plan (which worker holds which layers). After training, every
// worker puts its layers' parameters into the job's store, and the lowest surviving worker
// trains the same model single-process in plain libtorch over the same global batches (skip
// with --no-reference) and compares every layer, printing
//   RESULT final_loss=<l> reference_loss=<r> max_param_rel_diff=<d> recoveries=<k>
//          recovery_s_max=<t>
// Training runs in float64 by default (see examples/train_dp.cc for why).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "example_support.h"
#include "gpt_block.h"
#include "sinew/communicator.h"
#include "sinew/trainer.h"

namespace {

struct Args : sinew_example::CommonArgs {
  bool dataParallel = false;
  int blocks = 8;
  int faultTolerance = 1;
  int peerCheckpointEvery = 1;
  int replicas = 2;
  int64_t maxWorkers = 0;
  int64_t width = 32;  // features per token; a multiple of the 4 attention heads
  bool ragged = false;
  std::string profile;
  // A worker may use 4.4 MB for its layers: the model's parameters, gradients and Adam state
  // alone are 3.4 MB and its activations about 3 MB per microbatch in flight, so no worker can
  // hold it and the job trains as pipelines (0: unlimited).
  int64_t memoryBytes = 4400000;
  // Workers per node: 2, as on a cluster of two-GPU nodes (see the comment at the top).
  int devicesPerNode = 2;

  Args() {
    steps = 40;
    globalBatch = 32;
    microbatch = 4;
    lr = 0.003;
  }
};

Args parse(int argc, char** argv) {
  Args a;
  sinew_example::ArgReader r(
      argc, argv, "train_pp",
      std::string(sinew_example::kCommonUsage) +
          " [--blocks N] [--fault-tolerance F] [--profile FILE] [--memory-bytes M] "
          "[--peer-checkpoint-every K] [--replicas M] [--max-workers W] [--width D] "
          "[--devices-per-node G] [--ragged] [--data-parallel]");
  while (r.next()) {
    const std::string& s = r.flag();
    if (sinew_example::parseCommon(r, a)) continue;
    if (s == "--data-parallel") {
      a.dataParallel = true;
    } else if (s == "--blocks") {
      a.blocks = static_cast<int>(r.integer(256));
    } else if (s == "--fault-tolerance") {
      a.faultTolerance = static_cast<int>(r.integer(64));
    } else if (s == "--profile") {
      a.profile = r.value();
    } else if (s == "--memory-bytes") {
      a.memoryBytes = r.integer(std::numeric_limits<int64_t>::max());
    } else if (s == "--peer-checkpoint-every") {
      a.peerCheckpointEvery = static_cast<int>(r.integer(sinew_example::kMaxInt));
    } else if (s == "--replicas") {
      a.replicas = static_cast<int>(r.integer(64));
    } else if (s == "--max-workers") {
      a.maxWorkers = r.integer(1 << 20);
    } else if (s == "--width") {
      a.width = r.integer(4096);
    } else if (s == "--ragged") {
      a.ragged = true;
    } else if (s == "--devices-per-node") {
      a.devicesPerNode = static_cast<int>(r.integer(4096));
    } else {
      r.fail("unknown argument '" + s + "'");
    }
  }
  sinew_example::checkCommon(r, a);
  if (a.blocks < 1) r.fail("--blocks must be at least 1");
  if (a.devicesPerNode < 1) r.fail("--devices-per-node must be at least 1");
  // A stage wider than one worker splits each microbatch's samples, and each worker would cut
  // its part to the length of its own first sample, not the microbatch's.
  if (a.ragged && a.devicesPerNode != 1) {
    r.fail("--ragged needs stages one worker wide: pass --devices-per-node 1");
  }
  if (a.width < 4 || a.width % 4 != 0) r.fail("--width must be a positive multiple of 4");
  return a;
}

constexpr int64_t kVocab = 32;
constexpr int64_t kContext = 16;
// The model's width (--width; 32 by default). Set once, before any module is built.
int64_t gEmbed = 32;
// --ragged: each microbatch keeps only its first kContext - (first token mod 4) positions, so
// the activations between stages change shape from one microbatch to the next. Needs stages
// one worker wide (--devices-per-node 1, and a --profile file with devices_per_node 1): the
// length follows the microbatch's first sample. Set once.
bool gRagged = false;
constexpr int64_t kHeads = 4;

// Token and position embeddings: int64 [batch, T] -> [batch, T, E].
struct EmbedImpl : torch::nn::Module {
  EmbedImpl()
      : tok(register_module("tok", torch::nn::Embedding(kVocab, gEmbed))),
        pos(register_module("pos", torch::nn::Embedding(kContext, gEmbed))) {}
  at::Tensor forward(at::Tensor ids) {
    if (gRagged) ids = ids.narrow(1, 0, kContext - ids[0][0].item<int64_t>() % 4);
    at::Tensor positions = at::arange(ids.size(1), ids.options());
    return tok->forward(ids) + pos->forward(positions).unsqueeze(0);
  }
  torch::nn::Embedding tok, pos;
};
TORCH_MODULE(Embed);

// Final layer norm and the vocabulary projection: [batch, T, E] -> logits [batch, T, V].
struct HeadImpl : torch::nn::Module {
  HeadImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({gEmbed})))),
        lm(register_module("lm", torch::nn::Linear(gEmbed, kVocab))) {}
  at::Tensor forward(const at::Tensor& x) { return lm->forward(ln->forward(x)); }
  torch::nn::LayerNorm ln;
  torch::nn::Linear lm;
};
TORCH_MODULE(Head);

// Sample i: a sequence start, start + k, start + 2k, ... (mod V), k in {1, 2, 3}; the target
// is the input shifted by one token.
sinew::Sample sample(int64_t i) {
  uint64_t h = sinew_example::mix(static_cast<uint64_t>(i));
  const int64_t start = static_cast<int64_t>(h % kVocab);
  const int64_t stride = 1 + static_cast<int64_t>((h >> 32) % 3);
  at::Tensor seq = (at::arange(kContext + 1, at::kLong) * stride + start).remainder(kVocab);
  return {seq.narrow(0, 0, kContext).clone(), seq.narrow(0, 1, kContext).clone()};
}

sinew::ModelSpec model(const Args& a) {
  sinew::ModelSpec spec;
  spec.layers.push_back({"embed", [] { return torch::nn::AnyModule(Embed()); }});
  for (int b = 0; b < a.blocks; ++b) {
    spec.layers.push_back({"block" + std::to_string(b), [] {
                             return torch::nn::AnyModule(sinew_example::GptBlock(gEmbed, kHeads));
                           }});
  }
  spec.layers.push_back({"head", [] { return torch::nn::AnyModule(Head()); }});
  spec.loss = [](const at::Tensor& logits, const at::Tensor& target) {
    // The positions the model kept (all of them unless --ragged).
    at::Tensor kept = target.narrow(1, 0, logits.size(1));
    return at::cross_entropy_loss(logits.reshape({-1, kVocab}), kept.reshape({-1}));
  };
  spec.optimizer = sinew_example::optimizer(a);
  spec.dataset = sample;
  spec.datasetSize = a.datasetSize > 0 ? a.datasetSize : 1 << 20;
  return spec;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  gEmbed = a.width;
  gRagged = a.ragged;
  at::set_num_threads(1);  // Several workers share a few cores.
  std::unique_ptr<sinew::Context> ctx = sinew_example::join("train_pp", &argc, &argv);
  if (!ctx) return 1;
  sinew::TrainerOptions o = sinew_example::trainerOptions(a);
  o.parallelism = a.dataParallel ? sinew::Parallelism::kData : sinew::Parallelism::kPipeline;
  o.faultTolerance = a.faultTolerance;
  o.peerCheckpointEvery = a.peerCheckpointEvery;
  o.replicas = a.replicas;
  o.maxWorkers = a.maxWorkers;
  o.profilePath = a.profile;
  o.deviceMemoryBytes = a.memoryBytes;
  o.devicesPerNode = a.devicesPerNode;
  sinew::ModelSpec spec = model(a);
  sinew::TrainResult r;
  std::unique_ptr<sinew::Trainer> trainer;
  // After the last step the job's first worker gathers the whole model (Trainer::gatherModel)
  // and compares it with the reference.
  torch::nn::Sequential gathered;
  if (auto status = sinew_example::train(
          "train_pp", *ctx, spec, o, &trainer, &r, a, sinew_example::heldOut(spec),
          [&gathered](sinew::Trainer& t) { gathered = t.gatherModel(); }))
    return *status;
  std::string held = r.layers.empty() ? "no layers" : r.layers.front() + ".." + r.layers.back();
  std::printf(
      "train_pp: worker %d done: %lld steps, epoch %lld, %zu workers, pipeline %d of %d, stage "
      "%d, layers %s (%zu layers, %lld parameters), loss %.9g, device %s, backend %s\n",
      ctx->worker(), static_cast<long long>(r.steps), static_cast<long long>(r.finalEpoch),
      r.finalMembers.size(), r.pipeline, r.pipelines, r.stage, held.c_str(), r.layers.size(),
      static_cast<long long>(r.parameterCount), r.finalLoss, r.device.c_str(), r.backend.c_str());
  std::fflush(stdout);
  if (!gathered.is_empty() && gathered->size() > 0) {
    double refLoss = -1, maxRel = -1;
    if (a.reference) {
      torch::nn::Sequential ref;
      refLoss = sinew_example::trainReference(a, spec, o.dtype, &ref, a.ragged ? a.microbatch : 0,
                                              sinew_example::heldOut(spec));
      maxRel = 0;
      auto mine = gathered->named_parameters(/*recurse=*/true);
      for (const auto& np : ref->named_parameters(/*recurse=*/true)) {
        const at::Tensor* got = mine.find(np.key());
        if (got == nullptr || got->sizes() != np.value().sizes()) {
          std::fprintf(stderr,
                       "train_pp: the gathered model has no tensor '%s' of the reference's shape\n",
                       np.key().c_str());
          return 1;
        }
        maxRel = std::max(maxRel, sinew_example::relDiff(got->to(at::kDouble),
                                                         np.value().detach().to(at::kDouble)));
      }
    }
    sinew_example::printResult(r, refLoss, maxRel);
  }
  std::fflush(stdout);
  return ctx->finishJob();  // Rank 0 under mpirun/srun: how the job ended, said last.
}
