#pragma once

// What a checkpoint holds. A worker's shard is the layers it holds (parameters and
// optimizer state), keyed by layer name, never by rank, so any plan can restore it
// (docs/architecture.md section 5). In host memory a shard is one contiguous byte range laid out
// exactly like the data section of its safetensors file (docs/checkpoint_format.md):
// tensors back to back in the order given, with no padding.
//
// Thread safety: plain values; a HostShard is immutable once published (complete) and may
// be read from any thread.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace sinew {
namespace checkpoint {

// One tensor of a layer: a parameter ("weight") or optimizer state ("weight.exp_avg").
struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

struct LayerState {
  std::string name;  // Unique in the model; must not contain '/'.
  std::vector<NamedTensor> tensors;
};

// The state a worker checkpoints, in a stable order.
using ShardState = std::vector<LayerState>;

// A layer restored to host memory: tensor name → CPU tensor (owning its memory).
using RestoredLayer = std::map<std::string, at::Tensor>;

struct TensorRecord {
  std::string layer;
  std::string name;
  std::string dtype;  // safetensors code: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // In the shard's data section.
  uint64_t nbytes = 0;
  uint32_t crc32c = 0;  // Of the tensor's bytes; filled when the copy is taken.
};

struct ShardLayout {
  std::vector<TensorRecord> tensors;  // In data order.
  uint64_t totalBytes = 0;

  // Layout of state (crc32c left 0). Throws InvalidArgument naming the layer and tensor
  // for an unsupported dtype, an undefined or nameless tensor, a '/' in a layer name or a
  // duplicate.
  static ShardLayout of(const ShardState& state);
  // Same tensors, dtypes, shapes and offsets (checksums ignored).
  bool sameShape(const ShardLayout& other) const;
  // The byte ranges (offset, bytes) of the tensors whose checksum differs from `base`'s, in
  // order, adjacent ones merged: what an incremental replica of this version must send to a
  // holder of `base` (unchanged up to crc32c collisions). REQUIRES: sameShape(base).
  std::vector<std::pair<uint64_t, uint64_t>> changedSince(const ShardLayout& base) const;
  // The layout of the shard made of the named layers' tensors only (in this layout's order,
  // back to back from offset 0, checksums kept; names it lacks are skipped), and in `ranges`
  // where their bytes lie in this shard, in order, adjacent ones merged: what a peer sends
  // for a restore that wants only those layers.
  ShardLayout onlyLayers(const std::vector<std::string>& layers,
                         std::vector<std::pair<uint64_t, uint64_t>>* ranges) const;
  std::vector<std::string> layers() const;  // In order, each once.
  bool hasLayer(const std::string& layer) const;
  // A digest of the layer's tensor checksums, dtypes and shapes: equal digests mean
  // unchanged bytes (up to crc32c collisions); used by incremental checkpoints.
  uint32_t layerDigest(const std::string& layer) const;

  std::string toJson() const;
  // Decodes and validates (validateShardLayout against its own totalBytes) a layout that
  // may come from a peer. Throws Corruption naming the field and value if malformed.
  static ShardLayout fromJson(const std::string& json);
};

// Bytes of a tensor of this dtype and shape (numel * element size, overflow-checked).
// Throws Corruption naming `what` and the value for an unknown dtype, a negative
// dimension, more than 64 dimensions or a size that overflows 64 bits.
uint64_t tensorBytes(const std::string& safetensorsDtype, const std::vector<int64_t>& shape,
                     const std::string& what);

// Checks a layout that came from outside this process (a peer, a file) before any byte is
// read through it: known dtypes, non-negative shapes, nbytes == numel * element size,
// tensors back to back from offset 0 in order (no holes, no overlaps, no overflow), each
// layer's tensors together and each (layer, tensor) once, layer names non-empty without '/',
// totalBytes equal to the tensors' sum and within bufferBytes. Throws Corruption whose
// message starts with `what` and names the tensor, the field and its value.
void validateShardLayout(const ShardLayout& layout, uint64_t bufferBytes, const std::string& what);

// "[32, 64]", for messages.
std::string shapeString(const std::vector<int64_t>& shape);

// safetensors dtype code of an ATen dtype, and back. InvalidArgument if unsupported.
std::string safetensorsDtype(at::ScalarType type);
at::ScalarType scalarTypeOf(const std::string& safetensorsDtype);
size_t elementSize(const std::string& safetensorsDtype);

// Host bytes of one version of one worker's shard: a slot of a SnapshotArena or of a
// ReplicaService. Shared by whoever reads it (replication, flush, restore); the owner
// reuses the memory only after every reader has dropped its reference.
class HostShard {
 public:
  // Allocates capacity bytes of host memory and touches every page, so resident memory
  // is fixed from the start. pinned asks for page-locked memory (CUDA hosts only).
  HostShard(uint64_t capacity, bool pinned);
  HostShard(const HostShard&) = delete;
  HostShard& operator=(const HostShard&) = delete;

  int owner = -1;
  int64_t step = -1;
  bool complete = false;
  ShardLayout layout;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  uint64_t capacity() const { return capacity_; }

  // Checks the layout against the held memory (validateShardLayout with capacity()), then
  // recomputes every tensor's crc32c over the held bytes and compares with the layout;
  // returns "" if all match, else a message naming the layer, tensor and both checksums
  // (or what is wrong with the layout). Checks only the given layers' checksums if the
  // list is not empty.
  std::string verify(const std::vector<std::string>& layers = {}) const;
  // Copies a layer out into new CPU tensors. REQUIRES: layout.hasLayer(layer). Throws
  // Corruption if a tensor's size disagrees with its shape or lies outside the memory.
  RestoredLayer extractLayer(const std::string& layer) const;

 private:
  std::unique_ptr<uint8_t, void (*)(uint8_t*)> buffer_;
  at::Tensor pinned_;  // Owns the memory when pinned.
  uint8_t* data_ = nullptr;
  uint64_t capacity_ = 0;
};

// Checks a shard's checksums while its bytes arrive in order, as a replica is received: the
// crc32c of each tensor is extended as each chunk lands (the chunk is still in cache, and
// the check overlaps the rest of the transfer instead of following it). result() then says
// what shard.verify() would, without reading the shard again.
class IncrementalVerify {
 public:
  // REQUIRES: shard.layout was validated against shard.capacity() (ShardLayout::fromJson and
  // a slot of at least totalBytes); shard outlives this.
  explicit IncrementalVerify(const HostShard& shard);
  // The bytes [0, receivedUpTo) of the shard have arrived (non-decreasing calls).
  void advance(uint64_t receivedUpTo);
  // REQUIRES: advance(layout.totalBytes) was called. "" if every tensor matched, else
  // verify()'s message for the first that did not (in layout order).
  std::string result() const;

 private:
  const HostShard& shard_;
  std::vector<size_t> byOffset_;  // Tensor indices in offset order.
  std::vector<uint32_t> crc_;     // Running crc32c of each tensor, by layout index.
  std::vector<uint64_t> done_;    // Bytes of each tensor hashed so far.
  size_t first_ = 0;              // byOffset_ position of the first unfinished tensor.
  uint64_t received_ = 0;
};

std::string hex32(uint32_t v);  // "0x1f2e3d4c"

}  // namespace checkpoint
}  // namespace sinew
