// Fuzzes reading a durable checkpoint (checkpoint/persist.h, restore.h) over an in-memory
// Env. The input is a small folder of files, each introduced by a line "@@ <path>" (path
// relative to the checkpoint folder) and running to the next such line:
//
//   @@ LATEST
//   {"step":1,"manifest":"step-00000001/manifest.json","manifest_crc32c":"0x..."}
//   @@ step-00000001/manifest.json
//   {...}
//   @@ step-00000001/shard-w0.safetensors
//   <8-byte header length><header JSON><tensor bytes>
//
// The harness runs what a restart does: LATEST, the durable versions, each version's
// manifest, loading every layer (reads and verifies every tensor) and restoreLayers from
// disk. Any of them may throw sinew::Error; nothing else may escape, and loaded tensors
// must have the manifest's shapes and dtypes.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_check.h"
#include "memory_env.h"
#include "sinew/base/error.h"
#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/restore.h"

namespace {

using namespace sinew::checkpoint;

constexpr const char* kDir = "ckpt";
constexpr size_t kMaxFiles = 16;
constexpr size_t kMaxVersions = 4;

void addFiles(const std::string& input, fuzzing::MemoryEnv* env) {
  const std::string marker = "@@ ";
  size_t pos = input.compare(0, marker.size(), marker) == 0 ? 0 : input.find("\n" + marker);
  if (pos != 0 && pos != std::string::npos) ++pos;  // Skip the newline.
  size_t count = 0;
  while (pos != std::string::npos && count++ < kMaxFiles) {
    const size_t nameStart = pos + marker.size();
    const size_t nameEnd = input.find('\n', nameStart);
    if (nameEnd == std::string::npos) break;
    const size_t next = input.find("\n" + marker, nameEnd);
    const size_t end = next == std::string::npos ? input.size() : next;
    env->files()[joinPath(kDir, input.substr(nameStart, nameEnd - nameStart))] =
        input.substr(nameEnd + 1, end > nameEnd ? end - nameEnd - 1 : 0);
    pos = next == std::string::npos ? next : next + 1;
  }
}

void checkLoaded(const Manifest& m, const std::map<std::string, RestoredLayer>& loaded) {
  for (const auto& kv : loaded) {
    auto it = m.layers.find(kv.first);
    SINEW_FUZZ_CHECK(it != m.layers.end(), "loaded layer %s is not in the manifest",
                     kv.first.c_str());
    for (const auto& t : it->second.tensors) {
      auto x = kv.second.find(t.name);
      SINEW_FUZZ_CHECK(x != kv.second.end(), "layer %s lacks tensor %s", kv.first.c_str(),
                       t.name.c_str());
      SINEW_FUZZ_CHECK(x->second.sizes().vec() == t.shape, "layer %s tensor %s: shape differs",
                       kv.first.c_str(), t.name.c_str());
      SINEW_FUZZ_CHECK(safetensorsDtype(x->second.scalar_type()) == t.dtype,
                       "layer %s tensor %s: dtype differs", kv.first.c_str(), t.name.c_str());
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzzing::MemoryEnv env;
  addFiles(std::string(reinterpret_cast<const char*>(data), size), &env);
  CheckpointReader reader(kDir, &env);

  std::vector<int64_t> steps;
  try {
    const int64_t latest = reader.latestStep();
    if (latest >= 0) steps.push_back(latest);
  } catch (const sinew::Error&) {
  }
  try {
    for (int64_t s : reader.durableSteps()) steps.push_back(s);
  } catch (const sinew::Error&) {
  }
  if (steps.size() > kMaxVersions) steps.resize(kMaxVersions);

  for (int64_t step : steps) {
    std::vector<std::string> layers;
    try {
      const Manifest m = reader.manifest(step);
      for (const auto& kv : m.layers) layers.push_back(kv.first);
      checkLoaded(m, reader.load(step));
    } catch (const sinew::Error&) {
    }
    if (layers.empty()) continue;
    try {
      RestoreSources sources;
      sources.dir = kDir;
      sources.env = &env;
      restoreLayers(sources, step, layers);
    } catch (const sinew::Error&) {
    }
  }
  return 0;
}
