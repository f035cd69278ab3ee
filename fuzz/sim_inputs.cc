// Fuzzes sinew-sim's inputs (sim/simulator.h): the first byte picks the parser, the rest is the
// text: a node trace (parseTrace), a throughput table (parseThroughputTable) or Sinew's costs
// (parseSinewCosts). Properties: each either throws sinew::Error or returns a value that keeps
// its documented rules (times sorted, adds and removes consistent, throughputs positive), and
// a trace that parses replays through the fixed-cost model with every second accounted for.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/sim/simulator.h"

namespace {

using namespace sinew::sim;

void checkTrace(const std::string& text) {
  std::vector<TraceEvent> trace;
  try {
    trace = parseTrace(text, "fuzz");
  } catch (const sinew::Error&) {
    return;
  }
  SINEW_FUZZ_CHECK(!trace.empty(), "an empty trace parsed");
  std::set<std::string> present;
  for (size_t i = 0; i < trace.size(); ++i) {
    SINEW_FUZZ_CHECK(i == 0 || trace[i].time_ms >= trace[i - 1].time_ms, "unsorted at %zu", i);
    const bool ok =
        trace[i].add ? present.insert(trace[i].node).second : present.erase(trace[i].node) == 1;
    SINEW_FUZZ_CHECK(ok, "event %zu adds a node that is there or removes one that is not", i);
  }
  FixedCostModel model;
  model.table.samples_per_s = {{1, 1.0}, {3, 2.5}};
  model.reconfiguration_s = 0.5;
  SimOptions options;
  options.duration_s =
      std::min(1e5, std::max(1.0, static_cast<double>(trace.back().time_ms) / 1e3));
  options.bucket_s = options.duration_s / 7;
  SimResult r;
  try {
    r = simulateFixedCost(trace, model, options);
  } catch (const sinew::Error&) {
    return;  // e.g. the first events leave no node
  }
  double sum = 0;
  for (double s : r.total.seconds) {
    SINEW_FUZZ_CHECK(s >= -1e-6, "a negative cause: %g", s);
    sum += s;
  }
  SINEW_FUZZ_CHECK(std::fabs(sum - r.wall_s) <= 1e-6 * std::max(1.0, r.wall_s),
                   "causes add up to %g of %g s", sum, r.wall_s);
  SINEW_FUZZ_CHECK(r.total.samples >= 0 && r.total.samples <= 2.5 * r.wall_s + 1e-6,
                   "%g samples in %g s", r.total.samples, r.wall_s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0:
      checkTrace(text);
      break;
    case 1:
      try {
        const ThroughputTable t = parseThroughputTable(text, "fuzz");
        SINEW_FUZZ_CHECK(!t.samples_per_s.empty(), "an empty table parsed");
        for (const auto& [n, x] : t.samples_per_s) {
          SINEW_FUZZ_CHECK(n >= 1 && x > 0 && std::isfinite(x), "entry %d: %g", n, x);
        }
      } catch (const sinew::Error&) {
      }
      break;
    default:
      try {
        const SinewCosts c = parseSinewCosts(text, "fuzz");
        SINEW_FUZZ_CHECK(c.copy_gbps > 0 && c.replication >= 1 && c.peer_every >= 0,
                         "costs out of range");
      } catch (const sinew::Error&) {
      }
  }
  return 0;
}
