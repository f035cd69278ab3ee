#pragma once

// A job's throughput per size, from the step times it measured at the sizes it ran at and a
// model for the others (docs/control_api.md, "GET /v1/scaling"). The model is the data-parallel
// fit below, or the caller's (a pipeline job's template cost model); either way it is
// corrected by the measurements: at a size the job ran at, the prediction is the measurement;
// between two such sizes the ratio measured / model is interpolated linearly; beyond the
// outermost, the nearest size's ratio holds. So the measured point at the present size is
// never contradicted by the prediction beside it.
//
// Internal to sinew_runtime. Thread safety: pure values.

#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>

namespace sinew {
namespace runtime {

// The step times measured at one size, summarized: at least `kMinSteps` of them count.
struct MeasuredSize {
  static constexpr size_t kMinSteps = 3;
  size_t steps = 0;
  double medianSeconds = 0;
  double p10Seconds = 0;  // the fastest tenth's bound
  double p90Seconds = 0;  // the slowest tenth's bound
};

// The sizes (workers) with at least kMinSteps step times.
std::map<int, MeasuredSize> summarizeStepTimes(const std::map<int, std::deque<double>>& bySize);

// The data-parallel model: t(n) fitted by least squares as a + b / n (the per-worker compute
// shrinks with n, the reduction does not) or, where that fits worse, a + c n (more workers were
// slower per step: shared cores), coefficients non-negative. One size: split by the members'
// compute time c measured there (forward and backward, no waits: what more workers share),
// t = (t_m - c) + c m / n; without it, t = b / n.
struct DataParallelFit {
  double a = 0, b = 0, c = 0;
  std::string model;  // in words, "nothing measured yet" if no size was measured
  bool any() const { return a > 0 || b > 0 || c > 0; }
  double stepSeconds(int n) const { return a + b / n + c * n; }
};
// `computeWorkers`, `computeSeconds`: the size the members' compute time was measured at, and
// its median (0: not known).
DataParallelFit fitDataParallel(const std::map<int, MeasuredSize>& measured, int computeWorkers = 0,
                                double computeSeconds = 0);

struct CurvePoint {
  double predictedSamplesPerSecond = 0;  // 0: no prediction (nothing to scale it by)
  std::string basis;  // "measured", "interpolated", "extrapolated", "model" (no measurement)
};

// The corrected prediction at `n` of `samplesPerStep` per step, from `modelSeconds` (the
// model's step time at a size; <= 0 where it has none) and the measured sizes.
CurvePoint predictAt(int n, double samplesPerStep, const std::map<int, MeasuredSize>& measured,
                     const std::function<double(int)>& modelSeconds);

// How far the uncorrected model missed at the measured sizes: the largest |model / measured - 1|
// over them; nullopt with fewer than two sizes measured (one size calibrates the model).
std::optional<double> modelError(const std::map<int, MeasuredSize>& measured,
                                 const std::function<double(int)>& modelSeconds);

}  // namespace runtime
}  // namespace sinew
