#pragma once

// Bootstrap (docs/architecture.md section 3). sinew::init() makes this process a worker of a job
// and returns the handle everything else hangs off. It finds the job in this order:
//   1. SINEW_COORDINATOR=host:port (set by sinew-run, or by hand to join a running job;
//      SINEW_TOKEN carries the job token, SINEW_WORKER_ID the launch rank, absent to join).
//   2. Under mpirun or srun (OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID is set): rank 0
//      forks the coordinator process before MPI_Init; MPI_Init; rank 0 broadcasts its
//      endpoint with one MPI_Bcast; nothing else uses MPI (the handle calls MPI_Finalize
//      when it is destroyed, unless a member of the job was lost). Survivors of a dead rank
//      keep running only under `mpirun --enable-recovery`.
//   3. Otherwise a job of one worker with an in-process coordinator.
// SINEW_NODE overrides the node (failure domain) name ("{rank}" in it becomes the launch
// rank, e.g. -x SINEW_NODE=node{rank} to make each rank its own node on one machine), SINEW_HOST
// the address this worker's communicators listen on (default 127.0.0.1; set it on multi-host jobs),
// and SINEW_COORDINATOR_HOST the address the coordinator binds to under MPI.
//
// Thread safety: a Context is used by the thread that runs training; its accessors are
// thread-safe.

#include <chrono>
#include <memory>
#include <string>

#include "sinew/error.h"
#include "sinew/store.h"

namespace sinew {

namespace runtime {
// The plumbing behind a Context (coordinator client, failure injector, MPI state), defined in
// the internal header runtime/context_state.h; ContextAccess is how Sinew's own code and tests
// reach it.
struct ContextState;
struct ContextAccess;
}  // namespace runtime

struct InitOptions {
  // How long to wait for the coordinator (and under MPI for MPI_Init's peers).
  std::chrono::milliseconds connectTimeout{60000};
  // Heartbeat settings of a coordinator this process starts (mpirun, single process).
  std::chrono::milliseconds heartbeatInterval{100};
  std::chrono::milliseconds deadAfter{1000};
  // Step deadline of that coordinator (docs/failure_semantics.md, rule 1): a member computing
  // while the others have waited for it longer than max(stepDeadlineFloor, stepDeadlineFactor
  // x the median step time) is declared dead. A floor of 0 turns the check off.
  std::chrono::milliseconds stepDeadlineFloor{3000};
  int stepDeadlineFactor = 20;
  // SIGTERM (what Slurm's --signal and most schedulers send before a preemption) asks this
  // worker to leave the job cleanly at the next step boundary instead of killing it. The
  // handler only sets a flag; set false to keep the program's own SIGTERM disposition.
  bool preemptOnSigterm = true;
};

class Context {
 public:
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // This worker's stable id (the launch rank, or assigned on join).
  int worker() const;
  const std::string& node() const;
  // The address this worker's communicators listen on.
  const std::string& host() const;
  // How the job was launched: "sinew-run", "join", "mpi" or "single".
  const std::string& launchMode() const;
  // Whether this worker joined a running job.
  bool joined() const;

  // The job's rendezvous store (served by the coordinator).
  const std::shared_ptr<collectives::Store>& store() const;

  // Asks this worker to leave the job at the next step boundary (the C++ form of SIGTERM).
  // Async-signal-safe and thread-safe.
  void requestPreemption();
  // Whether preemption was requested (by requestPreemption() or SIGTERM).
  bool preemptionRequested() const;

  // Ends this worker's part in the job and returns the status the program should exit with
  // (`return ctx->finishJob();` at the end of main). The worker leaves the job's store. Where it
  // hosts the job's coordinator (rank 0 under mpirun and srun; a job of one worker), it then
  // waits until every other worker has left too, prints the job's outcome as its last line
  // ("sinew: job finished at step 60, epoch 3; ...") and returns the job's status: 0 finished,
  // 75 stopped at a step boundary (a drain, a stop, every worker preempted; resumable from its
  // checkpoint folder), 1 failed. Elsewhere it returns this worker's: 0 it trained to the end
  // or left a job that goes on, 75 the whole job stopped, 3 it was expelled (declared dead),
  // 1 it stopped before any of these (an error). Later calls return the same status; the
  // destructor does the same when it was not called (docs/runtime.md, "How a job ends").
  int finishJob();

 private:
  friend std::unique_ptr<Context> init(int* argc, char*** argv, const InitOptions& options);
  friend struct runtime::ContextAccess;
  Context();

  std::unique_ptr<runtime::ContextState> state_;
};

// See the top of this file. argc/argv may be null (then MPI_Init gets none).
// Throws InvalidArgument for a malformed SINEW_* variable (naming it), Timeout when the
// coordinator cannot be reached.
std::unique_ptr<Context> init(int* argc, char*** argv, const InitOptions& options = InitOptions());

}  // namespace sinew
