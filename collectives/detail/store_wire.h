#pragma once

// The TCP store's messages (docs/store_protocol.md), carried in frames of service kStore
// (collectives/transport/frame.h). Requests are types 1..7; answers are kOk, kTimeout and
// kInvalid. Payload fields: bytes = u32 length + data; i64; u32. Internal; not installed.

#include <cstdint>
#include <string>
#include <vector>

#include "sinew/collectives/transport/frame.h"

namespace sinew {
namespace collectives {
namespace store_wire {

using Bytes = std::vector<uint8_t>;

enum class Op : uint8_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCompareSet = 4,
  kWait = 5,
  kCheck = 6,
  kDelete = 7,
};

enum class Answer : uint8_t { kOk = 0x81, kTimeout = 0x82, kInvalid = 0x83 };

const char* requestName(uint8_t type);  // null if not a request type
const char* answerName(uint8_t type);   // null if not an answer type

// Frame rules of the server (requests up to maxBytes) and of a client (answers).
transport::FrameRules requestRules(uint64_t token, uint32_t maxBytes);
transport::FrameRules answerRules(uint64_t token);

struct Request {
  Op op = Op::kSet;
  std::string key;  // set, get, add, compareSet, delete
  Bytes value;      // set
  Bytes expected;   // compareSet
  Bytes desired;    // compareSet
  int64_t delta = 0;
  int64_t timeoutMs = 0;          // get, wait: >= 0
  std::vector<std::string> keys;  // wait, check
};

// Encodes the payload of a request.
Bytes encodeRequest(const Request& r);
// Decodes and checks a request payload of the given type: every field present, nothing
// trailing, timeouts not negative. Throws Corruption naming the field and value.
Request decodeRequest(uint8_t type, const Bytes& payload);

// Answer payloads: a bytes field, an i64, or an error message (a bytes field). The decoders
// throw Corruption naming `what` when the payload is not exactly that.
Bytes encodeBytes(const Bytes& v);
Bytes encodeI64(int64_t v);
Bytes encodeString(const std::string& s);
Bytes decodeBytes(const Bytes& payload, const char* what);
int64_t decodeI64(const Bytes& payload, const char* what);
std::string decodeString(const Bytes& payload, const char* what);

}  // namespace store_wire
}  // namespace collectives
}  // namespace sinew
