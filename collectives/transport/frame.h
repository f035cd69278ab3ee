#pragma once

// The frame header of Sinew's one wire transport (docs/transport.md). Every Sinew port (the
// rendezvous store, the coordinator, the replica service, layer copies) speaks frames:
//
//   offset size field
//        0    4 magic "SNWF" (0x46574E53 little-endian)
//        4    1 version (1)
//        5    1 service: which port this frame is for (Service below)
//        6    1 type: the service's message type
//        7    1 flags: 0
//        8    4 payload length in bytes
//       12    4 reserved: 0
//       16    8 job token
//       24    8 epoch (i64; services without epochs send 0)
//
// then `payload length` bytes. Integers are little-endian. A receiver checks every field of
// the header (parseFrameHeader), the token included, before it allocates anything for the
// payload, so a stranger on the port can cost it no more than 32 bytes and a timer.
//
// Internal to Sinew; not installed. Thread safety: pure functions.

#include <cstddef>
#include <cstdint>
#include <string>

namespace sinew {
namespace collectives {
namespace transport {

constexpr uint32_t kFrameMagic = 0x46574E53;  // "SNWF" as little-endian bytes
constexpr uint8_t kFrameVersion = 1;
constexpr size_t kFrameHeaderBytes = 32;

enum class Service : uint8_t {
  kStore = 1,
  kCoordinator = 2,
  kReplica = 3,
  // 4 is unused: layer copies travel on a pipeline communicator's lanes.
  kLane = 5,  // a Gloo communicator's direct data connections (collectives/gloo/lanes.h)
};

// "store", "coordinator", ... or null for an unknown service.
const char* serviceName(uint8_t service);

struct FrameHeader {
  Service service = Service::kStore;
  uint8_t type = 0;
  uint32_t length = 0;
  uint64_t token = 0;
  int64_t epoch = 0;
};

// What a receiver accepts.
struct FrameRules {
  Service service = Service::kStore;
  // The job token every frame must carry. 0 is never a valid token.
  uint64_t token = 0;
  // The name of a message type of this service, or null if the type is unknown (REQUIRED).
  const char* (*typeName)(uint8_t type) = nullptr;
  // Largest payload of any frame.
  uint32_t maxPayloadBytes = 1u << 20;
  // Optional per-type limit (below maxPayloadBytes); null: maxPayloadBytes for every type.
  uint32_t (*maxPayloadOf)(uint8_t type) = nullptr;
};

// Writes the 32-byte header of h to out.
void encodeFrameHeader(const FrameHeader& h, uint8_t* out);

// Checks and decodes a 32-byte header: magic, version, service, token, type, flags,
// reserved bytes and length, in that order. Throws Corruption naming the first field that is
// wrong and its value (never the expected token).
FrameHeader parseFrameHeader(const uint8_t* data, const FrameRules& rules);

// "store set", "coordinator vote", ...: for messages.
std::string frameName(const FrameRules& rules, uint8_t type);

}  // namespace transport
}  // namespace collectives
}  // namespace sinew
