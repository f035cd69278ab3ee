// Fuzzes the SINEW_INJECT spec parser (runtime/failure_injection.h): the input is a spec.
// Properties: parse() either throws sinew::Error or returns faults whose fields are in the
// ranges fire() relies on (worker and step >= -1, finite non-negative durations).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/runtime/coordinator_client.h"
#include "sinew/runtime/failure_injection.h"

namespace sinew {
namespace runtime {
// failure_injection.cc calls this for mute faults in fire(), which the harness never runs;
// defining it here keeps the harness from compiling the coordinator client and its
// dependencies.
void CoordinatorClient::muteHeartbeats(std::chrono::milliseconds) { std::abort(); }
}  // namespace runtime
}  // namespace sinew

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using sinew::runtime::Fault;
  const std::string spec(reinterpret_cast<const char*>(data), size);
  sinew::runtime::FailureInjector injector;
  try {
    injector = sinew::runtime::FailureInjector::parse(spec);
  } catch (const sinew::Error&) {
    return 0;
  }
  for (const Fault& f : injector.faults()) {
    SINEW_FUZZ_CHECK(f.worker >= -1, "worker %d", f.worker);
    SINEW_FUZZ_CHECK(f.step >= -1, "step %lld", static_cast<long long>(f.step));
    SINEW_FUZZ_CHECK(std::isfinite(f.seconds) && f.seconds >= 0, "secs %g", f.seconds);
    SINEW_FUZZ_CHECK(std::isfinite(f.milliseconds) && f.milliseconds >= 0, "ms %g", f.milliseconds);
    SINEW_FUZZ_CHECK(std::string(sinew::runtime::phaseName(f.phase)) != "?", "phase %d",
                     static_cast<int>(f.phase));
  }
  return 0;
}
