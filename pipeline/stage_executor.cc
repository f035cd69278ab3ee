#include "sinew/pipeline/stage_executor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <string>

#include <torch/csrc/autograd/autograd.h>

#include "sinew/base/error.h"

namespace sinew {
namespace pipeline {

namespace {

using collectives::P2POp;

std::vector<int64_t> shapeOf(const at::Tensor& t) {
  std::vector<int64_t> v{static_cast<int64_t>(t.scalar_type())};
  for (int64_t d = 0; d < t.dim(); ++d) v.push_back(t.size(d));
  return v;
}

}  // namespace

std::vector<int> StageExecutor::stageWorkers(const Plan& plan, int pipeline, int stage) {
  std::vector<int> out;
  for (const auto& w : plan.workers) {
    if (w.pipeline == pipeline && w.stage == stage) out.push_back(w.worker);
  }
  return out;
}

StageExecutor::StageExecutor(const Plan& plan, int worker, collectives::Communicator& comm,
                             StageExecutorOptions options)
    : comm_(comm), options_(std::move(options)) {
  if (options_.microbatch <= 0 || options_.globalBatch <= 0) {
    SINEW_THROW(InvalidArgument, "StageExecutorOptions: microbatch = ", options_.microbatch,
                " and globalBatch = ", options_.globalBatch, " must be positive");
  }
  const WorkerAssignment* found = nullptr;
  for (const auto& w : plan.workers) {
    if (w.worker == worker) found = &w;
  }
  SINEW_ENFORCE(found != nullptr, "worker ", worker, " has no stage in the plan of epoch ",
                plan.epoch);
  mine_ = *found;
  for (const auto& w : plan.workers) {
    if (w.pipeline == mine_.pipeline) stages_ = std::max(stages_, w.stage + 1);
  }
  stage_ = mine_.stage;
  const std::vector<int> peers = stageWorkers(plan, mine_.pipeline, stage_);
  const int64_t d = static_cast<int64_t>(peers.size());
  const int64_t j = std::find(peers.begin(), peers.end(), worker) - peers.begin();
  const int64_t b = options_.microbatch;
  sliceBegin_ = j * b / d;
  sliceEnd_ = (j + 1) * b / d;
  if (stage_ > 0) prevPieces_ = overlaps(plan, mine_.pipeline, stage_ - 1);
  if (stage_ < stages_ - 1) nextPieces_ = overlaps(plan, mine_.pipeline, stage_ + 1);
}

std::vector<StageExecutor::Piece> StageExecutor::overlaps(const Plan& plan, int pipeline,
                                                          int stage) const {
  std::vector<Piece> pieces;
  const std::vector<int> ws = stageWorkers(plan, pipeline, stage);
  const std::vector<int>& members = comm_.members();
  const int64_t n = static_cast<int64_t>(ws.size());
  const int64_t b = options_.microbatch;
  for (int64_t q = 0; q < n; ++q) {
    const int64_t lo = std::max(sliceBegin_, q * b / n);
    const int64_t hi = std::min(sliceEnd_, (q + 1) * b / n);
    if (lo >= hi) continue;
    auto it = std::find(members.begin(), members.end(), ws[q]);
    if (it == members.end()) {
      SINEW_THROW(InvalidArgument, "worker ", ws[q], " of stage ", stage,
                  " is not a member of the communicator of epoch ", comm_.epoch());
    }
    pieces.push_back({static_cast<int>(it - members.begin()), lo, hi});
  }
  return pieces;
}

// The layout of one activation as a header announces it: whether its tensors are a list, and
// per tensor the dtype code followed by the dimensions.
struct StageExecutor::Layout {
  bool list = false;
  std::vector<std::vector<int64_t>> shapes;
  bool operator==(const Layout& o) const { return list == o.list && shapes == o.shapes; }
};

class StageExecutor::StepRun {
 public:
  StepRun(StageExecutor& e, const StageStep& step)
      : e_(e),
        step_(step),
        s_(e.stage_),
        firstStage_(s_ == 0),
        lastStage_(s_ == e.stages_ - 1),
        rowsMine_(e.sliceEnd_ - e.sliceBegin_) {}

