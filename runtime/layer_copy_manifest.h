#pragma once

// Internal: the manifest of one layer copy (docs/pipeline.md, "Reconfiguration"), the first
// message a worker that holds a layer live sends to a worker that needs it. The tensors follow
// in the manifest's order, in messages of their own.
//
// Wire format: 2n + 1 little-endian int64 words for a layer of n parameters (in the order of
// the layer's named_parameters(), which sender and receiver build alike):
//   words [0, n):   per parameter, flags: kHasAdam (exp_avg and exp_avg_sq follow; the word
//                   n + i is Adam's step count), kHasMaxSq (max_exp_avg_sq follows; only with
//                   kHasAdam), kHasMomentum (SGD's momentum_buffer follows; never with
//                   kHasAdam);
//   words [n, 2n):  per parameter, Adam's step count (>= 0), else 0;
//   word 2n:        the crc32c of every tensor's bytes, one after the other, in order.
// Per parameter the tensors are: the parameter, then exp_avg, exp_avg_sq, max_exp_avg_sq or
// momentum_buffer as its flags say (tensor names as runtime/optimizer_state.h).
//
// Thread safety: plain values and pure functions. No libtorch, so the decoder can be fuzzed
// on its own (fuzz/layer_copy_manifest.cc).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sinew {
namespace runtime {

struct LayerCopyManifest {
  static constexpr int64_t kHasAdam = 1;
  static constexpr int64_t kHasMaxSq = 2;
  static constexpr int64_t kHasMomentum = 4;
  // The most parameters one layer's manifest may list.
  static constexpr size_t kMaxParameters = size_t{1} << 20;

  struct Parameter {
    int64_t flags = 0;
    int64_t step = 0;  // Adam's step count (kHasAdam)
  };
  std::vector<Parameter> parameters;
  uint32_t crc32c = 0;

  // Words of the manifest of a layer of `parameters` parameters.
  static size_t encodedWords(size_t parameters) { return 2 * parameters + 1; }

  std::vector<int64_t> encode() const;

  // Decodes the manifest of a layer of `parameters` parameters from `count` words. Throws
  // Corruption naming `what` (e.g. "layer 'h3' from worker 2") and the first bad word: a
  // count other than 2n + 1, unknown or contradictory flags, a negative step count, a step
  // count without Adam, a checksum that is not 32 bits.
  static LayerCopyManifest decode(const int64_t* words, size_t count, size_t parameters,
                                  const std::string& what);

  // The suffixes of the tensor names that a parameter with `flags` sends, in order: "" (the
  // parameter itself), then ".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq" or
  // ".momentum_buffer". REQUIRES: flags valid (decode() checked them).
  static std::vector<std::string> tensorSuffixes(int64_t flags);
};

}  // namespace runtime
}  // namespace sinew
