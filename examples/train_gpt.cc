// train_gpt: a GPT-2-style decoder trained with Sinew the way a language model is trained:
// token and position embeddings, pre-LayerNorm blocks with causal self-attention and an MLP,
// a final LayerNorm and a vocabulary head whose weight is tied to the token embedding
// (ModelSpec::tied), AdamW with weight decay, warm-up then cosine decay, gradient clipping at
// 1.0, float32, an evaluation on a held-out split every few steps, and epochs over a token
// file (every window once per epoch, whatever kills and joins happen).
//
//   sinew-run -n 4 build/examples/train_gpt                    # pipelines, the tiny preset
//   sinew-run -n 2 build/examples/train_gpt --data-parallel
//   build/examples/train_gpt --preset small --no-reference     # GPT-2 small: 124 M parameters
//
// A process started without a launcher trains alone, data parallel.
//
// Data: --tokens FILE, a flat file of uint16 token ids (sinew::TokenFile); when it does not
// exist it is made from --text (a file, or a folder whose files are read in name order; by
// default the licence texts every Debian machine has under /usr/share/common-licenses), one
// token per byte. Without --tokens each worker makes a private one and removes it once mapped.
// The last tenth of the windows is the held-out split.
//
// --documents: attention stays within a document (a paragraph: a new one starts at each blank
// line), as when documents are packed into windows. Each sample then has a second input, the
// document id of every position (int64 [T]), and what flows between the layers, across
// pipeline stages too, is two tensors: the hidden states and those ids.
//
// --bf16: mixed precision (TrainerOptions::computeDtype): the layers compute in bfloat16 under
// autocast while the parameters, gradients and AdamW's state stay float32; the reference
// trains in plain float32, so the RESULT compares a bf16 loss curve with a float32 one.
// --fp16 (CUDA only): the same in float16, with dynamic loss scaling (steps with an infinite
// gradient are skipped).
// --loss-scaling N: dynamic loss scaling from 2^16, doubling after N steps in a row with a
// finite gradient (TrainerOptions::lossScaling); RESULT's loss_scale is the scale after the
// last step (1 without).
//
// Presets: tiny (the default: 4 blocks of width 64, context 64, a byte vocabulary; seconds per
// run) and small (GPT-2 small's dimensions: 12 blocks of width 768 with 12 heads, context 1024,
// vocabulary 50257, 124 M parameters; the byte tokens use the first 256 ids).
//
// After training the job evaluates the model (unless --eval-every 0; then the eval losses are
// -1), the first worker gathers it (Trainer::gatherModel), trains the same recipe
// single-process in plain libtorch (one tensor shared by the embedding and the head) unless
// --no-reference, and prints
//   RESULT final_loss=<l> reference_loss=<r> max_param_rel_diff=<d> recoveries=<k>
//          recovery_s_max=<t> eval_loss=<e> reference_eval_loss=<re>
//          eval_outputs_rel_diff=<o> parameters=<n> loss_scale=<s> tokens_seen=<t>
// (tokens_seen: the program's own count of the tokens it trained on, kept in every version as
// TrainerOptions::keptState, so steps*global batch*context also after a rollback).
// (eval_outputs_rel_diff: the final evaluation's logits, Trainer::evaluate with keepOutputs,
// against the reference model's on the same held-out windows; -1 without both).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "example_support.h"
#include "gpt_block.h"
#include "sinew/data.h"
#include "sinew/trainer.h"

namespace {

struct Preset {
  int64_t blocks, width, heads, context, vocab;
};

constexpr Preset kTiny{4, 64, 4, 64, 256};
constexpr Preset kSmall{12, 768, 12, 1024, 50257};

struct Args : sinew_example::CommonArgs {
  std::string preset = "tiny";
  Preset dims = kTiny;
  std::string tokens;
  std::string text = "/usr/share/common-licenses";
  bool dataParallel = false;
  int faultTolerance = 1;
  int peerCheckpointEvery = 1;
  int64_t memoryBytes = 0;
  int devicesPerNode = 1;
  std::string profile;
  bool documents = false;
  bool bf16 = false;
  bool fp16 = false;
  int64_t lossScaling = 0;  // growth interval; 0: off

