// Fuzzes loading a layer profile from JSON text (pipeline/profile.h): the input is the
// document. Properties: parseProfileJson() either throws sinew::Error or returns a profile
// that validateProfile() accepts and that round-trips through profileToJson() unchanged
// (the header promises both).

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/pipeline/profile.h"

namespace {

bool sameProfile(const sinew::pipeline::Profile& a, const sinew::pipeline::Profile& b) {
  const auto& ja = a.job;
  const auto& jb = b.job;
  if (ja.devices_per_node != jb.devices_per_node ||
      ja.device_memory_bytes != jb.device_memory_bytes ||
      ja.inter_stage_gbps != jb.inter_stage_gbps ||
      ja.allreduce.bandwidth_gbps != jb.allreduce.bandwidth_gbps ||
      ja.allreduce.latency_us != jb.allreduce.latency_us ||
      a.microbatch_size != b.microbatch_size || a.layers.size() != b.layers.size()) {
    return false;
  }
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const auto& x = a.layers[i];
    const auto& y = b.layers[i];
    if (x.name != y.name || x.forward_ns != y.forward_ns || x.backward_ns != y.backward_ns ||
        x.param_bytes != y.param_bytes || x.optimizer_bytes != y.optimizer_bytes ||
        x.activation_bytes != y.activation_bytes || x.output_bytes != y.output_bytes ||
        x.workspace_bytes != y.workspace_bytes) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sinew::pipeline;
  const std::string text(reinterpret_cast<const char*>(data), size);
  Profile profile;
  try {
    profile = parseProfileJson(text);
  } catch (const sinew::Error&) {
    return 0;
  }
  try {
    validateProfile(profile);
  } catch (const sinew::Error& e) {
    SINEW_FUZZ_CHECK(false, "parseProfileJson returned a profile validateProfile rejects: %s",
                     e.what());
  }
  const std::string json = profileToJson(profile);
  Profile again;
  try {
    again = parseProfileJson(json);
  } catch (const sinew::Error& e) {
    SINEW_FUZZ_CHECK(false, "profileToJson output does not parse: %s\n%s", e.what(), json.c_str());
  }
  SINEW_FUZZ_CHECK(sameProfile(profile, again), "profile changed in a round trip:\n%s",
                   json.c_str());
  return 0;
}