  StageStepResult run() {
    const std::vector<int64_t>& microbatches = e_.mine_.microbatches;
    const int64_t M = static_cast<int64_t>(microbatches.size());
    if (step_.forwardOnly) {
      at::NoGradGuard noGrad;
      for (int64_t k = 0; k < M; ++k) {
        forward(k, inputFor(k, {}));
        std::vector<P2POp> ops;
        sendForward(inFlight_.back().y, ops);
        exchange(std::move(ops));
        sendChanged();
        inFlight_.pop_front();
      }
      return result_;
    }
    const int64_t W = std::min<int64_t>(e_.stages_ - s_ - 1, M);
    // Warm-up: forwards only.
    for (int64_t k = 0; k < W; ++k) {
      forward(k, inputFor(k, {}));
      std::vector<P2POp> ops;
      sendForward(inFlight_.back().y, ops);
      exchange(std::move(ops));
      sendChanged();
    }
    // Steady state: one forward, one backward.
    Activation x;
    if (W < M) x = inputFor(W, {});
    for (int64_t k = W; k < M; ++k) {
      forward(k, x);
      std::vector<P2POp> ops;
      sendForward(inFlight_.back().y, ops);
      std::vector<at::Tensor> g = gradientFor(inFlight_.front(), ops);
      exchange(std::move(ops));
      sendChanged();
      std::vector<P2POp> back;
      backward(g, back);
      if (k + 1 < M) {
        x = inputFor(k + 1, std::move(back));
      } else {
        exchange(std::move(back));
      }
    }
    // Cool-down: backwards only.
    while (!inFlight_.empty()) {
      std::vector<P2POp> ops;
      std::vector<at::Tensor> g = gradientFor(inFlight_.front(), ops);
      exchange(std::move(ops));
      std::vector<P2POp> back;
      backward(g, back);
      exchange(std::move(back));
    }
    return result_;
  }

 private:
  struct InFlight {
    Activation x, y;
    at::Tensor loss;
  };

  at::TensorOptions onDevice(at::ScalarType t) const {
    return at::TensorOptions().dtype(t).device(e_.options_.device);
  }
  at::Tensor rows(const at::Tensor& t, const Piece& p) const {
    return t.narrow(0, p.begin - e_.sliceBegin_, p.end - p.begin);
  }
  // An uninitialised tensor of a shape as in Layout.
  at::Tensor emptyOf(const std::vector<int64_t>& shape) const {
    return at::empty(std::vector<int64_t>(shape.begin() + 1, shape.end()),
                     onDevice(static_cast<at::ScalarType>(shape[0])));
  }

