#pragma once

// Internal: the manifest of one layer copy (docs/pipeline.md, "Reconfiguration"), the first
// message a worker that holds a layer live sends to a worker that needs it. The tensors follow
// in the manifest's order, in messages of their own.
//
// The optimizer's per-parameter state is described by a StateLayout (runtime/optimizer_state.h
// makes it from the optimizer's type; sender and receiver make the same optimizer): its fields
// in order, each a tensor shaped as the parameter, except at most one count (the step count),
// which travels in the manifest itself.
//
// Wire format: 2n + 1 little-endian int64 words for a layer of n parameters (in the order of
// the layer's named_parameters(), which sender and receiver build alike):
//   words [0, n):   per parameter, the fields of its optimizer state that are present, bit i
//                   for the layout's field i (0: no state yet);
//   words [n, 2n):  per parameter, the value of the layout's count field (>= 0) when present,
//                   else 0;
//   word 2n:        the crc32c of every tensor's bytes, one after the other, in order.
// Per parameter the tensors are: the parameter, then its present tensor fields in the layout's
// order (tensor names as runtime/optimizer_state.h: "<param>.<field>").
//
// Thread safety: plain values and pure functions. No libtorch, so the decoder can be fuzzed
// on its own (fuzz/layer_copy_manifest.cc).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sinew {
namespace runtime {

// The fields of one optimizer's per-parameter state, in order.
struct StateLayout {
  static constexpr size_t kMaxFields = 16;
  std::vector<std::string> fields;  // e.g. {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"}
  int countField = -1;              // the index of the count field ("step"), or -1

  // The mask of every field.
  int64_t allFields() const { return (int64_t{1} << fields.size()) - 1; }
  bool isCount(size_t field) const { return static_cast<int>(field) == countField; }
};

struct LayerCopyManifest {
  // The most parameters one layer's manifest may list.
  static constexpr size_t kMaxParameters = size_t{1} << 20;

  struct Parameter {
    int64_t fields = 0;  // bit i: field i of the layout is present
    int64_t count = 0;   // the count field's value (when present)
  };
  std::vector<Parameter> parameters;
  uint32_t crc32c = 0;

  // Words of the manifest of a layer of `parameters` parameters.
  static size_t encodedWords(size_t parameters) { return 2 * parameters + 1; }

  std::vector<int64_t> encode() const;

  // Decodes the manifest of a layer of `parameters` parameters under `layout` from `count`
  // words. Throws Corruption naming `what` (e.g. "layer 'h3' from worker 2") and the first bad
  // word: a count other than 2n + 1, a field mask with bits beyond the layout's fields, a
  // negative count, a count without the count field, a checksum that is not 32 bits.
  // REQUIRES: layout.fields.size() <= StateLayout::kMaxFields.
  static LayerCopyManifest decode(const int64_t* words, size_t count, size_t parameters,
                                  const StateLayout& layout, const std::string& what);

  // The suffixes of the tensor names that a parameter with field mask `fields` sends, in
  // order: "" (the parameter itself), then ".<field>" for each present tensor field.
  // REQUIRES: fields valid for layout (decode() checked them).
  static std::vector<std::string> tensorSuffixes(int64_t fields, const StateLayout& layout);
};

}  // namespace runtime
}  // namespace sinew
