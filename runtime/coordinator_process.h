#pragma once

// The coordinator process that rank 0 forks under mpirun and srun (docs/runtime.md, "How a job
// ends"). It serves until the job has ended and every worker has left it (closed its
// connection), so the job's store outlives whatever a program still does with it after
// training; then it writes the job's outcome (runtime/job_outcome.h) to <SINEW_LOG_DIR>/
// outcome.json when a log folder is given, reports it to rank 0 through a pipe (or prints its
// line itself when rank 0 is gone) and exits with the outcome's status.
// Internal: included by .cc files only; not installed.

#include <sys/types.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "sinew/init.h"
#include "sinew/runtime/coordinator.h"

namespace sinew {
namespace runtime {

// The control API's address from SINEW_CONTROL_PORT (0: a free port) and SINEW_CONTROL_HOST
// (docs/control_api.md), for the built-in coordinator and for HA mode's candidates alike.
void controlApiFromEnv(CoordinatorOptions& c);

struct CoordinatorProcess {
  pid_t pid = -1;
  int outcomeFd = -1;     // read end of the pipe the outcome comes through (close-on-exec)
  std::string announced;  // "port token" as the process reported them
};

// Forks the coordinator (before MPI_Init, so the child is no MPI process) for `expected`
// workers, on `host` and `port` when given, else SINEW_COORDINATOR_HOST or 127.0.0.1 and a free
// port, with `token` unless 0. Returns once it listens. Throws IoError with its reason when it
// could not start.
CoordinatorProcess forkCoordinator(int expected, const InitOptions& o, const std::string& host = "",
                                   uint16_t port = 0, uint64_t token = 0);

// Waits until the process reports the job's outcome and ends, and returns the outcome; closes
// the pipe. A process that ends without one (killed) gives a failed outcome naming how it ended.
// Call it after this worker left the job (its own connection counts as a worker's).
nlohmann::json awaitOutcome(CoordinatorProcess& process);

}  // namespace runtime
}  // namespace sinew