  Args() {
    steps = 60;
    globalBatch = 16;
    microbatch = 2;
    lr = 3e-3;
    optimizer = "adamw";
    schedule = "cosine";
    warmup = 10;
    clip = 1.0;
    sampling = sinew::Sampling::kEpochs;
    evalEvery = 20;
    evalSamples = 32;
    float32 = true;
  }
};

Args parse(int argc, char** argv) {
  Args a;
  sinew_example::ArgReader r(
      argc, argv, "train_gpt",
      std::string(sinew_example::kCommonUsage) +
          " [--preset tiny|small] [--blocks N] [--width D] [--heads H] [--context T] "
          "[--tokens FILE] [--text FILE|DIR] [--float64] [--data-parallel] "
          "[--fault-tolerance F] [--peer-checkpoint-every K] [--memory-bytes M] "
          "[--devices-per-node G] [--profile FILE] [--documents] [--bf16|--fp16] "
          "[--loss-scaling INTERVAL]");
  int64_t blocks = -1, width = -1, heads = -1, context = -1;
  while (r.next()) {
    const std::string& s = r.flag();
    if (sinew_example::parseCommon(r, a)) continue;
    if (s == "--preset") {
      a.preset = r.value();
      if (a.preset != "tiny" && a.preset != "small") r.fail("unknown preset " + a.preset);
    } else if (s == "--blocks") {
      blocks = r.integer(256);
    } else if (s == "--width") {
      width = r.integer(16384);
    } else if (s == "--heads") {
      heads = r.integer(256);
    } else if (s == "--context") {
      context = r.integer(1 << 16);
    } else if (s == "--tokens") {
      a.tokens = r.value();
    } else if (s == "--text") {
      a.text = r.value();
    } else if (s == "--float64") {
      a.float32 = false;
    } else if (s == "--data-parallel") {
      a.dataParallel = true;
    } else if (s == "--fault-tolerance") {
      a.faultTolerance = static_cast<int>(r.integer(64));
    } else if (s == "--peer-checkpoint-every") {
      a.peerCheckpointEvery = static_cast<int>(r.integer(sinew_example::kMaxInt));
    } else if (s == "--memory-bytes") {
      a.memoryBytes = r.integer(std::numeric_limits<int64_t>::max());
    } else if (s == "--devices-per-node") {
      a.devicesPerNode = static_cast<int>(r.integer(4096));
    } else if (s == "--profile") {
      a.profile = r.value();
    } else if (s == "--documents") {
      a.documents = true;
    } else if (s == "--bf16") {
      a.bf16 = true;
    } else if (s == "--fp16") {
      a.fp16 = true;
    } else if (s == "--loss-scaling") {
      a.lossScaling = r.integer(sinew_example::kMaxInt);
      if (a.lossScaling < 1) r.fail("--loss-scaling needs a growth interval of at least 1");
    } else {
      r.fail("unknown argument '" + s + "'");
    }
  }
  sinew_example::checkCommon(r, a);
  a.dims = a.preset == "small" ? kSmall : kTiny;
  if (blocks >= 0) a.dims.blocks = blocks;
  if (width >= 0) a.dims.width = width;
  if (heads >= 0) a.dims.heads = heads;
  if (context >= 0) a.dims.context = context;
  if (a.dims.blocks < 1) r.fail("--blocks must be at least 1");
  if (a.dims.heads < 1 || a.dims.width < a.dims.heads || a.dims.width % a.dims.heads != 0) {
    r.fail("--width must be a positive multiple of --heads");
  }
  if (a.dims.context < 2) r.fail("--context must be at least 2");
  if (a.devicesPerNode < 1) r.fail("--devices-per-node must be at least 1");
  if ((a.bf16 || a.fp16) && !a.float32) {
    r.fail("--bf16 and --fp16 keep float32 master weights: drop --float64");
  }
  if (a.bf16 && a.fp16) r.fail("--bf16 and --fp16 exclude each other");
  return a;
}

// Token and position embeddings: int64 [batch, T] -> [batch, T, E].
struct EmbedImpl : torch::nn::Module {
  explicit EmbedImpl(const Preset& d)
      : tok(register_module("tok", torch::nn::Embedding(d.vocab, d.width))),
        pos(register_module("pos", torch::nn::Embedding(d.context, d.width))) {
    // GPT-2's initialisation: N(0, 0.02).
    torch::NoGradGuard noGrad;
    tok->weight.normal_(0, 0.02);
    pos->weight.normal_(0, 0.01);
  }
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor positions = at::arange(ids.size(1), ids.options());
    return tok->forward(ids) + pos->forward(positions).unsqueeze(0);
  }
  torch::nn::Embedding tok, pos;
};
TORCH_MODULE(Embed);

