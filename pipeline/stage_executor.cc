#include "sinew/pipeline/stage_executor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <deque>

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

StageStepResult StageExecutor::run(const StageStep& step) {
  const int s = stage_;
  const bool firstStage = s == 0, lastStage = s == stages_ - 1;
  const int64_t sliceBegin = sliceBegin_, sliceEnd = sliceEnd_;
  const std::vector<Piece>& prevPieces = prevPieces_;
  const std::vector<Piece>& nextPieces = nextPieces_;
  const std::vector<int64_t>& microbatches = mine_.microbatches;
  const int64_t M = static_cast<int64_t>(microbatches.size());
  const int64_t W = std::min<int64_t>(stages_ - s - 1, M);
  const double scale =
      static_cast<double>(sliceEnd - sliceBegin) / static_cast<double>(options_.globalBatch);
  auto onDevice = [&](at::ScalarType t) {
    return at::TensorOptions().dtype(t).device(options_.device);
  };
  auto rows = [&](const at::Tensor& t, const Piece& p) {
    return t.narrow(0, p.begin - sliceBegin, p.end - p.begin);
  };
  struct InFlight {
    at::Tensor x, y, loss;
  };
  std::deque<InFlight> inFlight;
  StageStepResult result;
  bool firstBackward = true;
  auto exchange = [&](std::vector<P2POp> ops) {
    if (ops.empty()) return;
    auto transfer = [&] {
      auto t0 = std::chrono::steady_clock::now();
      comm_.exchange(ops, step.timeout);
      result.waitSeconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    if (step.aroundExchange) {
      step.aroundExchange(transfer);
    } else {
      transfer();
    }
  };
  // The header of an activation: dtype, number of dimensions, dimensions.
  auto header = [&](const at::Tensor& y) {
    if (y.dim() > kMaxDims) {
      SINEW_THROW(InvalidArgument, "layer '", options_.lastLayerName, "' (the last of stage ", s,
                  ") outputs a tensor of ", y.dim(), " dimensions; at most ", kMaxDims,
                  " can be sent between pipeline stages");
    }
    at::Tensor h = at::zeros({2 + kMaxDims}, at::kLong);
    auto a = h.accessor<int64_t, 1>();
    a[0] = static_cast<int64_t>(y.scalar_type());
    a[1] = y.dim();
    for (int64_t d = 0; d < y.dim(); ++d) a[2 + d] = y.size(d);
    return h.to(options_.device);
  };
  // The sizes a header announces (dtype code, then the dimensions); Corruption if malformed.
  auto fromHeader = [&](const at::Tensor& received, const Piece& p) {
    at::Tensor h = received.cpu();
    auto a = h.accessor<int64_t, 1>();
    const int64_t type = a[0], dims = a[1];
    const bool plain =
        type >= 0 && type < static_cast<int64_t>(at::ScalarType::NumOptions) &&
        (at::isFloatingType(static_cast<at::ScalarType>(type)) ||
         at::isIntegralType(static_cast<at::ScalarType>(type), /*includeBool=*/true));
    if (!plain || dims < 1 || dims > kMaxDims) {
      SINEW_THROW(Corruption, "stage ", s, " received a malformed activation header from stage ",
                  s - 1, " (dtype code ", type, ", ", dims, " dimensions)");
    }
    std::vector<int64_t> sizes{type};
    for (int64_t d = 0; d < dims; ++d) {
      if (a[2 + d] < 0 || a[2 + d] > (int64_t{1} << 40)) {
        SINEW_THROW(Corruption, "stage ", s, " received an activation size of ", a[2 + d],
                    " from stage ", s - 1);
      }
      sizes.push_back(a[2 + d]);
    }
    if (sizes[1] != p.end - p.begin) {
      SINEW_THROW(Corruption, "stage ", s, " expected ", p.end - p.begin,
                  " rows of activation from stage ", s - 1, ", the header says ", sizes[1]);
    }
    return sizes;
  };
  // Activation shapes of this step's last microbatch, per piece: what this stage sent to each
  // worker of the next stage, and what it received from each worker of the previous one (see
  // "Activation shapes" in the header).
  std::vector<std::vector<int64_t>> sentShapes, receivedShapes;
  std::vector<P2POp> resend;  // activations whose shape changed, sent next
  // An uninitialised tensor of a shape as above.
  auto emptyOf = [&](const std::vector<int64_t>& shape) {
    return at::empty(std::vector<int64_t>(shape.begin() + 1, shape.end()),
                     onDevice(static_cast<at::ScalarType>(shape[0])));
  };
  auto sendForward = [&](const at::Tensor& y, std::vector<P2POp>& ops) {
    if (lastStage) return;
    at::Tensor data = y.detach().contiguous();
    if (data.dim() < 1 || data.size(0) != sliceEnd - sliceBegin) {
      SINEW_THROW(InvalidArgument, "layer '", options_.lastLayerName, "' (the last of stage ", s,
                  ") outputs a tensor whose first dimension is not the ", sliceEnd - sliceBegin,
                  " samples it was given");
    }
    const bool guessed = !sentShapes.empty();
    sentShapes.resize(nextPieces.size());
    for (size_t i = 0; i < nextPieces.size(); ++i) {
      const Piece& p = nextPieces[i];
      at::Tensor part = rows(data, p);
      std::vector<int64_t> shape = shapeOf(part);
      ops.push_back(P2POp::send(header(part), p.rank, kTagHeader));
      if (!guessed || shape == sentShapes[i]) {
        ops.push_back(P2POp::send(part, p.rank, kTagActivation));
      } else {
        ops.push_back(P2POp::send(emptyOf(sentShapes[i]).zero_(), p.rank, kTagActivation));
        resend.push_back(P2POp::send(part, p.rank, kTagActivation));
      }
      sentShapes[i] = std::move(shape);
    }
  };
  // After an exchange with sendForward's operations: the activations that did not have the
  // shape their receivers expected.
  auto sendChanged = [&] {
    if (resend.empty()) return;
    std::vector<P2POp> ops;
    ops.swap(resend);
    exchange(std::move(ops));
  };
  // The input of microbatch k, after `pre` (sends of the same exchange) completes with the
  // headers' receives.
  auto inputFor = [&](int64_t k, std::vector<P2POp> pre) -> at::Tensor {
    if (firstStage) {
      exchange(std::move(pre));
      return step.data(microbatches[k], sliceBegin, sliceEnd).first;
    }
    std::vector<at::Tensor> headers;
    std::vector<at::Tensor> guesses;  // the pieces' receives sized as the last microbatch's
    const bool guessed = !receivedShapes.empty();
    for (size_t i = 0; i < prevPieces.size(); ++i) {
      const Piece& p = prevPieces[i];
      headers.push_back(at::zeros({2 + kMaxDims}, onDevice(at::kLong)));
      pre.push_back(P2POp::recv(headers.back(), p.rank, kTagHeader));
      if (guessed) {
        guesses.push_back(emptyOf(receivedShapes[i]));
        pre.push_back(P2POp::recv(guesses.back(), p.rank, kTagActivation));
      }
    }
    exchange(std::move(pre));
    std::vector<int64_t> shape;
    std::vector<std::vector<int64_t>> received;
    for (size_t i = 0; i < prevPieces.size(); ++i) {
      std::vector<int64_t> sizes = fromHeader(headers[i], prevPieces[i]);
      if (i == 0) {
        shape = sizes;
        shape[1] = sliceEnd - sliceBegin;
      } else if (sizes[0] != shape[0] || sizes.size() != shape.size() ||
                 !std::equal(sizes.begin() + 2, sizes.end(), shape.begin() + 2)) {
        SINEW_THROW(Corruption, "stage ", s, " received activation parts of different types ",
                    "or shapes from the workers of stage ", s - 1);
      }
      received.push_back(std::move(sizes));
    }
    const bool allGuessed =
        guessed && std::equal(received.begin(), received.end(), receivedShapes.begin());
    if (allGuessed && prevPieces.size() == 1) {
      receivedShapes = std::move(received);
      at::Tensor x = guesses[0];  // One piece: the whole slice, already here.
      if (at::isFloatingType(x.scalar_type()) && !step.forwardOnly) x.requires_grad_(true);
      return x;
    }
    at::Tensor x = emptyOf(shape);
    std::vector<P2POp> ops;
    for (size_t i = 0; i < prevPieces.size(); ++i) {
      const Piece& p = prevPieces[i];
      if (guessed && received[i] == receivedShapes[i]) {
        rows(x, p).copy_(guesses[i]);  // It came with the header.
      } else {
        ops.push_back(P2POp::recv(rows(x, p), p.rank, kTagActivation));
      }
    }
    receivedShapes = std::move(received);
    exchange(std::move(ops));
    if (at::isFloatingType(x.scalar_type()) && !step.forwardOnly) x.requires_grad_(true);
    return x;
  };
  auto forward = [&](int64_t k, at::Tensor x) {
    InFlight f;
    f.x = x;
    f.y = step.forward(x);
    if (lastStage) {
      at::Tensor target = step.data(microbatches[k], sliceBegin, sliceEnd).second;
      f.loss = step.loss(f.y, target);
      result.lossSum += f.loss.item<double>() * static_cast<double>(sliceEnd - sliceBegin);
    }
    inFlight.push_back(std::move(f));
  };
  auto gradientFor = [&](const InFlight& f, std::vector<P2POp>& ops) {
    at::Tensor g;
    if (!lastStage && at::isFloatingType(f.y.scalar_type())) {
      g = at::empty(f.y.sizes(), f.y.options().requires_grad(false));
      for (const Piece& p : nextPieces) {
        ops.push_back(P2POp::recv(rows(g, p), p.rank, kTagGradient));
      }
    }
    return g;
  };
  // Backward of the oldest microbatch in flight; adds the send of its input's gradient.
  auto backward = [&](const at::Tensor& g, std::vector<P2POp>& ops) {
    InFlight f = std::move(inFlight.front());
    inFlight.pop_front();
    if (firstBackward && step.beforeFirstBackward) step.beforeFirstBackward();
    firstBackward = false;
    if (lastStage) {
      (f.loss * scale).backward();
    } else if (g.defined() && f.y.requires_grad()) {
      f.y.backward(g);
    }
    if (!firstStage && at::isFloatingType(f.x.scalar_type())) {
      at::Tensor dx = f.x.grad().defined() ? f.x.grad().contiguous() : at::zeros_like(f.x);
      for (const Piece& p : prevPieces) {
        ops.push_back(P2POp::send(rows(dx.detach(), p), p.rank, kTagGradient));
      }
    }
  };
  if (step.forwardOnly) {
    at::NoGradGuard noGrad;
    for (int64_t k = 0; k < M; ++k) {
      forward(k, inputFor(k, {}));
      std::vector<P2POp> ops;
      sendForward(inFlight.back().y, ops);
      exchange(std::move(ops));
      sendChanged();
      inFlight.pop_front();
    }
    return result;
  }
  // Warm-up: forwards only.
  for (int64_t k = 0; k < W; ++k) {
    forward(k, inputFor(k, {}));
    std::vector<P2POp> ops;
    sendForward(inFlight.back().y, ops);
    exchange(std::move(ops));
    sendChanged();
  }
  // Steady state: one forward, one backward.
  at::Tensor x;
  if (W < M) x = inputFor(W, {});
  for (int64_t k = W; k < M; ++k) {
    forward(k, x);
    std::vector<P2POp> ops;
    sendForward(inFlight.back().y, ops);
    at::Tensor g = gradientFor(inFlight.front(), ops);
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
  while (!inFlight.empty()) {
    std::vector<P2POp> ops;
    at::Tensor g = gradientFor(inFlight.front(), ops);
    exchange(std::move(ops));
    std::vector<P2POp> back;
    backward(g, back);
    exchange(std::move(back));
  }
  return result;
}

}  // namespace pipeline
}  // namespace sinew
