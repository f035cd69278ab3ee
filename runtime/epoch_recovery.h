#pragma once

// Internal: how a worker's trainer gets from one epoch into the next (docs/architecture.md
// section 6, steps 2-3): it drops the epoch's communicators, waits for the coordinator to
// announce a newer epoch, and enters it, retrying with the next announced epoch while one
// cannot be built (a member lost while building, a timeout, a damaged layer copy). The
// failures an attempt can raise, and what each asks of the coordinator, are listed in one place
// here.
//
// Thread safety: used by the training thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "sinew/runtime/coordinator_client.h"
#include "sinew/runtime/epoch_communicators.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

// Leaves epoch `from` (-1: the worker has not been in one) and enters the next one the
// coordinator announces with `enter` (which builds the epoch's communicators and state),
// retrying until one is entered. `failure`: the worker leaves because something failed (it
// then counts as a member that lost a peer, fires the injector's recovery phase and logs
// "failure_noticed" with `why`); `step` is the step it was at. Returns the seconds it took.
// Throws Timeout naming the worker and `why` after services.recoveryTimeout(), and whatever
// `enter` throws besides PeerLost, Timeout, Aborted, IoError and LayerCopyDamaged.
// After the first epoch that cannot be entered, each rebuild request waits
// rebuildBackoff(failures so far) first (or less, to the deadline; a newer epoch announced
// meanwhile is tried without a request).
double recoverIntoNextEpoch(const TrainerServices& services, EpochCommunicators& comms,
                            int64_t from, bool failure, const std::string& why, int64_t step,
                            const std::function<void(const EpochInfo&)>& enter);

// 0 for the first failed entry, then 50 ms doubling per failure up to 2 s.
std::chrono::milliseconds rebuildBackoff(int failedEnters);

}  // namespace runtime
}  // namespace sinew
