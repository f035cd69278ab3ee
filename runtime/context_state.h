#pragma once

// Internal: what a sinew::Context holds besides its public accessors (the coordinator client,
// the failure injector, MPI bookkeeping), and ContextAccess, through which the trainer, init()
// and tests reach it. Not installed.
//
// Thread safety: as Context (sinew/init.h).

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "sinew/init.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/coordinator_client.h"
#include "sinew/runtime/coordinator_process.h"
#include "sinew/runtime/failure_injection.h"
#include "sinew/store.h"

namespace sinew {
namespace checkpoint {
class Env;
}

namespace runtime {

struct ContextState {
  std::string node;
  std::string host = "127.0.0.1";
  std::string mode;
  bool joined = false;
  bool mpi = false;
  // Set when the job lost a member: MPI_Finalize would wait for it forever, so the handle
  // skips it (under mpirun --enable-recovery).
  bool memberLost = false;
  std::unique_ptr<Coordinator> localCoordinator;
  // Rank 0 under mpirun and srun: the coordinator process it forked (pid -1: none).
  CoordinatorProcess coordinatorProcess;
  // Set by Context::finishJob(): the status it returned.
  std::optional<int> exitStatus;
  // SINEW_HA=1 under mpirun: the helper process this rank forked (docs/ha.md); 0 if none.
  int haHelper = 0;
  std::string rendezvousFile;  // srun without MPI, rank 0: the file it wrote (removed at the end)
  std::unique_ptr<CoordinatorClient> client;
  std::shared_ptr<collectives::Store> store;
  uint64_t token = 0;  // The job token (peer-RAM replica services serve under it).
  // Context::requestPreemption() was called (SIGTERM sets a process-wide flag instead).
  std::atomic<bool> preemptionRequested{false};
  FailureInjector injector;
  // The file system the trainer's durable checkpoints go through; null: checkpoint::posixEnv().
  // A test seam (a FaultEnv that fails writes); must outlive the trainers.
  checkpoint::Env* checkpointEnv = nullptr;
};

struct ContextAccess {
  static ContextState& state(Context& ctx) { return *ctx.state_; }
  static const ContextState& state(const Context& ctx) { return *ctx.state_; }
};

}  // namespace runtime
}  // namespace sinew
