#pragma once

// Data: which samples each step trains on (TrainerOptions::sampling), and a ready-made dataset
// over a flat file of token ids.
//
// Every sampler here is a pure function of (seed, step): every worker computes the same global
// batch, and a step redone after a recovery, a rollback or a restore trains on the samples its
// first attempt did. Since the coordinator commits each step once, what the job trained on is
// the batches of steps 0, 1, ... in order, whatever joins, losses and rollbacks happened; so
// the position in the data needs no saving of its own (a checkpoint's step is it).
//
// Thread safety: pure functions; a TokenFile is immutable once opened (its datasets may be
// called from any thread).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sinew/model.h"

namespace sinew {

enum class Sampling {
  // Each sample of a global batch drawn independently (globalBatchIndices).
  kWithReplacement,
  // Epochs: the samples in a fresh order per (seed, epoch), each exactly once per epoch
  // (epochBatchIndices). A global batch may end one epoch and begin the next.
  kEpochs,
};

// The dataset indices of step `step`'s global batch under `sampling`.
// Throws InvalidArgument unless datasetSize > 0, globalBatch >= 0 and step >= 0.
std::vector<int64_t> batchIndices(Sampling sampling, uint64_t seed, int64_t step,
                                  int64_t globalBatch, int64_t datasetSize);

// Epochs: positions [step * globalBatch, (step + 1) * globalBatch) of the sequence made of
// epoch 0's order of the samples, then epoch 1's, and so on; position p is sample
// epochOrder(seed, p / datasetSize, p % datasetSize, datasetSize). Throws as batchIndices.
std::vector<int64_t> epochBatchIndices(uint64_t seed, int64_t step, int64_t globalBatch,
                                       int64_t datasetSize);

// The sample at `position` of epoch `epoch`'s order: a permutation of [0, datasetSize) for
// each (seed, epoch) (a Feistel network with cycle walking: no table, O(1) memory).
// REQUIRES: 0 <= position < datasetSize.
int64_t epochOrder(uint64_t seed, int64_t epoch, int64_t position, int64_t datasetSize);

// The epoch that step `step`'s first sample belongs to under Sampling::kEpochs.
int64_t epochOfStep(int64_t step, int64_t globalBatch, int64_t datasetSize);

// A flat file of token ids (uint16 or uint32, little-endian, nothing else), memory-mapped
// read-only. Sample i of dataset(window) is the window of tokens [i * window,
// i * window + window) as its input and the same window shifted by one token as its target,
// both int64 tensors of `window` elements (next-token prediction).
class TokenFile {
 public:
  // Throws InvalidArgument naming the path unless tokenBytes is 2 or 4, or if the file's size
  // is not a positive multiple of tokenBytes; IoError naming the path and the system's
  // reason if it cannot be opened or mapped.
  TokenFile(const std::string& path, int tokenBytes);

  const std::string& path() const { return path_; }
  int tokenBytes() const { return tokenBytes_; }
  int64_t tokens() const;
  int64_t token(int64_t i) const;  // REQUIRES: 0 <= i < tokens()

  // How many whole windows of `window` tokens (and the one token after each) the file holds.
  // Throws InvalidArgument unless window >= 1.
  int64_t windows(int64_t window) const;

  // Windows [first, first + count) as a dataset (count < 0: all from first on), for a training
  // and a held-out split of one file. The dataset keeps the mapping alive. Throws
  // InvalidArgument if the range is not within windows(window) or is empty.
  Dataset dataset(int64_t window, int64_t first = 0, int64_t count = -1) const;

  // Writes `tokens` as a token file of `tokenBytes`-wide ids (atomically: a temporary file,
  // then a rename). Throws InvalidArgument if a token does not fit the width, IoError if the
  // file cannot be written.
  static void write(const std::string& path, const std::vector<int64_t>& tokens, int tokenBytes);

 private:
  struct Mapping;

  std::string path_;
  int tokenBytes_;
  std::shared_ptr<const Mapping> map_;
};

}  // namespace sinew
