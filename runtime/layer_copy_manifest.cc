#include "sinew/runtime/layer_copy_manifest.h"

#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

std::vector<int64_t> LayerCopyManifest::encode() const {
  const size_t n = parameters.size();
  std::vector<int64_t> words(encodedWords(n), 0);
  for (size_t i = 0; i < n; ++i) {
    words[i] = parameters[i].fields;
    words[n + i] = parameters[i].count;
  }
  words[2 * n] = static_cast<int64_t>(crc32c);
  return words;
}

LayerCopyManifest LayerCopyManifest::decode(const int64_t* words, size_t count, size_t parameters,
                                            const StateLayout& layout, const std::string& what) {
  if (parameters > kMaxParameters || count != encodedWords(parameters)) {
    SINEW_THROW(Corruption, "the manifest of ", what, " has ", count, " words; a layer of ",
                parameters, " parameters needs ", encodedWords(parameters));
  }
  const int64_t countBit = layout.countField < 0 ? 0 : int64_t{1} << layout.countField;
  LayerCopyManifest m;
  m.parameters.resize(parameters);
  for (size_t i = 0; i < parameters; ++i) {
    const int64_t fields = words[i];
    const int64_t value = words[parameters + i];
    if (fields < 0 || (fields & ~layout.allFields()) != 0) {
      SINEW_THROW(Corruption, "the manifest of ", what, " has field mask ", fields,
                  " for parameter ", i, "; the optimizer's state has ", layout.fields.size(),
                  " fields");
    }
    if (value < 0 || ((fields & countBit) == 0 && value != 0)) {
      SINEW_THROW(Corruption, "the manifest of ", what, " has count ", value, " for parameter ", i,
                  (fields & countBit) != 0 ? "" : ", whose state has no count");
    }
    m.parameters[i] = {fields, value};
  }
  const int64_t crc = words[2 * parameters];
  if (crc < 0 || crc > int64_t{0xFFFFFFFF}) {
    SINEW_THROW(Corruption, "the manifest of ", what, " has checksum word ", crc, ", not a crc32c");
  }
  m.crc32c = static_cast<uint32_t>(crc);
  return m;
}

std::vector<std::string> LayerCopyManifest::tensorSuffixes(int64_t fields,
                                                           const StateLayout& layout) {
  std::vector<std::string> out{""};
  for (size_t i = 0; i < layout.fields.size(); ++i) {
    if ((fields & (int64_t{1} << i)) != 0 && !layout.isCount(i)) {
      out.push_back("." + layout.fields[i]);
    }
  }
  return out;
}

}  // namespace runtime
}  // namespace sinew
