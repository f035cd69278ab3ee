#include "sinew/collectives/transport/frame.h"

#include <iomanip>
#include <sstream>

#include "sinew/base/error.h"
#include "sinew/base/little_endian.h"

namespace sinew {
namespace collectives {
namespace transport {
namespace {

using sinew::detail::loadLe;
using sinew::detail::storeLe;

std::string hex(uint64_t v, int digits) {
  std::ostringstream os;
  os << "0x" << std::hex << std::setw(digits) << std::setfill('0') << v;
  return os.str();
}

}  // namespace

const char* serviceName(uint8_t service) {
  switch (static_cast<Service>(service)) {
    case Service::kStore:
      return "store";
    case Service::kCoordinator:
      return "coordinator";
    case Service::kReplica:
      return "replica";
    case Service::kLane:
      return "collective lane";
  }
  return nullptr;
}

std::string frameName(const FrameRules& rules, uint8_t type) {
  const char* s = serviceName(static_cast<uint8_t>(rules.service));
  const char* t = rules.typeName ? rules.typeName(type) : nullptr;
  return std::string(s ? s : "unknown service") + " " +
         (t ? std::string(t) : "type " + std::to_string(type));
}

void encodeFrameHeader(const FrameHeader& h, uint8_t* out) {
  storeLe(out, kFrameMagic, 4);
  out[4] = kFrameVersion;
  out[5] = static_cast<uint8_t>(h.service);
  out[6] = h.type;
  out[7] = 0;
  storeLe(out + 8, h.length, 4);
  storeLe(out + 12, 0, 4);
  storeLe(out + 16, h.token, 8);
  storeLe(out + 24, static_cast<uint64_t>(h.epoch), 8);
}

FrameHeader parseFrameHeader(const uint8_t* data, const FrameRules& rules) {
  SINEW_ENFORCE(rules.typeName != nullptr, "FrameRules::typeName is required");
  const uint32_t magic = static_cast<uint32_t>(loadLe(data, 4));
  if (magic != kFrameMagic) {
    SINEW_THROW(Corruption, "frame header: magic ", hex(magic, 8), " is not ", hex(kFrameMagic, 8),
                " (not a Sinew message)");
  }
  if (data[4] != kFrameVersion) {
    SINEW_THROW(Corruption, "frame header: version ", int(data[4]), ", this side speaks ",
                int(kFrameVersion));
  }
  const char* expected = serviceName(static_cast<uint8_t>(rules.service));
  if (data[5] != static_cast<uint8_t>(rules.service)) {
    const char* got = serviceName(data[5]);
    SINEW_THROW(Corruption, "frame header: service ", int(data[5]), " (", got ? got : "unknown",
                ") sent to the ", expected, " port");
  }
  FrameHeader h;
  h.service = rules.service;
  h.type = data[6];
  h.token = loadLe(data + 16, 8);
  if (rules.token == 0 || h.token != rules.token) {
    SINEW_THROW(Corruption, "frame header: wrong job token on a ", frameName(rules, h.type),
                " message");
  }
  if (rules.typeName(h.type) == nullptr) {
    SINEW_THROW(Corruption, "frame header: unknown ", expected, " message type ", int(h.type));
  }
  if (data[7] != 0) {
    SINEW_THROW(Corruption, "frame header: flags ", hex(data[7], 2), " on a ",
                frameName(rules, h.type), " message must be 0");
  }
  const uint64_t reserved = loadLe(data + 12, 4);
  if (reserved != 0) {
    SINEW_THROW(Corruption, "frame header: reserved field ", hex(reserved, 8), " on a ",
                frameName(rules, h.type), " message must be 0");
  }
  h.length = static_cast<uint32_t>(loadLe(data + 8, 4));
  uint32_t limit = rules.maxPayloadBytes;
  if (rules.maxPayloadOf) limit = std::min(limit, rules.maxPayloadOf(h.type));
  if (h.length > limit) {
    SINEW_THROW(Corruption, "frame header: ", frameName(rules, h.type), " message of ", h.length,
                " bytes exceeds the limit of ", limit);
  }
  h.epoch = static_cast<int64_t>(loadLe(data + 24, 8));
  return h;
}

}  // namespace transport
}  // namespace collectives
}  // namespace sinew