  void exchange(std::vector<P2POp> ops) {
    if (ops.empty()) return;
    auto transfer = [&] {
      auto t0 = std::chrono::steady_clock::now();
      e_.comm_.exchange(ops, step_.timeout);
      result_.waitSeconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    if (step_.aroundExchange) {
      step_.aroundExchange(transfer);
    } else {
      transfer();
    }
  }

  // The header announcing `layout`.
  at::Tensor header(const Layout& layout) const {
    at::Tensor h = at::zeros({kHeaderWords}, at::kLong);
    auto a = h.accessor<int64_t, 1>();
    a[0] = static_cast<int64_t>(layout.shapes.size());
    a[1] = layout.list ? 1 : 0;
    for (size_t j = 0; j < layout.shapes.size(); ++j) {
      const std::vector<int64_t>& shape = layout.shapes[j];
      const int64_t at0 = 2 + static_cast<int64_t>(j) * (2 + kMaxDims);
      a[at0] = shape[0];
      a[at0 + 1] = static_cast<int64_t>(shape.size()) - 1;
      for (size_t d = 1; d < shape.size(); ++d) a[at0 + 1 + static_cast<int64_t>(d)] = shape[d];
    }
    return h.to(e_.options_.device);
  }

  // The layout a header from piece p announces; Corruption if malformed.
  Layout fromHeader(const at::Tensor& received, const Piece& p) const {
    at::Tensor h = received.cpu();
    auto a = h.accessor<int64_t, 1>();
    const int64_t count = a[0], list = a[1];
    if (count < 1 || count > kMaxTensors || (list != 0 && list != 1) || (count > 1 && list == 0)) {
      SINEW_THROW(Corruption, "stage ", s_, " received a malformed activation header from stage ",
                  s_ - 1, " (", count, " tensors, list flag ", list, ")");
    }
    Layout layout;
    layout.list = list == 1;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t at0 = 2 + j * (2 + kMaxDims);
      const int64_t type = a[at0], dims = a[at0 + 1];
      const bool plain =
          type >= 0 && type < static_cast<int64_t>(at::ScalarType::NumOptions) &&
          (at::isFloatingType(static_cast<at::ScalarType>(type)) ||
           at::isIntegralType(static_cast<at::ScalarType>(type), /*includeBool=*/true));
      if (!plain || dims < 1 || dims > kMaxDims) {
        SINEW_THROW(Corruption, "stage ", s_, " received a malformed activation header from stage ",
                    s_ - 1, " (tensor ", j, ": dtype code ", type, ", ", dims, " dimensions)");
      }
      std::vector<int64_t> sizes{type};
      for (int64_t d = 0; d < dims; ++d) {
        const int64_t n = a[at0 + 2 + d];
        if (n < 0 || n > (int64_t{1} << 40)) {
          SINEW_THROW(Corruption, "stage ", s_, " received an activation size of ", n,
                      " from stage ", s_ - 1);
        }
        sizes.push_back(n);
      }
      if (sizes[1] != p.end - p.begin) {
        SINEW_THROW(Corruption, "stage ", s_, " expected ", p.end - p.begin,
                    " rows of activation from stage ", s_ - 1, ", the header says ", sizes[1]);
      }
      layout.shapes.push_back(std::move(sizes));
    }
    return layout;
  }

  // Adds the sends of activation y (this stage's output) to the next stage's workers.
  void sendForward(const Activation& y, std::vector<P2POp>& ops) {
    if (lastStage_) return;
    const std::string& layer = e_.options_.lastLayerName;
    const size_t n = y.tensors.size();
    if (n < 1 || n > static_cast<size_t>(kMaxTensors)) {
      SINEW_THROW(InvalidArgument, "layer '", layer, "' (the last of stage ", s_, ") outputs ", n,
                  " tensors; between 1 and ", kMaxTensors, " can be sent between pipeline stages");
    }
    std::vector<at::Tensor> data;
    for (size_t j = 0; j < n; ++j) {
      const at::Tensor& t = y.tensors[j];
      if (!t.defined() || t.dim() < 1 || t.size(0) != rowsMine_) {
        SINEW_THROW(InvalidArgument, "layer '", layer, "' (the last of stage ", s_,
                    ") outputs a tensor (", j, ") whose first dimension is not the ", rowsMine_,
                    " samples it was given");
      }
      if (t.dim() > kMaxDims) {
        SINEW_THROW(InvalidArgument, "layer '", layer, "' (the last of stage ", s_,
                    ") outputs a tensor of ", t.dim(), " dimensions; at most ", kMaxDims,
                    " can be sent between pipeline stages");
      }
      data.push_back(t.detach().contiguous());
    }
    const bool guessed = !sent_.empty();
    sent_.resize(e_.nextPieces_.size());
    for (size_t i = 0; i < e_.nextPieces_.size(); ++i) {
      const Piece& p = e_.nextPieces_[i];
      Layout layout;
      layout.list = y.list;
      std::vector<at::Tensor> parts;
      for (const at::Tensor& t : data) {
        parts.push_back(rows(t, p));
        layout.shapes.push_back(shapeOf(parts.back()));
      }
      ops.push_back(P2POp::send(header(layout), p.rank, kTagHeader));
      if (!guessed || layout == sent_[i]) {
        for (const at::Tensor& part : parts) {
          ops.push_back(P2POp::send(part, p.rank, kTagActivation));
        }
      } else {
        for (const std::vector<int64_t>& shape : sent_[i].shapes) {
          ops.push_back(P2POp::send(emptyOf(shape).zero_(), p.rank, kTagActivation));
        }
        for (const at::Tensor& part : parts) {
          resend_.push_back(P2POp::send(part, p.rank, kTagActivation));
        }
      }
      sent_[i] = std::move(layout);
    }
  }

