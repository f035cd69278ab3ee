// train_pp: a pipeline-parallel Sinew trainer of a small GPT-style decoder (token and position
// embeddings, transformer blocks with causal self-attention, a vocabulary head) on a
// synthetic learnable token task (no downloads). Run it under sinew-run:
//
//   sinew-run -n 6 build/examples/train_pp
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

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "sinew/trainer.h"

namespace {

struct Args {
  int64_t steps = 40;
  int64_t globalBatch = 32;
  int64_t microbatch = 4;
  uint64_t seed = 1;
  double lr = 0.003;
  std::string optimizer = "adam";
  bool reference = true;
  bool float32 = false;
  bool dataParallel = false;
  int progress = 10;
  int blocks = 8;
  int faultTolerance = 1;
  std::string profile;
  int64_t memoryBytes = 0;
  std::string checkpointDir;
  int checkpointEvery = 0;
};

[[noreturn]] void usage(const std::string& error) {
  std::fprintf(stderr,
               "train_pp: %s\nusage: train_pp [--steps N] [--global-batch B] [--microbatch b] "
               "[--seed S] [--lr LR] [--optimizer adam|sgd] [--float32] [--progress N] "
               "[--blocks N] [--fault-tolerance F] [--profile FILE] [--memory-bytes M] "
               "[--data-parallel] [--checkpoint-dir DIR] [--checkpoint-every K] "
               "[--no-reference]\n",
               error.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(s + " needs a value");
      return argv[++i];
    };
    auto integer = [&](int64_t max) -> int64_t {
      std::string v = value();
      int64_t x = 0;
      auto r = std::from_chars(v.data(), v.data() + v.size(), x);
      if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || x < 0 || x > max) {
        usage(s + ": '" + v + "' is not an integer in [0, " + std::to_string(max) + "]");
      }
      return x;
    };
    auto number = [&]() -> double {
      std::string v = value();
      double d = 0;
      auto r = std::from_chars(v.data(), v.data() + v.size(), d);
      if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || !std::isfinite(d) ||
          d < 0) {
        usage(s + ": '" + v + "' is not a finite non-negative number");
      }
      return d;
    };
    constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
    if (s == "--steps") {
      a.steps = integer(int64_t{1} << 40);
    } else if (s == "--global-batch") {
      a.globalBatch = integer(kMaxInt);
    } else if (s == "--microbatch") {
      a.microbatch = integer(kMaxInt);
    } else if (s == "--seed") {
      a.seed = static_cast<uint64_t>(integer(std::numeric_limits<int64_t>::max()));
    } else if (s == "--lr") {
      a.lr = number();
    } else if (s == "--optimizer") {
      a.optimizer = value();
      if (a.optimizer != "adam" && a.optimizer != "sgd") usage("unknown optimizer " + a.optimizer);
    } else if (s == "--float32") {
      a.float32 = true;
    } else if (s == "--data-parallel") {
      a.dataParallel = true;
    } else if (s == "--progress") {
      a.progress = static_cast<int>(integer(kMaxInt));
    } else if (s == "--blocks") {
      a.blocks = static_cast<int>(integer(256));
    } else if (s == "--fault-tolerance") {
      a.faultTolerance = static_cast<int>(integer(64));
    } else if (s == "--profile") {
      a.profile = value();
    } else if (s == "--memory-bytes") {
      a.memoryBytes = integer(std::numeric_limits<int64_t>::max());
    } else if (s == "--checkpoint-dir") {
      a.checkpointDir = value();
    } else if (s == "--checkpoint-every") {
      a.checkpointEvery = static_cast<int>(integer(kMaxInt));
    } else if (s == "--no-reference") {
      a.reference = false;
    } else {
      usage("unknown argument '" + s + "'");
    }
  }
  if (a.microbatch <= 0 || a.globalBatch % a.microbatch != 0) {
    usage("--global-batch must be a positive multiple of --microbatch");
  }
  if (a.blocks < 1) usage("--blocks must be at least 1");
  return a;
}

constexpr int64_t kVocab = 32;
constexpr int64_t kContext = 16;
constexpr int64_t kEmbed = 32;
constexpr int64_t kHeads = 4;

// Token and position embeddings: int64 [batch, T] -> [batch, T, E].
struct EmbedImpl : torch::nn::Module {
  EmbedImpl()
      : tok(register_module("tok", torch::nn::Embedding(kVocab, kEmbed))),
        pos(register_module("pos", torch::nn::Embedding(kContext, kEmbed))) {}
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor positions = at::arange(ids.size(1), ids.options());
    return tok->forward(ids) + pos->forward(positions).unsqueeze(0);
  }
  torch::nn::Embedding tok, pos;
};
TORCH_MODULE(Embed);

