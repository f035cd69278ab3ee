// Fuzzes decoding a pipeline plan (pipeline/plan.h, planFromJson), which every worker of a
// pipeline job parses from the coordinator's epoch message. Properties: planFromJson() either
// throws sinew::Error or returns a plan whose layer ranges, stages and microbatches are in
// range, and that round-trips through planToJson() unchanged.

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/pipeline/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sinew::pipeline;
  const std::string text(reinterpret_cast<const char*>(data), size);
  Plan plan;
  try {
    plan = planFromJson(text);
  } catch (const sinew::Error&) {
    return 0;
  }
  int64_t total = 0;
  for (const auto& p : plan.pipelines) total += p.microbatches;
  SINEW_FUZZ_CHECK(total == plan.microbatchesPerStep, "microbatches sum to %lld, not %lld",
                   static_cast<long long>(total), static_cast<long long>(plan.microbatchesPerStep));
  for (const auto& w : plan.workers) {
    SINEW_FUZZ_CHECK(0 <= w.firstLayer && w.firstLayer < w.endLayer && w.endLayer <= plan.numLayers,
                     "layers [%d, %d) outside [0, %d)", w.firstLayer, w.endLayer, plan.numLayers);
    SINEW_FUZZ_CHECK(w.pipeline >= 0 && w.pipeline < static_cast<int>(plan.pipelines.size()),
                     "pipeline %d of %zu", w.pipeline, plan.pipelines.size());
    SINEW_FUZZ_CHECK(
        static_cast<int64_t>(w.microbatches.size()) == plan.pipelines[w.pipeline].microbatches,
        "worker %d runs %zu microbatches", w.worker, w.microbatches.size());
  }
  const std::string json = planToJson(plan);
  Plan again;
  try {
    again = planFromJson(json);
  } catch (const sinew::Error& e) {
    SINEW_FUZZ_CHECK(false, "planToJson output does not parse: %s\n%s", e.what(), json.c_str());
  }
  SINEW_FUZZ_CHECK(planToJson(again) == json, "plan changed in a round trip:\n%s", json.c_str());
  return 0;
}