// The final LayerNorm and the vocabulary head: [batch, T, E] -> logits [batch, T, V]. Its
// weight is tied to the token embedding's (ModelSpec::tied); the single-process reference
// makes it use that very tensor (`shared`).
struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(const Preset& d)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d.width})))),
        lm(register_module(
            "lm", torch::nn::Linear(torch::nn::LinearOptions(d.width, d.vocab).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) {
    return at::linear(ln->forward(x), shared.defined() ? shared : lm->weight);
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear lm;
  at::Tensor shared;  // the reference's: the embedding's weight itself
};
TORCH_MODULE(Head);

// With --documents: the layers take and return {hidden states or token ids, document ids}.
struct DocEmbedImpl : EmbedImpl {
  using EmbedImpl::EmbedImpl;
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in) {
    return {EmbedImpl::forward(in.at(0)), in.at(1)};
  }
};
TORCH_MODULE(DocEmbed);

// A position attends to the positions before it of its own document.
struct DocBlockImpl : sinew_example::GptBlockImpl {
  using GptBlockImpl::GptBlockImpl;
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in) {
    const at::Tensor& x = in.at(0);
    const at::Tensor& doc = in.at(1);  // [batch, T]
    const int64_t T = x.size(1);
    at::Tensor later =
        at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
    at::Tensor otherDocument = doc.unsqueeze(2) != doc.unsqueeze(1);  // [batch, T, T]
    return {block(x, (otherDocument | later).unsqueeze(1)), doc};
  }
};
TORCH_MODULE(DocBlock);

struct DocHeadImpl : HeadImpl {
  using HeadImpl::HeadImpl;
  at::Tensor forward(const std::vector<at::Tensor>& in) { return HeadImpl::forward(in.at(0)); }
};
TORCH_MODULE(DocHead);

// The document id of each position of a window: a new document starts at the second newline
// of a blank line.
at::Tensor documentIds(const at::Tensor& ids) {
  at::Tensor newline = ids.eq('\n');
  at::Tensor starts = at::zeros_like(newline);
  const int64_t T = ids.size(0);
  starts.narrow(0, 1, T - 1).copy_(newline.narrow(0, 0, T - 1) & newline.narrow(0, 1, T - 1));
  return starts.to(at::kLong).cumsum(0);
}

sinew::Dataset withDocumentIds(sinew::Dataset data) {
  return [data](int64_t i) {
    sinew::Sample s = data(i);
    s.extraInputs = {documentIds(s.input)};
    return s;
  };
}

// The text of --text: a file, or every regular file of a folder in name order.
std::string readText(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::directory_iterator(path)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + f.string());
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return text;
}