  // After an exchange with sendForward's operations: the activations that did not have the
  // layout their receivers expected.
  void sendChanged() {
    if (resend_.empty()) return;
    std::vector<P2POp> ops;
    ops.swap(resend_);
    exchange(std::move(ops));
  }

  // Marks the floating-point tensors of x as needing their gradient (training only).
  Activation trainable(Activation x) const {
    if (step_.forwardOnly) return x;
    for (at::Tensor& t : x.tensors) {
      if (at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
    }
    return x;
  }

  // The input of microbatch k, after `pre` (sends of the same exchange) completes with the
  // headers' receives.
  Activation inputFor(int64_t k, std::vector<P2POp> pre) {
    if (firstStage_) {
      exchange(std::move(pre));
      return step_.data(e_.mine_.microbatches[k], e_.sliceBegin_, e_.sliceEnd_).first;
    }
    const std::vector<Piece>& pieces = e_.prevPieces_;
    std::vector<at::Tensor> headers;
    // The pieces' receives sized as the last microbatch's.
    std::vector<std::vector<at::Tensor>> guesses(pieces.size());
    const bool guessed = !received_.empty();
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& p = pieces[i];
      headers.push_back(at::zeros({kHeaderWords}, onDevice(at::kLong)));
      pre.push_back(P2POp::recv(headers.back(), p.rank, kTagHeader));
      if (!guessed) continue;
      for (const std::vector<int64_t>& shape : received_[i].shapes) {
        guesses[i].push_back(emptyOf(shape));
        pre.push_back(P2POp::recv(guesses[i].back(), p.rank, kTagActivation));
      }
    }
    exchange(std::move(pre));
    std::vector<Layout> layouts;
    for (size_t i = 0; i < pieces.size(); ++i) {
      layouts.push_back(fromHeader(headers[i], pieces[i]));
      const Layout& a = layouts.front();
      const Layout& b = layouts.back();
      bool same = a.list == b.list && a.shapes.size() == b.shapes.size();
      for (size_t j = 0; same && j < a.shapes.size(); ++j) {
        same = a.shapes[j][0] == b.shapes[j][0] && a.shapes[j].size() == b.shapes[j].size() &&
               std::equal(a.shapes[j].begin() + 2, a.shapes[j].end(), b.shapes[j].begin() + 2);
      }
      if (!same) {
        SINEW_THROW(Corruption, "stage ", s_, " received activation parts of different types ",
                    "or shapes from the workers of stage ", s_ - 1);
      }
    }
    const bool allGuessed = guessed && layouts == received_;
    if (allGuessed && pieces.size() == 1) {
      received_ = std::move(layouts);
      Activation x;  // One piece: the whole slice, already here.
      x.list = received_[0].list;
      x.tensors = std::move(guesses[0]);
      return trainable(std::move(x));
    }
    Activation x;
    x.list = layouts[0].list;
    for (std::vector<int64_t> shape : layouts[0].shapes) {
      shape[1] = rowsMine_;
      x.tensors.push_back(emptyOf(shape));
    }
    std::vector<P2POp> ops;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& p = pieces[i];
      const bool came = guessed && layouts[i] == received_[i];  // With the header.
      for (size_t j = 0; j < x.tensors.size(); ++j) {
        if (came) {
          rows(x.tensors[j], p).copy_(guesses[i][j]);
        } else {
          ops.push_back(P2POp::recv(rows(x.tensors[j], p), p.rank, kTagActivation));
        }
      }
    }
    received_ = std::move(layouts);
    exchange(std::move(ops));
    return trainable(std::move(x));
  }

