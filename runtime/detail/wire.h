#pragma once

// The coordinator's messages (docs/coordinator_protocol.md), carried in frames of service
// kCoordinator of Sinew's one transport (collectives/transport/frame.h: magic, version,
// service, type, length, job token, epoch). The payload is a JSON object whose fields are
// checked per type by decodeBody: required fields present, integers within range, strings
// bounded.
//
// Internal to sinew_runtime; not installed.

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sinew/collectives/transport/frame.h"

namespace sinew {
namespace runtime {
namespace wire {

// Worker ids are below this (ids are never reused, so it bounds the workers a job ever has).
constexpr int64_t kMaxWorkerId = 1 << 24;
// Steps and epochs are below this.
constexpr int64_t kMaxStep = int64_t{1} << 53;

// Message types; their senders, fields and meaning are the table in wire.cc (messageTable()).
enum class Type : uint8_t {
  kHello = 1,
  kWelcome = 2,
  kHeartbeat = 3,
  kLost = 4,
  kVote = 5,
  kCommit = 6,
  kEpoch = 7,
  kDone = 8,
  kExpelled = 9,
  kRebuild = 10,
  kReady = 11,
  kLeave = 12,
  kReleased = 13,
  kPipeline = 14,
  kDurable = 15,
  kRollback = 16,
  kWithdraw = 17,
};

// Largest profile (JSON) a worker may send, and largest plan (JSON) an epoch may carry.
constexpr int64_t kMaxProfileBytes = 1 << 20;
constexpr int64_t kMaxPlanBytes = 32 << 20;

const char* typeName(uint8_t type);
// Types a worker may send (the coordinator's rules) and types the coordinator sends (the
// client's rules); null for the others.
const char* workerTypeName(uint8_t type);
const char* coordinatorTypeName(uint8_t type);

// Frame rules of each side of a coordinator connection.
collectives::transport::FrameRules coordinatorRules(uint64_t token, uint32_t maxBytes);
collectives::transport::FrameRules clientRules(uint64_t token);

// Serialises a message body.
std::vector<uint8_t> encodeBody(const nlohmann::json& body);

// Parses a payload as the JSON object of a message of `type` and checks its fields (see the
// table in wire.cc). Throws Corruption naming the message, the field and the value.
nlohmann::json decodeBody(uint8_t type, const std::vector<uint8_t>& payload);

// The message table as Markdown (type, name, sender, fields with their checked ranges,
// meaning): what docs/coordinator_protocol.md shows, between its "generated" markers.
std::string messageTable();

}  // namespace wire
}  // namespace runtime
}  // namespace sinew
