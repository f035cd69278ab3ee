#include "sinew/checkpoint/restore.h"

#include <set>

#include "sinew/base/error.h"
#include "sinew/checkpoint/persist.h"

namespace sinew {
namespace checkpoint {

RestoreResult restoreLayers(const RestoreSources& sources, int64_t step,
                            const std::vector<std::string>& layers) {
  RestoreResult result;
  result.step = step;
  std::set<std::string> wanted(layers.begin(), layers.end());
  bool sawCorruption = false;

  // Takes what it can from one shard; a checksum mismatch rejects the shard's layers.
  auto takeFrom = [&](const HostShard& shard, const std::string& source) {
    std::vector<std::string> here;
    for (const auto& l : shard.layout.layers()) {
      if (wanted.count(l) != 0) here.push_back(l);
    }
    if (here.empty()) return;
    std::string bad = shard.verify(here);
    if (!bad.empty()) {
      sawCorruption = true;
      result.fellThrough.push_back(source + ": " + bad);
      return;
    }
    for (const auto& l : here) {
      result.layers[l] = shard.extractLayer(l);
      result.source[l] = source;
      wanted.erase(l);
    }
  };

  // 1. Own RAM.
  for (const auto& s : sources.local) {
    if (wanted.empty()) break;
    if (s && s->complete && s->step == step) takeFrom(*s, "local");
  }
  // 2. Peers' RAM.
  for (const auto& peer : sources.peers) {
    if (wanted.empty()) break;
    const std::string name = "peer " + std::to_string(peer.first);
    try {
      ReplicaClient client(peer.first, peer.second, sources.client);
      for (const auto& info : client.list()) {
        if (wanted.empty()) break;
        if (info.step != step) continue;
        std::vector<std::string> here;  // Only these layers of the shard come over.
        for (const auto& l : info.layout.layers()) {
          if (wanted.count(l) != 0) here.push_back(l);
        }
        if (here.empty()) continue;
        auto shard = client.get(info.owner, info.step, here);
        takeFrom(*shard, name);
      }
    } catch (const Error& e) {
      result.fellThrough.push_back(name + ": " + e.what());
    }
  }
  // 3. Disk.
  if (!wanted.empty() && !sources.dir.empty()) {
    CheckpointReader reader(sources.dir, sources.env);
    try {
      const Manifest m = reader.manifest(step);
      for (const auto& l : std::vector<std::string>(wanted.begin(), wanted.end())) {
        auto it = m.layers.find(l);
        if (it == m.layers.end()) continue;
        try {
          auto got = reader.load(step, {l});
          result.layers[l] = std::move(got.at(l));
          result.source[l] = "disk " + it->second.file;
          wanted.erase(l);
        } catch (const Corruption& e) {
          sawCorruption = true;
          result.fellThrough.push_back(std::string("disk: ") + e.what());
        }
      }
    } catch (const Error& e) {
      result.fellThrough.push_back(std::string("disk: ") + e.what());
    }
  }
  if (!wanted.empty()) {
    std::string missing, why;
    for (const auto& l : wanted) missing += (missing.empty() ? "" : ", ") + l;
    for (const auto& w : result.fellThrough) why += "; " + w;
    if (sawCorruption) {
      SINEW_THROW(Corruption, "restore of version ", step, ": no intact copy of layers ", missing,
                  why);
    }
    SINEW_THROW(IoError, "restore of version ", step, ": no source holds layers ", missing, why);
  }
  return result;
}

}  // namespace checkpoint
}  // namespace sinew