  void forward(int64_t k, Activation x) {
    InFlight f;
    f.x = std::move(x);
    f.y = step_.forward(f.x);
    if (lastStage_) {
      const int64_t m = e_.mine_.microbatches[k];
      at::Tensor target = step_.data(m, e_.sliceBegin_, e_.sliceEnd_).second;
      if (f.y.list || f.y.tensors.size() != 1) {
        SINEW_THROW(InvalidArgument, "layer '", e_.options_.lastLayerName,
                    "' (the model's last) outputs ", f.y.tensors.size(),
                    " tensors as a list; the loss takes one tensor");
      }
      f.loss = step_.loss(f.y.tensors[0], target);
      result_.lossSum += f.loss.item<double>() * static_cast<double>(rowsMine_);
    }
    inFlight_.push_back(std::move(f));
  }

  // Adds the receives of the gradients of f's output (one per floating-point tensor).
  std::vector<at::Tensor> gradientFor(const InFlight& f, std::vector<P2POp>& ops) {
    std::vector<at::Tensor> gs(f.y.tensors.size());
    if (lastStage_) return gs;
    for (size_t j = 0; j < gs.size(); ++j) {
      const at::Tensor& y = f.y.tensors[j];
      if (!at::isFloatingType(y.scalar_type())) continue;
      gs[j] = at::empty(y.sizes(), y.options().requires_grad(false));
      for (const Piece& p : e_.nextPieces_) {
        ops.push_back(P2POp::recv(rows(gs[j], p), p.rank, kTagGradient));
      }
    }
    return gs;
  }

  // Backward of the oldest microbatch in flight; adds the sends of its input's gradients.
  void backward(const std::vector<at::Tensor>& gs, std::vector<P2POp>& ops) {
    InFlight f = std::move(inFlight_.front());
    inFlight_.pop_front();
    if (firstBackward_ && step_.beforeFirstBackward) step_.beforeFirstBackward();
    firstBackward_ = false;
    if (lastStage_) {
      (f.loss * (scale() * step_.lossScale)).backward();
    } else {
      std::vector<at::Tensor> ys, grads;
      for (size_t j = 0; j < gs.size(); ++j) {
        if (gs[j].defined() && f.y.tensors[j].requires_grad()) {
          ys.push_back(f.y.tensors[j]);
          grads.push_back(gs[j]);
        }
      }
      if (!ys.empty()) torch::autograd::backward(ys, grads);
    }
    if (firstStage_) return;
    for (const at::Tensor& x : f.x.tensors) {
      if (!at::isFloatingType(x.scalar_type())) continue;
      at::Tensor dx = x.grad().defined() ? x.grad().contiguous() : at::zeros_like(x);
      for (const Piece& p : e_.prevPieces_) {
        ops.push_back(P2POp::send(rows(dx.detach(), p), p.rank, kTagGradient));
      }
    }
  }

  double scale() const {
    return static_cast<double>(rowsMine_) / static_cast<double>(e_.options_.globalBatch);
  }

  StageExecutor& e_;
  const StageStep& step_;
  const int s_;
  const bool firstStage_, lastStage_;
  const int64_t rowsMine_;  // this worker's samples of each microbatch
  std::deque<InFlight> inFlight_;
  StageStepResult result_;
  bool firstBackward_ = true;
  // Activation layouts of this step's last microbatch, per piece: what this stage sent to each
  // worker of the next stage, and what it received from each worker of the previous one (see
  // "Activation shapes" in the header).
  std::vector<Layout> sent_, received_;
  std::vector<P2POp> resend_;  // activations whose layout changed, sent next
};

StageStepResult StageExecutor::run(const StageStep& step) { return StepRun(*this, step).run(); }

}  // namespace pipeline
}  // namespace sinew
