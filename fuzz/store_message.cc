// Fuzzes the TCP store's message decoders (collectives/detail/store_wire.h), as the server
// runs them on a request payload that passed the frame header and a client runs them on an
// answer. Input: one byte, the message type, then the payload.
// Properties: a decoder throws Corruption or returns a request that encodes back to the same
// payload (fields are length-prefixed and nothing may trail) with timeouts >= 0; the answer
// decoders likewise round-trip.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/collectives/detail/store_wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace sw = sinew::collectives::store_wire;
  if (size == 0) return 0;
  const uint8_t type = data[0];
  const sw::Bytes payload(data + 1, data + size);

  try {
    const sw::Request q = sw::decodeRequest(type, payload);
    SINEW_FUZZ_CHECK(q.timeoutMs >= 0, "negative timeout %lld accepted",
                     static_cast<long long>(q.timeoutMs));
    SINEW_FUZZ_CHECK(sw::encodeRequest(q) == payload, "request of type %d does not round-trip",
                     int(type));
  } catch (const sinew::Corruption&) {
  }
  try {
    const sw::Bytes v = sw::decodeBytes(payload, "fuzz answer");
    SINEW_FUZZ_CHECK(sw::encodeBytes(v) == payload, "bytes answer does not round-trip");
  } catch (const sinew::Corruption&) {
  }
  try {
    const int64_t v = sw::decodeI64(payload, "fuzz answer");
    SINEW_FUZZ_CHECK(sw::encodeI64(v) == payload, "i64 answer does not round-trip");
  } catch (const sinew::Corruption&) {
  }
  try {
    const std::string v = sw::decodeString(payload, "fuzz answer");
    SINEW_FUZZ_CHECK(sw::encodeString(v) == payload, "string answer does not round-trip");
  } catch (const sinew::Corruption&) {
  }
  return 0;
}
