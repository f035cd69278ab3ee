#include "sinew/runtime/detail/wire.h"

#include <iomanip>
#include <sstream>

#include "sinew/collectives/detail/little_endian.h"

namespace sinew {
namespace runtime {
namespace wire {
namespace {

using sinew::detail::appendLe;
using sinew::detail::loadLe;

}  // namespace

const char* typeName(uint8_t type) {
  switch (static_cast<Type>(type)) {
    case Type::kHello:
      return "hello";
    case Type::kWelcome:
      return "welcome";
    case Type::kHeartbeat:
      return "heartbeat";
    case Type::kLost:
      return "lost";
    case Type::kVote:
      return "vote";
    case Type::kCommit:
      return "commit";
    case Type::kEpoch:
      return "epoch";
    case Type::kDone:
      return "done";
    case Type::kExpelled:
      return "expelled";
    case Type::kRebuild:
      return "rebuild";
    case Type::kReady:
      return "ready";
    case Type::kLeave:
      return "leave";
    case Type::kReleased:
      return "released";
  }
  return nullptr;
}

std::vector<uint8_t> encode(Type type, uint64_t token, int64_t epoch, const nlohmann::json& body) {
  std::string text = body.dump();
  std::vector<uint8_t> b;
  b.reserve(kHeaderBytes + text.size());
  appendLe(b, kMagic, 4);
  b.push_back(kVersion);
  b.push_back(static_cast<uint8_t>(type));
  appendLe(b, 0, 2);
  appendLe(b, text.size(), 4);
  appendLe(b, token, 8);
  appendLe(b, static_cast<uint64_t>(epoch), 8);
  b.insert(b.end(), text.begin(), text.end());
  return b;
}

bool decodeHeader(const uint8_t* data, uint32_t maxBytes, Header* out, std::string* why) {
  uint32_t magic = static_cast<uint32_t>(loadLe(data, 4));
  if (magic != kMagic) {
    std::ostringstream os;
    os << "bad magic 0x" << std::hex << std::setw(8) << std::setfill('0') << magic
       << " (not a Sinew coordinator message)";
    *why = os.str();
    return false;
  }
  if (data[4] != kVersion) {
    *why = "protocol version " + std::to_string(data[4]) + ", this coordinator speaks " +
           std::to_string(kVersion);
    return false;
  }
  if (typeName(data[5]) == nullptr) {
    *why = "unknown message type " + std::to_string(data[5]);
    return false;
  }
  out->type = data[5];
  out->length = static_cast<uint32_t>(loadLe(data + 8, 4));
  if (out->length > maxBytes) {
    *why = std::string(typeName(out->type)) + " message of " + std::to_string(out->length) +
           " bytes exceeds the limit of " + std::to_string(maxBytes);
    return false;
  }
  out->token = loadLe(data + 12, 8);
  out->epoch = static_cast<int64_t>(loadLe(data + 20, 8));
  return true;
}

bool decodeBody(const std::vector<uint8_t>& payload, nlohmann::json* out, std::string* why) {
  *out = nlohmann::json::parse(payload.begin(), payload.end(), nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded() || !out->is_object()) {
    *why = "payload is not a JSON object";
    return false;
  }
  return true;
}

}  // namespace wire
}  // namespace runtime
}  // namespace sinew
