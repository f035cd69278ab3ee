// Fuzzes a shard layout as received from a peer (checkpoint/replica.cc). The layout decode
// lives in ShardLayout::fromJson (checkpoint/shard.h); the replica service runs it on a
// kBegin message, sizes a HostShard slot by total_bytes (bounded by maxShardBytes), writes
// chunks into it and verifies it at kEnd; a ReplicaClient::get does the same with a
// fetched copy, and restore then copies layers out with extractLayer. The harness does
// these steps without sockets. Input: the layout JSON, a NUL byte, then the shard's bytes
// (zero-filled or cut to total_bytes).
//
// extractLayer is called whether or not verify() passed: a peer computes the checksums of
// whatever bytes it sends, so matching checksums prove nothing about the layout.
// Properties: fromJson either throws sinew::Error or returns a layout that round-trips
// through toJson; nothing else may escape, and extracted tensors have the layout's shapes;
// IncrementalVerify (the replica service's chunk-by-chunk check) agrees with verify(); the
// SSE4.2 crc32c agrees with the portable one.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_check.h"
#include "sinew/base/crc32c.h"
#include "sinew/base/error.h"
#include "sinew/checkpoint/shard.h"

namespace {
// The replica service's options_.maxShardBytes in this harness; larger shards are refused
// before a slot is allocated.
constexpr uint64_t kMaxShardBytes = uint64_t{1} << 20;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sinew::checkpoint;
  {
    // The SSE4.2 crc32c (three interleaved 4 KiB streams from 12 KiB on) against the portable
    // table version, over the input repeated to up to 40 KiB, from an input-chosen offset.
    std::vector<uint8_t> big(size == 0 ? 0 : (size * 37) % 40000);
    for (size_t i = 0; i < big.size(); ++i) big[i] = data[i % size] ^ static_cast<uint8_t>(i >> 12);
    const size_t off = big.empty() ? 0 : data[0] % 8 % (big.size() + 1);
    const uint32_t fast = ::sinew::detail::crc32c(big.data() + off, big.size() - off);
    const uint32_t slow = ::sinew::detail::crc32cPortable(0, big.data() + off, big.size() - off);
    SINEW_FUZZ_CHECK(fast == slow, "crc32c %08x, portable %08x over %zu bytes", fast, slow,
                     big.size() - off);
  }
  const auto* begin = reinterpret_cast<const char*>(data);
  const auto* nul = static_cast<const char*>(std::memchr(begin, '\0', size));
  const std::string json(begin, nul ? nul : begin + size);
  const uint8_t* bytes = nul ? data + (nul - begin) + 1 : data + size;
  const size_t nbytes = static_cast<size_t>(data + size - bytes);

  ShardLayout layout;
  try {
    layout = ShardLayout::fromJson(json);
  } catch (const sinew::Error&) {
    return 0;
  }
  ShardLayout again;
  try {
    again = ShardLayout::fromJson(layout.toJson());
  } catch (const sinew::Error& e) {
    SINEW_FUZZ_CHECK(false, "toJson output does not parse: %s", e.what());
  }
  SINEW_FUZZ_CHECK(again.sameShape(layout), "layout changed in a round trip: %s",
                   layout.toJson().c_str());

  if (layout.totalBytes > kMaxShardBytes) return 0;
  try {
    HostShard shard(layout.totalBytes, false);
    shard.owner = 0;
    shard.step = 1;
    shard.layout = layout;
    std::memcpy(shard.data(), bytes, std::min<uint64_t>(nbytes, layout.totalBytes));
    shard.complete = true;
    // The replica service checks a shard chunk by chunk as it arrives; for any chunking
    // (here from the input's size) it must agree with verify() to the letter.
    const std::string whole = shard.verify();
    IncrementalVerify incremental(shard);
    const uint64_t chunk = 1 + nbytes % 61;
    for (uint64_t off = 0; off < layout.totalBytes;) {
      off = std::min<uint64_t>(layout.totalBytes, off + chunk);
      incremental.advance(off);
    }
    if (layout.totalBytes == 0) incremental.advance(0);
    SINEW_FUZZ_CHECK(incremental.result() == whole, "incremental verify says '%s', verify '%s'",
                     incremental.result().c_str(), whole.c_str());
    for (const auto& name : layout.layers()) {
      (void)shard.verify({name});
      (void)layout.layerDigest(name);
      const RestoredLayer restored = shard.extractLayer(name);
      for (const auto& t : layout.tensors) {
        // A repeated tensor name keeps one tensor; ShardLayout::of never makes one.
        if (t.layer != name ||
            std::count_if(layout.tensors.begin(), layout.tensors.end(), [&](const TensorRecord& u) {
              return u.layer == name && u.name == t.name;
            }) != 1) {
          continue;
        }
        auto x = restored.find(t.name);
        SINEW_FUZZ_CHECK(x != restored.end(), "layer %s lacks tensor %s", name.c_str(),
                         t.name.c_str());
        SINEW_FUZZ_CHECK(x->second.sizes().vec() == t.shape, "layer %s tensor %s: shape differs",
                         name.c_str(), t.name.c_str());
      }
    }
  } catch (const sinew::Error&) {
  }
  return 0;
}
