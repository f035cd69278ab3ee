#include "sinew/runtime/scaling_curve.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace sinew {
namespace runtime {

namespace {

// The value below which a share q of the sorted values lies (nearest rank).
double quantile(const std::vector<double>& sorted, double q) {
  const size_t n = sorted.size();
  size_t k = static_cast<size_t>(std::ceil(q * static_cast<double>(n)));
  k = std::min(n, std::max<size_t>(1, k));
  return sorted[k - 1];
}

}  // namespace

std::map<int, MeasuredSize> summarizeStepTimes(const std::map<int, std::deque<double>>& bySize) {
  std::map<int, MeasuredSize> out;
  for (const auto& [n, times] : bySize) {
    if (times.size() < MeasuredSize::kMinSteps) continue;
    std::vector<double> v(times.begin(), times.end());
    std::sort(v.begin(), v.end());
    MeasuredSize m;
    m.steps = v.size();
    m.medianSeconds =
        v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
    m.p10Seconds = quantile(v, 0.1);
    m.p90Seconds = quantile(v, 0.9);
    out[n] = m;
  }
  return out;
}

DataParallelFit fitDataParallel(const std::map<int, MeasuredSize>& measured, int computeWorkers,
                                double computeSeconds) {
  DataParallelFit f;
  if (measured.empty()) {
    f.model = "nothing measured yet";
    return f;
  }
  if (measured.size() == 1) {
    const auto& [m, size] = *measured.begin();
    if (m == computeWorkers && computeSeconds > 0 && computeSeconds < size.medianSeconds) {
      f.a = size.medianSeconds - computeSeconds;
      f.b = computeSeconds * m;
      f.model = "one size measured: step_s = a + b / workers, b from the members' compute time";
      return f;
    }
    f.b = size.medianSeconds * m;
    f.model = "one size measured: step_s = b / workers";
    return f;
  }
  // Fits t = p + q x over (x, t) with p, q >= 0; returns (p, q, squared error).
  auto fit = [&](auto xOf) {
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    const double k = static_cast<double>(measured.size());
    for (const auto& [n, m] : measured) {
      const double x = xOf(n);
      sx += x;
      sy += m.medianSeconds;
      sxx += x * x;
      sxy += x * m.medianSeconds;
    }
    double q = (k * sxy - sx * sy) / (k * sxx - sx * sx);
    double p = (sy - q * sx) / k;
    if (q < 0) {
      q = 0;
      p = sy / k;
    } else if (p < 0) {
      p = 0;
      q = sxy / sxx;
    }
    double err = 0;
    for (const auto& [n, m] : measured) err += std::pow(p + q * xOf(n) - m.medianSeconds, 2);
    return std::array<double, 3>{p, q, err};
  };
  const auto inverse = fit([](int n) { return 1.0 / n; });
  const auto linear = fit([](int n) { return static_cast<double>(n); });
  if (inverse[2] <= linear[2]) {
    f.a = inverse[0];
    f.b = inverse[1];
    f.model = "fitted: step_s = a + b / workers";
  } else {
    f.a = linear[0];
    f.c = linear[1];
    f.model = "fitted: step_s = a + c * workers (more workers were slower per step)";
  }
  return f;
}

CurvePoint predictAt(int n, double samplesPerStep, const std::map<int, MeasuredSize>& measured,
                     const std::function<double(int)>& modelSeconds) {
  CurvePoint p;
  if (samplesPerStep <= 0) return p;
  auto exact = measured.find(n);
  if (exact != measured.end()) {
    p.predictedSamplesPerSecond = samplesPerStep / exact->second.medianSeconds;
    p.basis = "measured";
    return p;
  }
  const double model = modelSeconds(n);
  if (!(model > 0)) return p;
  // The correction measured / model at the measured sizes the model covers.
  std::map<int, double> ratio;
  for (const auto& [k, m] : measured) {
    const double mk = modelSeconds(k);
    if (mk > 0) ratio[k] = m.medianSeconds / mk;
  }
  double r = 1;
  if (ratio.empty()) {
    p.basis = "model";
  } else {
    auto above = ratio.lower_bound(n);
    if (above == ratio.begin()) {
      r = above->second;
      p.basis = "extrapolated";
    } else if (above == ratio.end()) {
      r = std::prev(above)->second;
      p.basis = "extrapolated";
    } else {
      auto below = std::prev(above);
      const double w = static_cast<double>(n - below->first) / (above->first - below->first);
      r = below->second + w * (above->second - below->second);
      p.basis = "interpolated";
    }
  }
  p.predictedSamplesPerSecond = samplesPerStep / (model * r);
  return p;
}

std::optional<double> modelError(const std::map<int, MeasuredSize>& measured,
                                 const std::function<double(int)>& modelSeconds) {
  double worst = 0;
  int counted = 0;
  for (const auto& [k, m] : measured) {
    const double mk = modelSeconds(k);
    if (!(mk > 0) || !(m.medianSeconds > 0)) continue;
    worst = std::max(worst, std::abs(mk / m.medianSeconds - 1));
    counted++;
  }
  if (counted < 2) return std::nullopt;
  return worst;
}

}  // namespace runtime
}  // namespace sinew