// A pre-norm transformer block: x + attention(ln1(x)), then x + mlp(ln2(x)).
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kEmbed})))),
        qkv(register_module("qkv", torch::nn::Linear(kEmbed, 3 * kEmbed))),
        proj(register_module("proj", torch::nn::Linear(kEmbed, kEmbed))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kEmbed})))),
        fc(register_module("fc", torch::nn::Linear(kEmbed, 4 * kEmbed))),
        out(register_module("out", torch::nn::Linear(4 * kEmbed, kEmbed))) {}
  at::Tensor forward(const at::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), hd = kEmbed / kHeads;
    auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
    auto heads = [&](const at::Tensor& t) { return t.view({B, T, kHeads, hd}).transpose(1, 2); };
    at::Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    at::Tensor causal = at::ones({T, T}, at::TensorOptions().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(causal, -std::numeric_limits<double>::infinity());
    at::Tensor attn =
        at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({B, T, kEmbed});
    at::Tensor h = x + proj->forward(attn);
    return h + out->forward(at::gelu(fc->forward(ln2->forward(h))));
  }
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, out;
};
TORCH_MODULE(Block);

// Final layer norm and the vocabulary projection: [batch, T, E] -> logits [batch, T, V].
struct HeadImpl : torch::nn::Module {
  HeadImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kEmbed})))),
        lm(register_module("lm", torch::nn::Linear(kEmbed, kVocab))) {}
  at::Tensor forward(const at::Tensor& x) { return lm->forward(ln->forward(x)); }
  torch::nn::LayerNorm ln;
  torch::nn::Linear lm;
};
TORCH_MODULE(Head);

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Sample i: a sequence start, start + k, start + 2k, ... (mod V), k in {1, 2, 3}; the target
// is the input shifted by one token.
sinew::Sample sample(int64_t i) {
  uint64_t h = mix(static_cast<uint64_t>(i));
  const int64_t start = static_cast<int64_t>(h % kVocab);
  const int64_t stride = 1 + static_cast<int64_t>((h >> 32) % 3);
  at::Tensor seq = (at::arange(kContext + 1, at::kLong) * stride + start).remainder(kVocab);
  return {seq.narrow(0, 0, kContext).clone(), seq.narrow(0, 1, kContext).clone()};
}

sinew::ModelSpec model(const Args& a) {
  sinew::ModelSpec spec;
  spec.layers.push_back({"embed", [] { return torch::nn::AnyModule(Embed()); }});
  for (int b = 0; b < a.blocks; ++b) {
    spec.layers.push_back(
        {"block" + std::to_string(b), [] { return torch::nn::AnyModule(Block()); }});
  }
  spec.layers.push_back({"head", [] { return torch::nn::AnyModule(Head()); }});
  spec.loss = [](const at::Tensor& logits, const at::Tensor& target) {
    return at::cross_entropy_loss(logits.reshape({-1, kVocab}), target.reshape({-1}));
  };
  spec.optimizer = a.optimizer == "adam" ? sinew::adam(a.lr) : sinew::sgd(a.lr, 0.9);
  spec.dataset = sample;
  spec.datasetSize = 1 << 20;
  return spec;
}

at::Tensor toTraining(const at::Tensor& t, at::ScalarType dtype) {
  return at::isFloatingType(t.scalar_type()) ? t.to(dtype) : t;
}

// The same training, single-process, in plain libtorch. Returns the last step's loss.
double trainReference(const Args& a, const sinew::ModelSpec& spec, at::ScalarType dtype,
                      torch::nn::Sequential* out) {
  torch::nn::Sequential ref = sinew::buildModel(spec, a.seed, dtype);
  auto opt = spec.optimizer(ref->parameters());
  double loss = 0;
  const int64_t micro = a.globalBatch / a.microbatch;
  for (int64_t s = 0; s < a.steps; ++s) {
    auto idx = sinew::globalBatchIndices(a.seed, s, a.globalBatch, spec.datasetSize);
    opt->zero_grad();
    double sum = 0;
    for (int64_t m = 0; m < micro; ++m) {
      std::vector<at::Tensor> xs, ys;
      for (int64_t j = m * a.microbatch; j < (m + 1) * a.microbatch; ++j) {
        auto smp = spec.dataset(idx[j]);
        xs.push_back(smp.input);
        ys.push_back(smp.target);
      }
      at::Tensor l = spec.loss(ref->forward(toTraining(at::stack(xs), dtype)),
                               toTraining(at::stack(ys), dtype));
      (l * (static_cast<double>(a.microbatch) / a.globalBatch)).backward();
      sum += l.item<double>() * a.microbatch;
    }
    loss = sum / a.globalBatch;
    opt->step();
  }
  *out = ref;
  return loss;
}

