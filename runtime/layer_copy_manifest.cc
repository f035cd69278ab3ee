#include "sinew/runtime/layer_copy_manifest.h"

#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

std::vector<int64_t> LayerCopyManifest::encode() const {
  const size_t n = parameters.size();
  std::vector<int64_t> words(encodedWords(n), 0);
  for (size_t i = 0; i < n; ++i) {
    words[i] = parameters[i].flags;
    words[n + i] = parameters[i].step;
  }
  words[2 * n] = static_cast<int64_t>(crc32c);
  return words;
}

LayerCopyManifest LayerCopyManifest::decode(const int64_t* words, size_t count, size_t parameters,
                                            const std::string& what) {
  if (parameters > kMaxParameters || count != encodedWords(parameters)) {
    SINEW_THROW(Corruption, "the manifest of ", what, " has ", count, " words; a layer of ",
                parameters, " parameters needs ", encodedWords(parameters));
  }
  LayerCopyManifest m;
  m.parameters.resize(parameters);
  for (size_t i = 0; i < parameters; ++i) {
    const int64_t flags = words[i];
    const int64_t step = words[parameters + i];
    const bool adam = (flags & kHasAdam) != 0;
    if (flags < 0 || flags > (kHasAdam | kHasMaxSq | kHasMomentum) ||
        ((flags & kHasMaxSq) && !adam) || ((flags & kHasMomentum) && adam)) {
      SINEW_THROW(Corruption, "the manifest of ", what, " has flags ", flags, " for parameter ", i);
    }
    if (step < 0 || (!adam && step != 0)) {
      SINEW_THROW(Corruption, "the manifest of ", what, " has step count ", step, " for parameter ",
                  i, adam ? "" : ", which has no Adam state");
    }
    m.parameters[i] = {flags, step};
  }
  const int64_t crc = words[2 * parameters];
  if (crc < 0 || crc > int64_t{0xFFFFFFFF}) {
    SINEW_THROW(Corruption, "the manifest of ", what, " has checksum word ", crc, ", not a crc32c");
  }
  m.crc32c = static_cast<uint32_t>(crc);
  return m;
}

std::vector<std::string> LayerCopyManifest::tensorSuffixes(int64_t flags) {
  std::vector<std::string> out{""};
  if (flags & kHasAdam) {
    out.push_back(".exp_avg");
    out.push_back(".exp_avg_sq");
  }
  if (flags & kHasMaxSq) out.push_back(".max_exp_avg_sq");
  if (flags & kHasMomentum) out.push_back(".momentum_buffer");
  return out;
}

}  // namespace runtime
}  // namespace sinew
