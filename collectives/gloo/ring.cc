// The Gloo backend's ring algorithms on Gloo's pairs (gloo/gloo_communicator.h): reduce-scatter
// and allgather in segments, so that sending, receiving and reducing overlap; the allreduce of
// three or more members (two reduce on the lanes, gloo/lane_ops.cc), broadcast and allgather.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "sinew/base/error.h"
#include "sinew/collectives/gloo/gloo_communicator.h"
#include "sinew/collectives/gloo/reduce.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {

namespace {

// Ring collectives move data in segments of at most this many bytes so that sending,
// receiving and reducing overlap.
constexpr size_t kSegmentBytes = 512 * 1024;

}  // namespace

// Splits `numel` elements into `parts` blocks and each block into `segments` segments.
// Both ends of a transfer compute the same boundaries, so message sizes always match.
struct Segmenter {
  size_t numel;
  size_t parts;
  size_t segments;

  size_t blockBegin(size_t b) const { return numel * b / parts; }
  // Elements of the largest segment of any block.
  size_t maxSegment() const {
    size_t most = 0;
    for (size_t b = 0; b < parts; ++b) {
      for (size_t s = 0; s < segments; ++s) {
        auto [x, y] = segment(b, s);
        most = std::max(most, y - x);
      }
    }
    return most;
  }
  std::pair<size_t, size_t> segment(size_t block, size_t s) const {
    size_t begin = blockBegin(block);
    size_t len = blockBegin(block + 1) - begin;
    return {begin + len * s / segments, begin + len * (s + 1) / segments};
  }
};

namespace {

size_t segmentsFor(size_t maxBlockBytes) {
  return std::max<size_t>(1, (maxBlockBytes + kSegmentBytes - 1) / kSegmentBytes);
}
}  // namespace

// Ring reduce-scatter: after size()-1 steps rank r holds the sum of block (r+1) % size().
// Step t sends block (r-t) (reduced in step t-1) to the right and receives block (r-t-1)
// from the left into a double-buffered scratch, segment by segment, so a segment's
// reduction overlaps the next segment's transfer.
void GlooCommunicator::ringReduceScatter(UnboundBuffer* sendBuf, UnboundBuffer* scratchBuf,
                                         char* data, char* scratch, const Segmenter& seg,
                                         size_t esize, at::ScalarType type, uint64_t slot) {
  const int P = size();
  const size_t S = seg.segments;
  struct Unit {
    size_t begin, end;
  };
  auto sendUnit = [&](size_t t, size_t s) {
    auto [b, e] = seg.segment((rank_ - t + P * 2) % P, s);
    return Unit{b, e};
  };
  auto recvUnit = [&](size_t t, size_t s) {
    auto [b, e] = seg.segment((rank_ - t - 1 + P * 2) % P, s);
    return Unit{b, e};
  };
  const size_t scratchHalf = scratchBuf->size / 2;
  size_t sendsPosted = 0;
  auto postSend = [&](size_t t, size_t s) {
    Unit u = sendUnit(t, s);
    if (u.end == u.begin) return;
    sendBuf->send(right(), slot, u.begin * esize, (u.end - u.begin) * esize);
    sendsPosted++;
  };
  // Receives in order, skipping empty segments (the sender skips the same ones).
  std::vector<std::pair<size_t, size_t>> recvOrder;  // (t, s)
  for (size_t t = 0; t + 1 < size_t(P); ++t) {
    for (size_t s = 0; s < S; ++s) {
      Unit u = recvUnit(t, s);
      if (u.end > u.begin) recvOrder.emplace_back(t, s);
    }
  }
  auto postRecv = [&](size_t k) {
    if (k >= recvOrder.size()) return;
    Unit u = recvUnit(recvOrder[k].first, recvOrder[k].second);
    scratchBuf->recv(left(), slot, (k % 2) * scratchHalf, (u.end - u.begin) * esize);
  };
  for (size_t s = 0; s < S; ++s) postSend(0, s);
  postRecv(0);
  postRecv(1);
  for (size_t k = 0; k < recvOrder.size(); ++k) {
    waitRecv(scratchBuf, left());
    auto [t, s] = recvOrder[k];
    Unit u = recvUnit(t, s);
    reduceSum(type, data + u.begin * esize, scratch + (k % 2) * scratchHalf, u.end - u.begin);
    postRecv(k + 2);
    if (t + 2 < size_t(P)) postSend(t + 1, s);
  }
  for (size_t i = 0; i < sendsPosted; ++i) waitSend(sendBuf, right());
}

// Ring allgather: rank r starts with block (r + shift) complete; step t sends block
// (r + shift - t) to the right and receives block (r + shift - t - 1) from the left,
// forwarding each segment as soon as it has arrived.
void GlooCommunicator::ringAllgather(UnboundBuffer* sendBuf, UnboundBuffer* recvBuf,
                                     const Segmenter& seg, size_t esize, int shift, uint64_t slot) {
  const int P = size();
  const size_t S = seg.segments;
  auto block = [&](size_t t, int extra) { return (rank_ + shift - int(t) - extra + 2 * P) % P; };
  size_t sendsPosted = 0;
  auto postSend = [&](size_t t, size_t s) {
    auto [b, e] = seg.segment(block(t, 0), s);
    if (e == b) return;
    sendBuf->send(right(), slot, b * esize, (e - b) * esize);
    sendsPosted++;
  };
  std::vector<std::pair<size_t, size_t>> recvOrder;
  for (size_t t = 0; t + 1 < size_t(P); ++t) {
    for (size_t s = 0; s < S; ++s) {
      auto [b, e] = seg.segment(block(t, 1), s);
      if (e == b) continue;
      recvOrder.emplace_back(t, s);
      recvBuf->recv(left(), slot, b * esize, (e - b) * esize);
    }
  }
  for (size_t s = 0; s < S; ++s) postSend(0, s);
  for (auto [t, s] : recvOrder) {
    waitRecv(recvBuf, left());
    if (t + 2 < size_t(P)) postSend(t + 1, s);
  }
  for (size_t i = 0; i < sendsPosted; ++i) waitSend(sendBuf, right());
}