std::string paramKey(const std::string& name) { return "train_pp/param/" + name; }

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  at::set_num_threads(1);  // Several workers share a few cores.
  std::unique_ptr<sinew::Context> ctx;
  try {
    ctx = sinew::init(&argc, &argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_pp: cannot join the job: %s\n", e.what());
    return 1;
  }
  sinew::TrainerOptions o;
  o.steps = a.steps;
  o.globalBatch = a.globalBatch;
  o.microbatch = a.microbatch;
  o.seed = a.seed;
  o.progressEvery = a.progress;
  o.dtype = a.float32 ? at::kFloat : at::kDouble;
  o.checkpointDir = a.checkpointDir;
  o.checkpointEvery = a.checkpointEvery;
  o.parallelism = a.dataParallel ? sinew::Parallelism::kData : sinew::Parallelism::kPipeline;
  o.faultTolerance = a.faultTolerance;
  o.profilePath = a.profile;
  o.deviceMemoryBytes = a.memoryBytes;
  sinew::ModelSpec spec = model(a);
  sinew::TrainResult r;
  std::unique_ptr<sinew::Trainer> trainer;
  try {
    trainer = std::make_unique<sinew::Trainer>(*ctx, spec, o);
    r = trainer->run();
  } catch (const sinew::Expelled& e) {
    std::fprintf(stderr, "train_pp: worker %d left the job: %s\n", ctx->worker(), e.what());
    return 3;
  } catch (const sinew::Error& e) {
    std::fprintf(stderr, "train_pp: worker %d failed: %s\n", ctx->worker(), e.what());
    return 1;
  }
  if (r.preempted) {
    std::printf("train_pp: worker %d left the job (preempted) after step %lld\n", ctx->worker(),
                static_cast<long long>(r.steps - 1));
    return 0;
  }
  if (r.startStep > 0) {
    std::printf("train_pp: worker %d resumed from the durable checkpoint of step %lld\n",
                ctx->worker(), static_cast<long long>(r.startStep - 1));
  }
  std::string held = r.layers.empty() ? "no layers" : r.layers.front() + ".." + r.layers.back();
  std::printf(
      "train_pp: worker %d done: %lld steps, epoch %lld, %zu workers, pipeline %d of %d, stage "
      "%d, layers %s (%zu layers, %lld parameters), loss %.9g\n",
      ctx->worker(), static_cast<long long>(r.steps), static_cast<long long>(r.finalEpoch),
      r.finalMembers.size(), r.pipeline, r.pipelines, r.stage, held.c_str(), r.layers.size(),
      static_cast<long long>(r.parameterCount), r.finalLoss);
  std::fflush(stdout);
  // Every worker publishes its layers' parameters; one copy of each layer is enough.
  const auto& store = ctx->store();
  for (const auto& np : trainer->model()->named_parameters(/*recurse=*/true)) {
    at::Tensor t = np.value().detach().to(at::kDouble).contiguous();
    const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
    store->set(paramKey(np.key()), sinew::collectives::Bytes(bytes, bytes + t.nbytes()));
  }
  bool reporter = !r.finalMembers.empty() && r.finalMembers.front() == ctx->worker();
  if (reporter) {
    double refLoss = -1, maxRel = -1;
    if (a.reference) {
      torch::nn::Sequential ref;
      refLoss = trainReference(a, spec, o.dtype, &ref);
      maxRel = 0;
      for (const auto& np : ref->named_parameters(/*recurse=*/true)) {
        at::Tensor theirs = np.value().detach().to(at::kDouble).contiguous();
        sinew::collectives::Bytes got;
        try {
          got = store->get(paramKey(np.key()), std::chrono::seconds(120));
        } catch (const sinew::Error& e) {
          std::fprintf(stderr, "train_pp: no worker published layer tensor '%s': %s\n",
                       np.key().c_str(), e.what());
          return 1;
        }
        if (got.size() != theirs.nbytes()) {
          std::fprintf(stderr, "train_pp: tensor '%s' has %zu bytes, the reference %zu\n",
                       np.key().c_str(), got.size(), static_cast<size_t>(theirs.nbytes()));
          return 1;
        }
        at::Tensor mine = at::empty_like(theirs);
        std::memcpy(mine.data_ptr(), got.data(), got.size());
        double diff = (mine - theirs).abs().max().item<double>();
        double scale = std::max(theirs.abs().max().item<double>(), 1e-30);
        maxRel = std::max(maxRel, diff / scale);
      }
    }
    std::printf(
        "RESULT final_loss=%.9g reference_loss=%.9g max_param_rel_diff=%.3g recoveries=%d "
        "recovery_s_max=%.3f\n",
        r.finalLoss, refLoss, maxRel, r.recoveries, r.recoveryMaxSeconds);
  }
  std::fflush(stdout);
  return 0;
}