// The token file of --tokens (made from --text when missing), or a private one made from
// --text and unlinked once mapped.
sinew::TokenFile openTokens(const Args& a) {
  std::string path = a.tokens;
  const bool temporary = path.empty();
  if (temporary) path = "/tmp/train_gpt-" + std::to_string(::getpid()) + ".tokens";
  if (temporary || !std::filesystem::exists(path)) {
    const std::string text = readText(a.text);
    std::vector<int64_t> ids(text.begin(), text.end());
    for (auto& id : ids) id = static_cast<unsigned char>(id);
    sinew::TokenFile::write(path, ids, 2);
  }
  sinew::TokenFile file(path, 2);
  if (temporary) std::filesystem::remove(path);  // The mapping keeps it alive.
  return file;
}

struct Data {
  sinew::Dataset train, heldOut;
  int64_t trainWindows = 0, heldOutWindows = 0;
};

Data split(const sinew::TokenFile& file, const Args& a) {
  const int64_t windows = file.windows(a.dims.context);
  Data d;
  d.heldOutWindows = std::max<int64_t>(1, windows / 10);
  d.trainWindows = windows - d.heldOutWindows;
  if (d.trainWindows < a.globalBatch) {
    throw std::runtime_error(file.path() + " holds " + std::to_string(windows) + " windows of " +
                             std::to_string(a.dims.context) +
                             " tokens: too few for a global batch and a held-out split");
  }
  d.train = file.dataset(a.dims.context, 0, d.trainWindows);
  d.heldOut = file.dataset(a.dims.context, d.trainWindows, d.heldOutWindows);
  if (a.documents) {
    d.train = withDocumentIds(d.train);
    d.heldOut = withDocumentIds(d.heldOut);
  }
  return d;
}

sinew::ModelSpec model(const Args& a, const Data& data) {
  sinew::ModelSpec spec;
  const Preset d = a.dims;
  const bool docs = a.documents;
  spec.layers.push_back({"embed", [d, docs] {
                           return docs ? torch::nn::AnyModule(DocEmbed(d))
                                       : torch::nn::AnyModule(Embed(d));
                         }});
  for (int64_t b = 0; b < d.blocks; ++b) {
    spec.layers.push_back({"block" + std::to_string(b), [d, docs] {
                             return docs ? torch::nn::AnyModule(DocBlock(d.width, d.heads))
                                         : torch::nn::AnyModule(
                                               sinew_example::GptBlock(d.width, d.heads));
                           }});
  }
  spec.layers.push_back({"head", [d, docs] {
                           return docs ? torch::nn::AnyModule(DocHead(d))
                                       : torch::nn::AnyModule(Head(d));
                         }});
  spec.tied.push_back({"embed.tok.weight", "head.lm.weight"});
  const int64_t vocab = d.vocab;
  spec.loss = [vocab](const at::Tensor& logits, const at::Tensor& target) {
    return at::cross_entropy_loss(logits.reshape({-1, vocab}), target.reshape({-1}));
  };
  spec.optimizer = sinew_example::optimizer(a);
  spec.dataset = data.train;
  spec.datasetSize = data.trainWindows;
  return spec;
}

// The reference's model shares one tensor between the embedding and the head: the head uses
// the embedding's weight and its own is left out of the optimizer.
std::vector<at::Tensor> shareTiedTensor(torch::nn::Sequential& m) {
  auto embed = std::dynamic_pointer_cast<EmbedImpl>(m->ptr(0));
  auto head = std::dynamic_pointer_cast<HeadImpl>(m->ptr(m->size() - 1));
  head->shared = embed->tok->weight;
  std::vector<at::Tensor> params;
  for (const auto& np : m->named_parameters(/*recurse=*/true)) {
    if (np.key() != "head.lm.weight") params.push_back(np.value());
  }
  return params;
}

