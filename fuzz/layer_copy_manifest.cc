// Fuzzes the layer copy manifest's decoder (runtime/layer_copy_manifest.h). Input: one byte,
// the layer's parameter count n (0..31), then the manifest's words as little-endian int64
// (zero-filled to a whole word; the word count is whatever the input holds).
// Properties: decode() either throws Corruption or returns n parameters whose flags are valid
// (the tensors they announce are the parameter plus 0, 1, 2 or 3 state tensors), whose step
// counts are non-negative and zero without Adam, and whose encoding is the input's words.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/runtime/layer_copy_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using sinew::runtime::LayerCopyManifest;
  if (size < 1) return 0;
  const size_t n = data[0] % 32;
  std::vector<int64_t> words((size - 1 + 7) / 8, 0);
  for (size_t i = 1; i < size; ++i) {
    words[(i - 1) / 8] |=
        static_cast<int64_t>(static_cast<uint64_t>(data[i]) << (8 * ((i - 1) % 8)));
  }
  LayerCopyManifest m;
  try {
    m = LayerCopyManifest::decode(words.data(), words.size(), n, "a fuzzed layer");
  } catch (const sinew::Corruption&) {
    return 0;
  }
  SINEW_FUZZ_CHECK(m.parameters.size() == n, "%zu parameters, expected %zu", m.parameters.size(),
                   n);
  for (const auto& p : m.parameters) {
    const size_t tensors = LayerCopyManifest::tensorSuffixes(p.flags).size();
    SINEW_FUZZ_CHECK(tensors >= 1 && tensors <= 4, "flags %lld announce %zu tensors",
                     static_cast<long long>(p.flags), tensors);
    SINEW_FUZZ_CHECK(p.step >= 0, "step %lld", static_cast<long long>(p.step));
    SINEW_FUZZ_CHECK((p.flags & LayerCopyManifest::kHasAdam) || p.step == 0,
                     "step %lld without Adam", static_cast<long long>(p.step));
  }
  SINEW_FUZZ_CHECK(m.encode() == words, "the encoding differs from the input's %zu words",
                   words.size());
  return 0;
}
