#pragma once

// Internal to the Gloo backend: the one header every message on a lane starts with
// (docs/collectives.md, "Lanes"). 24 bytes, little-endian like the store's and the frames'
// fields: kind 4, tag 4, seq 8, bytes 8, then `bytes` bytes of payload.
//   kind     what the message is (LaneKind); an unknown value is Corruption
//   tag      an allreduce's dtype (at::ScalarType), a point-to-point message's tag, or a
//            barrier's number
//   seq      the two-member allreduce's operation number (both members count them); 0 otherwise
//   bytes    the payload's length
// A message of another kind than the receiver's call expects means the members' calls do not
// match: InvalidArgument naming both kinds.

#include <cstddef>
#include <cstdint>

#include "sinew/base/little_endian.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {

// The kinds are four ASCII letters each, so that stray bytes are unlikely to pass for one.
enum class LaneKind : uint32_t {
  kAllreduce = 0x4C574E53,     // "SNWL": the two-member allreduce's tensor
  kPointToPoint = 0x50574E53,  // "SNWP": send, recv and exchange
  kBarrier = 0x42574E53,       // "SNWB": 8 bytes to every other member
};

// What a message of this kind is, for errors; null for a value that is no kind.
inline const char* laneKindName(uint32_t kind) {
  switch (static_cast<LaneKind>(kind)) {
    case LaneKind::kAllreduce:
      return "an allreduce's header";
    case LaneKind::kPointToPoint:
      return "a point-to-point message";
    case LaneKind::kBarrier:
      return "a barrier message";
  }
  return nullptr;
}

struct LaneFrame {
  uint32_t kind = 0;  // a LaneKind, unchecked until the receiver looks
  uint32_t tag = 0;
  uint64_t seq = 0;
  uint64_t bytes = 0;

  static constexpr size_t kWireBytes = 24;
  void encode(uint8_t* p) const {
    ::sinew::detail::storeLe(p, kind, 4);
    ::sinew::detail::storeLe(p + 4, tag, 4);
    ::sinew::detail::storeLe(p + 8, seq, 8);
    ::sinew::detail::storeLe(p + 16, bytes, 8);
  }
  static LaneFrame decode(const uint8_t* p) {
    LaneFrame f;
    f.kind = static_cast<uint32_t>(::sinew::detail::loadLe(p, 4));
    f.tag = static_cast<uint32_t>(::sinew::detail::loadLe(p + 4, 4));
    f.seq = ::sinew::detail::loadLe(p + 8, 8);
    f.bytes = ::sinew::detail::loadLe(p + 16, 8);
    return f;
  }
};

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