// The mean loss of `m` over held-out samples [0, count), a global batch at a time.
double heldOutLoss(torch::nn::Sequential& m, const sinew::ModelSpec& spec,
                   const sinew::Dataset& heldOut, int64_t count, int64_t batch,
                   at::ScalarType dtype) {
  at::NoGradGuard noGrad;
  double sum = 0;
  for (int64_t first = 0; first < count; first += batch) {
    std::vector<sinew::Sample> samples;
    for (int64_t j = first; j < first + batch; ++j) samples.push_back(heldOut(j));
    at::Tensor y;
    sum += spec.loss(sinew_example::forwardSamples(m, samples, dtype, &y), y).item<double>() *
           static_cast<double>(batch);
  }
  return sum / static_cast<double>(count);
}

}  // namespace

sinew::TrainerOptions trainerOptions(const Args& a, const std::string& launchMode) {
  sinew::TrainerOptions o = sinew_example::trainerOptions(a);
  // A process on its own (no launcher) has no second node for pipelines to fail over to.
  const bool alone = launchMode == "single";
  o.parallelism =
      a.dataParallel || alone ? sinew::Parallelism::kData : sinew::Parallelism::kPipeline;
  o.faultTolerance = a.faultTolerance;
  o.peerCheckpointEvery = a.peerCheckpointEvery;
  o.deviceMemoryBytes = a.memoryBytes;
  o.devicesPerNode = a.devicesPerNode;
  o.profilePath = a.profile;
  if (a.bf16) o.computeDtype = at::kBFloat16;
  if (a.fp16) o.computeDtype = at::kHalf;  // With dynamic loss scaling unless --loss-scaling.
  if (a.lossScaling > 0) o.lossScaling = sinew::TrainerOptions::LossScaling{65536.0, a.lossScaling};
  return o;
}

// The job's results against a single-process libtorch run of the same recipe.
struct Comparison {
  double refLoss = -1, refEval = -1, maxRel = -1, outputsRel = -1;
};

