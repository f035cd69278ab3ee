// Fuzzes the frame header parser of the one transport (collectives/transport/frame.h) under
// the frame rules of every port, each side: the store server and client, the coordinator and
// its client, the replica service and client. Input: one byte choosing the rules, then the
// 32 header bytes (zero-filled when short).
// Properties: parseFrameHeader either throws Corruption, whose message never holds the
// expected token, or accepts a header that carries the rules' service and token, a known
// type, zero flags and reserved bytes, a length within the limits, and that encodes back to
// the same 32 bytes.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/checkpoint/detail/replica_wire.h"
#include "sinew/collectives/detail/store_wire.h"
#include "sinew/collectives/transport/frame.h"
#include "sinew/runtime/detail/wire.h"

namespace {

namespace transport = sinew::collectives::transport;

constexpr uint64_t kToken = 0x5157a3d2c0ffee01ULL;

transport::FrameRules rulesOf(uint8_t choice) {
  using namespace sinew;
  switch (choice % 6) {
    case 0:
      return collectives::store_wire::requestRules(kToken, 64u << 20);
    case 1:
      return collectives::store_wire::answerRules(kToken);
    case 2:
      return runtime::wire::coordinatorRules(kToken, 1u << 20);
    case 3:
      return runtime::wire::clientRules(kToken);
    case 4:
      return checkpoint::replica_wire::serviceRules(kToken, 4u << 20);
    default:
      return checkpoint::replica_wire::clientRules(kToken);
  }
}

bool mentionsToken(const std::string& s) {
  char hex[32];
  std::snprintf(hex, sizeof hex, "%llx", static_cast<unsigned long long>(kToken));
  return s.find(std::to_string(kToken)) != std::string::npos || s.find(hex) != std::string::npos;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const transport::FrameRules rules = rulesOf(data[0]);
  uint8_t header[transport::kFrameHeaderBytes] = {};
  std::memcpy(header, data + 1, std::min(size - 1, transport::kFrameHeaderBytes));

  transport::FrameHeader h;
  try {
    h = transport::parseFrameHeader(header, rules);
  } catch (const sinew::Corruption& e) {
    SINEW_FUZZ_CHECK(!mentionsToken(e.what()), "an error names the expected token: %s", e.what());
    return 0;
  }
  SINEW_FUZZ_CHECK(h.service == rules.service, "service %d accepted", int(h.service));
  SINEW_FUZZ_CHECK(h.token == rules.token, "a wrong token was accepted");
  SINEW_FUZZ_CHECK(rules.typeName(h.type) != nullptr, "unknown type %d accepted", int(h.type));
  SINEW_FUZZ_CHECK(h.length <= rules.maxPayloadBytes, "length %u over the limit %u", h.length,
                   rules.maxPayloadBytes);
  if (rules.maxPayloadOf != nullptr) {
    SINEW_FUZZ_CHECK(h.length <= rules.maxPayloadOf(h.type), "length %u over type %d's limit",
                     h.length, int(h.type));
  }
  uint8_t again[transport::kFrameHeaderBytes];
  transport::encodeFrameHeader(h, again);
  SINEW_FUZZ_CHECK(std::memcmp(again, header, sizeof header) == 0,
                   "an accepted header does not encode back to its bytes");
  return 0;
}
