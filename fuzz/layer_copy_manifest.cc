// Fuzzes the layer copy manifest's decoder (runtime/layer_copy_manifest.h). Input: one byte,
// the layer's parameter count n (its value modulo 32) and the optimizer's state layout (its
// value / 32 modulo 3: SGD's, Adam's, RMSprop's), then the manifest's words as little-endian
// int64 (zero-filled to a whole word; the word count is whatever the input holds).
// Properties: decode() either throws Corruption or returns n parameters whose field masks lie
// within the layout (the tensors they announce are the parameter plus at most the layout's
// tensor fields), whose counts are non-negative and zero without the count field, and whose
// encoding is the input's words.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/runtime/layer_copy_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using sinew::runtime::LayerCopyManifest;
  using sinew::runtime::StateLayout;
  if (size < 1) return 0;
  const size_t n = data[0] % 32;
  StateLayout layout;
  switch ((data[0] / 32) % 3) {
    case 0:
      layout.fields = {"momentum_buffer"};
      break;
    case 1:
      layout.fields = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"};
      layout.countField = 3;
      break;
    default:
      layout.fields = {"square_avg", "momentum_buffer", "grad_avg", "step"};
      layout.countField = 3;
      break;
  }
  const size_t tensorFields = layout.fields.size() - (layout.countField >= 0 ? 1 : 0);
  const int64_t countBit = layout.countField >= 0 ? int64_t{1} << layout.countField : 0;
  std::vector<int64_t> words((size - 1 + 7) / 8, 0);
  for (size_t i = 1; i < size; ++i) {
    words[(i - 1) / 8] |=
        static_cast<int64_t>(static_cast<uint64_t>(data[i]) << (8 * ((i - 1) % 8)));
  }
  LayerCopyManifest m;
  try {
    m = LayerCopyManifest::decode(words.data(), words.size(), n, layout, "a fuzzed layer");
  } catch (const sinew::Corruption&) {
    return 0;
  }
  SINEW_FUZZ_CHECK(m.parameters.size() == n, "%zu parameters, expected %zu", m.parameters.size(),
                   n);
  for (const auto& p : m.parameters) {
    const size_t tensors = LayerCopyManifest::tensorSuffixes(p.fields, layout).size();
    SINEW_FUZZ_CHECK(tensors >= 1 && tensors <= 1 + tensorFields,
                     "field mask %lld announces %zu tensors", static_cast<long long>(p.fields),
                     tensors);
    SINEW_FUZZ_CHECK((p.fields & ~layout.allFields()) == 0, "field mask %lld beyond the layout",
                     static_cast<long long>(p.fields));
    SINEW_FUZZ_CHECK(p.count >= 0, "count %lld", static_cast<long long>(p.count));
    SINEW_FUZZ_CHECK((p.fields & countBit) != 0 || p.count == 0, "count %lld without its field",
                     static_cast<long long>(p.count));
  }
  SINEW_FUZZ_CHECK(m.encode() == words, "the encoding differs from the input's %zu words",
                   words.size());
  return 0;
}
