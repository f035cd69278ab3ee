#include "sinew/runtime/epoch_recovery.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "sinew/base/error.h"
#include "sinew/runtime/layer_relayout.h"

namespace sinew {
namespace runtime {

namespace {
// How long a wait for the next epoch lasts before the worker asks for one itself.
constexpr std::chrono::milliseconds kNudge{3000};
// After an epoch that could not be entered, the next rebuild request waits this long, doubled
// for every further one, at most kMaxBackoff: members that keep failing (a port flooded by
// strangers, a peer that hangs) ask for a few epochs a second, not hundreds.
constexpr std::chrono::milliseconds kFirstBackoff{50};
constexpr std::chrono::milliseconds kMaxBackoff{2000};
}  // namespace

std::chrono::milliseconds rebuildBackoff(int failedEnters) {
  if (failedEnters <= 1) return std::chrono::milliseconds(0);
  const int doublings = std::min(failedEnters - 2, 16);
  return std::min(kMaxBackoff, kFirstBackoff * (int64_t{1} << doublings));
}

double recoverIntoNextEpoch(const TrainerServices& s, EpochCommunicators& comms, int64_t from,
                            bool failure, const std::string& why, int64_t step,
                            const std::function<void(const EpochInfo&)>& enter) {
  const auto t0 = TrainerClock::now();
  comms.drop();
  const int self = s.worker();
  if (failure) {
    s.state.memberLost = true;  // MPI_Finalize would wait for the lost member forever.
    s.event({{"event", "failure_noticed"}, {"epoch", from}, {"step", step}, {"reason", why}});
  }
  // The deadline bounds the waits for an epoch. At the start, an attempt to enter one that a
  // newer epoch then superseded (the job's first epoch, in which the members measure their
  // profile, for minutes on a large model) extends it by its duration.
  auto deadline = t0 + s.recoveryTimeout();
  int64_t waitFrom = from;
  int failedEnters = 0;
  // Asks for a fresh epoch after `epoch` failed, once the backoff has passed (unless a newer
  // epoch arrives meanwhile: then that one is tried without asking).
  auto rebuild = [&](int64_t epoch) {
    comms.drop();  // Not held through the pause.
    const auto pause = std::min(
        rebuildBackoff(++failedEnters),
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - TrainerClock::now()));
    if (pause.count() > 0) {
      try {
        s.client.waitEpochAfter(epoch, pause);
        return;
      } catch (const Timeout&) {
      }
    }
    s.client.requestRebuild(epoch);
  };
  while (true) {
    if (failure) s.state.injector.fire(self, step, Phase::kRecovery, &s.client);
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - TrainerClock::now());
    if (left.count() <= 0) {
      SINEW_THROW(Timeout, "worker ", self, " could not recover within ",
                  s.recoveryTimeout().count(), " ms (", why, ")");
    }
    EpochInfo info;
    try {
      info = s.client.waitEpochAfter(waitFrom, std::min(left, kNudge));
    } catch (const Timeout&) {
      // Nothing died that the coordinator knows of (e.g. a timeout without a death): ask for
      // a fresh epoch with the same members.
      if (waitFrom >= 0) s.client.requestRebuild(waitFrom);
      continue;
    }
    // A new epoch after the first: the worker is reconfiguring (docs/architecture.md section 8).
    if (from >= 0) s.state.injector.fire(self, step, Phase::kReconfiguration, &s.client);
    const auto entering = TrainerClock::now();
    try {
      enter(info);
      break;
    } catch (const PeerLost& e) {
      s.client.reportLost(info.epoch, e.worker());
    } catch (const Timeout&) {
      rebuild(info.epoch);
    } catch (const Aborted&) {
      // Superseded while building: the next epoch is already on its way.
      if (from < 0) deadline += TrainerClock::now() - entering;
    } catch (const IoError&) {
      rebuild(info.epoch);
    } catch (const LayerCopyDamaged& e) {
      // Nothing of the copy was adopted; the same members try the epoch again and copy it
      // anew. Other corruption (every restore source damaged) ends the worker.
      s.event({{"event", "copy_damaged"}, {"epoch", info.epoch}, {"reason", e.what()}});
      std::fprintf(stderr, "sinew: worker %d: %s; trying the epoch again\n", self, e.what());
      rebuild(info.epoch);
    }
    comms.drop();
    waitFrom = info.epoch;
  }
  return seconds(TrainerClock::now() - t0);
}

}  // namespace runtime
}  // namespace sinew
