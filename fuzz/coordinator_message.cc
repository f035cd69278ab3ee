// Fuzzes the coordinator's message decoder (runtime/detail/wire.h), which the coordinator runs
// on every worker's message and a worker on every coordinator message. Input: one byte, the
// message type, then the JSON payload.
// Properties: decodeBody throws Corruption or returns an object whose integer fields are the
// ranged integers the receiver reads them as (the accessors used in coordinator.cc and
// coordinator_client.cc cannot throw), and that decodes again to the same object once
// encoded.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/runtime/detail/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace wire = sinew::runtime::wire;
  if (size == 0) return 0;
  const uint8_t type = data[0];
  const std::vector<uint8_t> payload(data + 1, data + size);

  nlohmann::json body;
  try {
    body = wire::decodeBody(type, payload);
  } catch (const sinew::Corruption&) {
    return 0;
  }
  SINEW_FUZZ_CHECK(body.is_object(), "a non-object body was accepted");
  // The integer fields the receiver of this type reads (coordinator.cc, coordinator_client.cc).
  std::vector<const char*> ints;
  std::vector<const char*> idLists;
  switch (static_cast<wire::Type>(type)) {
    case wire::Type::kHello:
      ints = {"worker", "pid"};
      break;
    case wire::Type::kWelcome:
      ints = {"worker", "store_port", "heartbeat_ms", "dead_after_ms"};
      break;
    case wire::Type::kLost:
      ints = {"worker"};
      break;
    case wire::Type::kEpoch:
      ints = {"epoch", "resume_step", "source"};
      idLists = {"members", "joined"};
      break;
    case wire::Type::kReady:
      ints = {"resume_step"};
      break;
    case wire::Type::kExpelled:
    case wire::Type::kRebuild:
      break;
    default:
      ints = {"step"};
      break;
  }
  for (const char* f : ints) {
    auto it = body.find(f);
    if (it == body.end()) continue;
    SINEW_FUZZ_CHECK(it->is_number_integer(), "field %s is not an integer", f);
    const int64_t v = it->get<int64_t>();
    SINEW_FUZZ_CHECK(v >= -1 && v <= wire::kMaxStep, "field %s = %lld is out of range", f,
                     static_cast<long long>(v));
    if (std::string(f) == "worker" || std::string(f) == "source") {
      SINEW_FUZZ_CHECK(v < wire::kMaxWorkerId, "worker id %lld accepted",
                       static_cast<long long>(v));
    }
  }
  for (const char* f : idLists) {
    auto it = body.find(f);
    SINEW_FUZZ_CHECK(it != body.end() && it->is_array(), "%s is not a list", f);
    for (const auto& e : *it) {
      SINEW_FUZZ_CHECK(
          e.is_number_integer() && e.get<int64_t>() >= 0 && e.get<int64_t>() < wire::kMaxWorkerId,
          "%s holds %s", f, e.dump().c_str());
    }
  }
  nlohmann::json again;
  try {
    again = wire::decodeBody(type, wire::encodeBody(body));
  } catch (const sinew::Corruption& e) {
    SINEW_FUZZ_CHECK(false, "an accepted body fails once re-encoded: %s", e.what());
  }
  SINEW_FUZZ_CHECK(again == body, "body of type %d changed in a round trip", int(type));
  return 0;
}
