#pragma once

// Learning-rate schedules (TrainerOptions::lrSchedule): the rate of each step as a function of
// the step alone, so every worker sets the same rate, and a step redone after a recovery, a
// rollback or a restore from a checkpoint uses the rate its first attempt used.
//
// Thread safety: the schedules are pure functions of copied values.

#include <cstdint>
#include <functional>

namespace sinew {

// The rate of step `step` (0-based). The Trainer sets it on every parameter group before the
// step's optimizer step; a rate that is NaN, infinite or negative stops training with
// InvalidArgument naming the step and the rate.
using LrSchedule = std::function<double(int64_t step)>;

// `lr` at every step. Throws InvalidArgument unless lr >= 0 and finite.
LrSchedule constantLr(double lr);

// Linear warm-up to `peakLr` over the first `warmupSteps` steps (step s < warmupSteps gets
// peakLr * (s + 1) / warmupSteps), then a half cosine from peakLr down to `minLr` at step
// `totalSteps`, and minLr after it. Throws InvalidArgument unless 0 <= minLr <= peakLr (both
// finite) and 0 <= warmupSteps <= totalSteps.
LrSchedule warmupCosine(double peakLr, int64_t warmupSteps, int64_t totalSteps, double minLr = 0.0);

// `lr` multiplied by `gamma` every `every` steps: lr * gamma^(step / every). Throws
// InvalidArgument unless lr >= 0, gamma > 0 (both finite) and every >= 1.
LrSchedule stepDecay(double lr, int64_t every, double gamma);

}  // namespace sinew
