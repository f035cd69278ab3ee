#pragma once

// Restore of layers at one version from the cheapest place that has them intact
// (docs/architecture.md section 5): this process's RAM (its own snapshot and the replicas it
// holds), then peers' RAM, then disk. Every tensor's crc32c is checked; a mismatch (or an
// unreachable peer) moves on to the next source and is reported in `fellThrough`. Layers
// are found by name, so any number of workers can restore any plan.
//
// Thread safety: restoreLayers may be called from any thread; it only reads its sources.

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sinew/checkpoint/env.h"
#include "sinew/checkpoint/replica.h"
#include "sinew/checkpoint/shard.h"

namespace sinew {
namespace checkpoint {

struct RestoreSources {
  // Shards in this process's RAM (own snapshots and held replicas), any versions.
  std::vector<std::shared_ptr<const HostShard>> local;
  // Peers' replica services: (worker id, "host:port"), in the order to try them.
  std::vector<std::pair<int, std::string>> peers;
  ReplicaClientOptions client;  // Use a short connectTimeout: dead peers refuse.
  std::string dir;              // Checkpoint folder; empty for none.
  Env* env = nullptr;           // Null: posixEnv().
};

struct RestoreResult {
  int64_t step = -1;
  std::map<std::string, RestoredLayer> layers;
  // Per layer: "local", "peer <worker>" or "disk <file>".
  std::map<std::string, std::string> source;
  // Why a source was passed over: checksum mismatches, lost peers, missing versions.
  std::vector<std::string> fellThrough;
};

// Restores `layers` of version step. Throws IoError naming the layers no source had
// intact (with the reasons in the message), or Corruption if the reason was only checksum
// mismatches.
RestoreResult restoreLayers(const RestoreSources& sources, int64_t step,
                            const std::vector<std::string>& layers);

}  // namespace checkpoint
}  // namespace sinew
