#pragma once

// The coordinator's wire format (docs/coordinator_protocol.md): a 28-byte header
//   u32 magic "SNCO" | u8 version | u8 type | u16 zero | u32 payload bytes |
//   u64 job token | i64 epoch
// then a JSON object of `payload bytes` (UTF-8). Integers are little-endian.
//
// Internal to sinew_runtime; not installed.

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sinew {
namespace runtime {
namespace wire {

constexpr uint32_t kMagic = 0x4F434E53;  // "SNCO" as little-endian bytes
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderBytes = 28;

enum class Type : uint8_t {
  kHello = 1,      // worker -> coordinator: {worker, node, pid}; worker -1 asks to join
  kWelcome = 2,    // coordinator -> worker: {worker, store_host, store_port, ...}
  kHeartbeat = 3,  // worker -> coordinator: {step}
  kLost = 4,       // worker -> coordinator: {worker} a peer the data plane lost
  kVote = 5,       // worker -> coordinator: {step} reduction of step done in this epoch
  kCommit = 6,     // coordinator -> worker: {step[, next]} every member voted for step
  kEpoch = 7,      // coordinator -> worker: {epoch, members, resume_step, source, joined}
  kDone = 8,       // worker -> coordinator: {step} finished every step
  kExpelled = 9,   // coordinator -> worker: {reason} declared dead; must leave
  kRebuild = 10,   // worker -> coordinator: {} this epoch's communicator could not be built
  kReady = 11,     // worker -> coordinator: {resume_step} ready to train from this step
  kLeave = 12,     // worker -> coordinator: {step} preempted: leave at the next step boundary
  kReleased = 13,  // coordinator -> worker: {step, reason} left the job cleanly after step
};

const char* typeName(uint8_t type);

struct Header {
  uint8_t type = 0;
  uint32_t length = 0;
  uint64_t token = 0;
  int64_t epoch = 0;
};

// Serialises a message.
std::vector<uint8_t> encode(Type type, uint64_t token, int64_t epoch, const nlohmann::json& body);

// Parses a header; on a bad magic/version/type or a length over maxBytes returns false and
// sets *why to a sentence naming what was wrong.
bool decodeHeader(const uint8_t* data, uint32_t maxBytes, Header* out, std::string* why);

// Parses a payload as a JSON object; on failure returns false and sets *why.
bool decodeBody(const std::vector<uint8_t>& payload, nlohmann::json* out, std::string* why);

}  // namespace wire
}  // namespace runtime
}  // namespace sinew