void GlooCommunicator::allreduce(at::Tensor& t, ReduceOp op, std::chrono::milliseconds timeout) {
  validate(t, "allreduce", true);
  checkAlive();
  timeout = resolveTimeout(timeout);
  const int P = size();
  if (P == 2 && t.numel() > 0) {
    allreduceTwo(t, timeout);
  } else if (P > 1 && t.numel() > 0) {
    const size_t esize = t.element_size();
    const size_t numel = t.numel();
    Segmenter seg{numel, size_t(P), segmentsFor(((numel + P - 1) / P) * esize)};
    std::vector<char> scratch(std::max<size_t>(1, 2 * seg.maxSegment() * esize));
    char* data = static_cast<char*>(t.data_ptr());
    // One buffer per direction, so a broken connection names its peer.
    auto sendBuf = buffer(data, numel * esize);
    auto recvBuf = buffer(data, numel * esize);
    auto scratchBuf = buffer(scratch.data(), scratch.size());
    uint64_t slot = nextCollectiveSlot();
    runOp("allreduce", timeout, {sendBuf.get(), recvBuf.get(), scratchBuf.get()}, [&] {
      ringReduceScatter(sendBuf.get(), scratchBuf.get(), data, scratch.data(), seg, esize,
                        t.scalar_type(), slot);
      ringAllgather(sendBuf.get(), recvBuf.get(), seg, esize, 1, slot + 1);
    });
  }
  if (op == ReduceOp::kAvg && P > 1) {
    if (t.scalar_type() == at::kLong) {
      t.div_(P, "trunc");
    } else {
      t.div_(P);
    }
  }
}

void GlooCommunicator::broadcast(at::Tensor& t, int root, std::chrono::milliseconds timeout) {
  validate(t, "broadcast", false);
  checkAlive();
  if (root < 0 || root >= size()) {
    SINEW_THROW(InvalidArgument, describe(), ": broadcast root = ", root, " is not a rank in [0, ",
                size(), ")");
  }
  timeout = resolveTimeout(timeout);
  const int P = size();
  if (P == 1 || t.numel() == 0) return;
  const size_t bytes = t.numel() * t.element_size();
  Segmenter seg{bytes, 1, segmentsFor(bytes)};
  char* data = static_cast<char*>(t.data_ptr());
  auto sendBuf = buffer(data, bytes);
  auto recvBuf = buffer(data, bytes);
  uint64_t slot = nextCollectiveSlot();
  // A pipelined chain root -> root+1 -> ... : each member forwards a segment as soon as
  // it has it.
  const int pos = (rank_ - root + P) % P;
  const int prev = (rank_ - 1 + P) % P;
  const int next = (rank_ + 1) % P;
  runOp("broadcast", timeout, {sendBuf.get(), recvBuf.get()}, [&] {
    if (pos > 0) {
      for (size_t s = 0; s < seg.segments; ++s) {
        auto [b, e] = seg.segment(0, s);
        if (e > b) recvBuf->recv(prev, slot, b, e - b);
      }
    }
    size_t sends = 0;
    for (size_t s = 0; s < seg.segments; ++s) {
      auto [b, e] = seg.segment(0, s);
      if (e == b) continue;
      if (pos > 0) waitRecv(recvBuf.get(), prev);
      if (pos < P - 1) {
        sendBuf->send(next, slot, b, e - b);
        sends++;
      }
    }
    for (size_t i = 0; i < sends; ++i) waitSend(sendBuf.get(), next);
  });
}

void GlooCommunicator::allgather(at::Tensor& output, const at::Tensor& input,
                                 std::chrono::milliseconds timeout) {
  validate(input, "allgather", false);
  validate(output, "allgather", false);
  checkAlive();
  if (output.scalar_type() != input.scalar_type()) {
    SINEW_THROW(InvalidArgument, describe(), ": allgather output dtype ", dtypeName(output),
                " != input dtype ", dtypeName(input));
  }
  if (output.numel() != input.numel() * size()) {
    SINEW_THROW(InvalidArgument, describe(), ": allgather output has ", output.numel(),
                " elements, expected ", input.numel() * size());
  }
  timeout = resolveTimeout(timeout);
  const size_t esize = input.element_size();
  const size_t n = input.numel();
  char* out = static_cast<char*>(output.data_ptr());
  if (n > 0) std::memcpy(out + rank_ * n * esize, input.data_ptr(), n * esize);
  const int P = size();
  if (P == 1 || n == 0) return;
  Segmenter seg{n * P, size_t(P), segmentsFor(n * esize)};
  auto sendBuf = buffer(out, n * P * esize);
  auto recvBuf = buffer(out, n * P * esize);
  uint64_t slot = nextCollectiveSlot();
  runOp("allgather", timeout, {sendBuf.get(), recvBuf.get()},
        [&] { ringAllgather(sendBuf.get(), recvBuf.get(), seg, esize, 0, slot); });
}

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