// Trains the reference and compares the gathered model, the evaluation loss and its outputs
// with it. Returns false (after saying why) if the gathered model lacks a tensor.
bool compare(const Args& a, const sinew::ModelSpec& spec, at::ScalarType dtype, const Data& data,
             int64_t evalCount, const at::Tensor& evalOutputs, torch::nn::Sequential& gathered,
             Comparison* c) {
  torch::nn::Sequential ref;
  c->refLoss =
      sinew_example::trainReference(a, spec, dtype, &ref, 0, data.heldOut, shareTiedTensor);
  if (a.evalEvery > 0) {
    c->refEval = heldOutLoss(ref, spec, data.heldOut, evalCount, a.globalBatch, dtype);
  }
  if (evalOutputs.defined()) {
    std::vector<sinew::Sample> samples;
    for (int64_t j = 0; j < evalCount; ++j) samples.push_back(data.heldOut(j));
    at::NoGradGuard noGrad;
    c->outputsRel =
        sinew_example::relDiff(evalOutputs.to(at::kDouble),
                               sinew_example::forwardSamples(ref, samples, dtype).to(at::kDouble));
  }
  c->maxRel = 0;
  auto mine = gathered->named_parameters(/*recurse=*/true);
  auto refParams = ref->named_parameters(/*recurse=*/true);
  for (const auto& np : refParams) {
    // The head's weight is the embedding's in the reference.
    const std::string theirs = np.key() == "head.lm.weight" ? "embed.tok.weight" : np.key();
    const at::Tensor* got = mine.find(np.key());
    const at::Tensor* want = refParams.find(theirs);
    if (got == nullptr || got->sizes() != want->sizes()) {
      std::fprintf(stderr, "train_gpt: the gathered model has no tensor '%s' of its shape\n",
                   np.key().c_str());
      return false;
    }
    c->maxRel = std::max(
        c->maxRel, sinew_example::relDiff(got->to(at::kDouble), want->detach().to(at::kDouble)));
  }
  return true;
}

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  at::set_num_threads(1);  // Several workers share a few cores.
  Data data;
  try {
    data = split(openTokens(a), a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
    return 2;
  }
  const int64_t evalCount = a.evalSamples > 0 ? a.evalSamples : a.globalBatch;
  if (evalCount % a.globalBatch != 0 || evalCount > data.heldOutWindows) {
    std::fprintf(stderr,
                 "train_gpt: --eval-samples %lld must be a multiple of --global-batch %lld and "
                 "at most the %lld held-out windows\n",
                 static_cast<long long>(evalCount), static_cast<long long>(a.globalBatch),
                 static_cast<long long>(data.heldOutWindows));
    return 2;
  }
  std::unique_ptr<sinew::Context> ctx = sinew_example::join("train_gpt", &argc, &argv);
  if (!ctx) return 1;
  sinew::TrainerOptions o = trainerOptions(a, ctx->launchMode());
  // The program's own state: the tokens trained on so far, as a schedule or a log would use
  // them. It travels with every version, so a rollback does not count redone steps twice.
  int64_t tokensSeen = 0;
  const int64_t tokensPerStep = a.globalBatch * a.dims.context;
  o.keptState.push_back(
      {"tokens_seen", at::zeros({1}, at::kLong),
       [&tokensSeen, tokensPerStep](int64_t) {
         tokensSeen += tokensPerStep;
         return at::full({1}, tokensSeen, at::kLong);
       },
       [&tokensSeen](int64_t, const at::Tensor& v) { tokensSeen = v.item<int64_t>(); }});
  sinew::ModelSpec spec = model(a, data);
  sinew::TrainResult r;
  std::unique_ptr<sinew::Trainer> trainer;
  torch::nn::Sequential gathered;
  double evalLoss = -1;
  at::Tensor evalOutputs;  // The final evaluation's logits, with a reference.
  if (auto status = sinew_example::train(
          "train_gpt", *ctx, spec, o, &trainer, &r, a, data.heldOut, [&](sinew::Trainer& t) {
            if (a.evalEvery > 0) {
              // With a reference to compare them with: the outputs (logits) too.
              sinew::EvalResult e = t.evaluate(data.heldOut, evalCount, a.reference);
              if (!e.done && !e.abandoned) evalLoss = e.loss;
              evalOutputs = e.outputs;
            }
            gathered = t.gatherModel();
          }))
    return *status;
  std::printf(
      "train_gpt: worker %d done: %lld steps, pipeline %d of %d, stage %d, %zu layers "
      "(%lld parameters), loss %.9g\n",
      ctx->worker(), static_cast<long long>(r.steps), r.pipeline, r.pipelines, r.stage,
      r.layers.size(), static_cast<long long>(r.parameterCount), r.finalLoss);
  std::fflush(stdout);
  if (gathered.is_empty() || gathered->size() == 0) return ctx->finishJob();
  int64_t parameters = 0;  // The model's, the tied tensor once.
  for (const auto& np : gathered->named_parameters(/*recurse=*/true)) {
    if (np.key() != "head.lm.weight") parameters += np.value().numel();
  }
  Comparison c;
  if (a.reference && !compare(a, spec, o.dtype, data, evalCount, evalOutputs, gathered, &c)) {
    return 1;
  }
  std::printf(
      "RESULT final_loss=%.9g reference_loss=%.9g max_param_rel_diff=%.3g recoveries=%d "
      "recovery_s_max=%.3f eval_loss=%.9g reference_eval_loss=%.9g eval_outputs_rel_diff=%.3g "
      "parameters=%lld loss_scale=%.9g tokens_seen=%lld\n",
      r.finalLoss, c.refLoss, c.maxRel, r.recoveries, r.recoveryMaxSeconds, evalLoss, c.refEval,
      c.outputsRel, static_cast<long long>(parameters), r.lossScale,
      static_cast<long long>(tokensSeen));
  std::fflush(stdout);
  return ctx->finishJob();  // Rank 0 under mpirun/srun: how the job ended, said last.
}
