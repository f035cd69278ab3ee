// Fuzzes the replica service's message decoders (checkpoint/detail/replica_wire.h): a begin
// (owner, step, shard layout), a get (owner, step), a list reply and a get of some layers
// (owner, step, their names), as the service and a
// client run them on payloads that passed the frame header. Input: one byte choosing the
// decoder, then the payload.
// Properties: each decoder throws Corruption or returns owners and steps >= 0, layouts within
// the service's shard limit, and values that encode back to an equivalent message.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/checkpoint/detail/replica_wire.h"

namespace {
constexpr uint64_t kMaxShardBytes = uint64_t{1} << 30;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace rw = sinew::checkpoint::replica_wire;
  if (size == 0) return 0;
  const std::vector<uint8_t> payload(data + 1, data + size);
  try {
    switch (data[0] % 4) {
      case 0: {
        const rw::BeginRequest b = rw::decodeBegin(payload, kMaxShardBytes);
        SINEW_FUZZ_CHECK(b.owner >= 0 && b.step >= 0, "begin owner %d step %lld", b.owner,
                         static_cast<long long>(b.step));
        SINEW_FUZZ_CHECK(b.layout.totalBytes <= kMaxShardBytes, "shard of %llu bytes accepted",
                         static_cast<unsigned long long>(b.layout.totalBytes));
        std::vector<uint8_t> again = rw::encodeShardId(b.owner, b.step);
        const std::string layout = b.layout.toJson();
        again.insert(again.end(), layout.begin(), layout.end());
        const rw::BeginRequest c = rw::decodeBegin(again, kMaxShardBytes);
        SINEW_FUZZ_CHECK(c.owner == b.owner && c.step == b.step && c.layout.sameShape(b.layout),
                         "begin does not round-trip");
        break;
      }
      case 1: {
        int owner = -1;
        int64_t step = -1;
        rw::decodeShardId(payload, payload.size(), &owner, &step, "get");
        SINEW_FUZZ_CHECK(owner >= 0 && step >= 0, "get owner %d step %lld", owner,
                         static_cast<long long>(step));
        SINEW_FUZZ_CHECK(rw::encodeShardId(owner, step) == payload, "get does not round-trip");
        break;
      }
      case 3: {
        int owner = -1;
        int64_t step = -1;
        const std::vector<std::string> layers = rw::decodeGetLayers(payload, &owner, &step);
        SINEW_FUZZ_CHECK(
            owner >= 0 && step >= 0 && !layers.empty() && layers.size() <= rw::kMaxGetLayers,
            "get layers owner %d step %lld, %zu layers", owner, static_cast<long long>(step),
            layers.size());
        for (const auto& l : layers) SINEW_FUZZ_CHECK(!l.empty(), "an empty layer name accepted");
        int o2 = -1;
        int64_t s2 = -1;
        SINEW_FUZZ_CHECK(
            rw::decodeGetLayers(rw::encodeGetLayers(owner, step, layers), &o2, &s2) == layers &&
                o2 == owner && s2 == step,
            "get layers does not round-trip");
        break;
      }
      default: {
        const std::vector<rw::ShardEntry> list = rw::decodeList(payload, "fuzz peer");
        for (const auto& e : list) {
          SINEW_FUZZ_CHECK(e.owner >= 0 && e.step >= 0, "list owner %d step %lld", e.owner,
                           static_cast<long long>(e.step));
        }
        const std::vector<rw::ShardEntry> again = rw::decodeList(rw::encodeList(list), "fuzz peer");
        SINEW_FUZZ_CHECK(again.size() == list.size(), "list does not round-trip");
        for (size_t i = 0; i < list.size(); ++i) {
          SINEW_FUZZ_CHECK(again[i].owner == list[i].owner && again[i].step == list[i].step &&
                               again[i].layout.sameShape(list[i].layout),
                           "list entry %zu does not round-trip", i);
        }
        break;
      }
    }
  } catch (const sinew::Corruption&) {
  }
  return 0;
}
