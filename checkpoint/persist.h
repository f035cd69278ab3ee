#pragma once

// Durable checkpoints on disk (docs/architecture.md section 5; the format is
// docs/checkpoint_format.md): one safetensors file per shard and a JSON manifest per version in
// <dir>/step-<s>/, and a LATEST file naming the newest durable version.
//
// Writing follows LevelDB's rules: every file is written to a temp name, fsynced, renamed
// and its folder fsynced; LATEST moves only after the version's shard files and manifest
// are durable; an old version is deleted only after a newer one is durable, keeping the
// newest `keep`. So a crash at any point leaves LATEST naming a complete version.
//
// Incremental mode (Check-N-Run): a shard file holds only the layers whose digest
// (tensor checksums, dtypes, shapes) changed since the previous durable version; the
// manifest points at the older files for the others, and retention keeps every file a
// kept manifest points at.
//
// Thread safety: a CheckpointWriter is used by one thread at a time (the engine's flush
// thread); CheckpointReader methods may be called from any thread.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sinew/checkpoint/env.h"
#include "sinew/checkpoint/shard.h"

namespace sinew {
namespace checkpoint {

struct PersistOptions {
  std::string dir;
  Env* env = nullptr;  // Null: posixEnv().
  int keep = 2;        // Newest durable versions kept, at least 1.
  bool incremental = false;
  // Tensors stored once (parameters tied across layers, ModelSpec::tied): "layer/param" ->
  // "layer/param". A tensor of a shard's layer F named P, or P.<field> (its optimizer state,
  // docs/checkpoint_format.md), where sameAs has "F/P" -> "O/Q", is not written: the manifest
  // records that it is tensor Q (Q.<field>) of layer O of the same version, and a reader gets
  // that tensor's bytes (the manifest reader checks that the version stores the target). The
  // caller promises that the two are one tensor: the same dtype, shape and values.
  std::map<std::string, std::string> sameAs;
  // Test hook, called at named points of a flush ("shard-durable", "manifest-durable",
  // "latest-durable"), e.g. to kill the writer between the shard file and the manifest.
  std::function<void(const std::string& point)> onPoint;
};

// Where one layer of a version lives on disk, as the manifest records it.
struct LayerLocation {
  int owner = -1;
  std::string file;                   // Relative to the checkpoint folder.
  uint32_t digest = 0;                // ShardLayout::layerDigest.
  std::vector<TensorRecord> tensors;  // offset = data_offsets[0] within that file's data.
  // Tensors of this layer stored once elsewhere in the version (PersistOptions::sameAs):
  // tensor name -> "<layer>/<tensor>" of a tensor in that layer's `tensors`.
  std::map<std::string, std::string> sameAs;
};

// A shard written for one version: the manifest entries it contributes.
struct ShardFileRecord {
  int owner = -1;
  int64_t step = -1;
  std::string file;  // "" when incremental mode found nothing changed.
  uint64_t fileBytes = 0;
  uint32_t fileCrc32c = 0;
  std::map<std::string, LayerLocation> layers;

  std::string toJson() const;  // For sending to the manifest writer through a Store.
  static ShardFileRecord fromJson(const std::string& json);
};

struct Manifest {
  int64_t step = -1;
  // file → (bytes, crc32c) of every file the version reads, including older ones.
  std::map<std::string, std::pair<uint64_t, uint32_t>> files;
  std::map<std::string, LayerLocation> layers;
  std::string toJson() const;
  static Manifest fromJson(const std::string& json, const std::string& path);
};

class CheckpointWriter {
 public:
  explicit CheckpointWriter(PersistOptions options);

  // Writes shard's file for its version durably and returns its manifest entries.
  // Throws IoError from the Env.
  ShardFileRecord writeShard(const HostShard& shard);
  // Writes the manifest of step from every shard's record, moves LATEST to it, then
  // deletes versions beyond the newest `keep`. REQUIRES: each record's shard file is durable.
  void commitVersion(int64_t step, const std::vector<ShardFileRecord>& shards);
  // writeShard for each shard, then commitVersion: a flush by one process.
  void flush(const std::vector<std::shared_ptr<const HostShard>>& shards);

  const std::string& dir() const { return options_.dir; }

 private:
  void collectGarbage();
  const PersistOptions options_;
  Env* const env_;  // Options' env or posixEnv(); both outlive the writer.
};

class CheckpointReader {
 public:
  explicit CheckpointReader(std::string dir, Env* env = nullptr);

  // The version LATEST names, or -1 if there is none. Corruption if LATEST or the
  // manifest it names is damaged (naming the file and both checksums).
  int64_t latestStep() const;
  // Versions with a manifest, newest first.
  std::vector<int64_t> durableSteps() const;
  Manifest manifest(int64_t step) const;

  // Reads the given layers (all if empty) of version step, verifying every tensor's
  // crc32c. Throws Corruption naming the file, layer, tensor and expected and actual
  // checksums (or the file's actual and expected size if it is truncated), and
  // InvalidArgument for a layer the version does not have.
  std::map<std::string, RestoredLayer> load(int64_t step,
                                            const std::vector<std::string>& layers = {}) const;

 private:
  const std::string dir_;
  Env* const env_;
};

// Makes LATEST name version `step` (whose manifest must exist), under the writers' lock,
// whatever it named before: for a restore that found LATEST's version damaged and fell back to
// an older one (docs/failure_semantics.md, rules 5 and 8). env null: the POSIX file system.
void repointLatest(const std::string& dir, Env* env, int64_t step);

std::string versionDirName(int64_t step);  // "step-00000012"
std::string shardFileName(int owner);      // "shard-w3.safetensors"

}  // namespace checkpoint
}  // namespace sinew
