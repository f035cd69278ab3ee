#pragma once

// Internal: how the tasks of one `srun` step meet without MPI (docs/runtime.md, "Under srun").
// srun gives every task its rank, the step's size and nodes in the environment; the task of
// rank 0 starts the job's coordinator on a port every task can compute (SINEW_COORDINATOR_PORT,
// or one derived from the job and step ids), on the step's first node, and the others connect
// to it. The job token is SINEW_TOKEN when the environment carries one (srun passes the
// submitter's environment on), or one rank 0 draws and writes to a file only this user can
// read, in a folder every node sees (SINEW_RENDEZVOUS_DIR, default $HOME/.sinew), which the
// others read. No PMI, PMIx or MPI_Init is involved, so a task that dies does not take the
// step down with it, and nothing waits in MPI_Finalize at the end.
//
// Thread safety: functions of the starting process; no state.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace sinew {
namespace runtime {

struct SlurmStep {
  int rank = -1;                   // SLURM_PROCID
  int size = 0;                    // SLURM_STEP_NUM_TASKS
  int localRank = 0;               // SLURM_LOCALID
  std::string jobId;               // SLURM_JOB_ID
  std::string stepId;              // SLURM_STEP_ID
  std::vector<std::string> nodes;  // SLURM_STEP_NODELIST, expanded
  std::string nodeName;            // SLURMD_NODENAME (the node this task runs on)
};

// The srun step this process is a task of, read from the environment, or nothing when it is
// none or MPI is to meet its ranks: under mpirun (OMPI_COMM_WORLD_RANK), or srun with an MPI
// plugin (PMI_RANK, PMIX_RANK). SINEW_BOOTSTRAP=mpi makes it nothing, =slurm insists on a step
// (then a missing variable is an InvalidArgument naming it). A variable with a bad value is an
// InvalidArgument naming it and the value.
std::optional<SlurmStep> slurmStepFromEnvironment();

// Slurm's host list syntax: "a,b[1-3,5],rack[01-02]-gpu[1-2]" (ranges keep their zero
// padding; several bracket groups multiply). Throws InvalidArgument naming the list.
std::vector<std::string> expandHostlist(const std::string& list);

// The coordinator's port when SINEW_COORDINATOR_PORT does not give one: in [30000, 55000), a
// function of the job and step ids, so that every task computes the same and two steps of one
// job (or two jobs) on a node rarely meet.
uint16_t derivedCoordinatorPort(const std::string& jobId, const std::string& stepId);

// Where and how the tasks of `step` meet.
struct SlurmRendezvous {
  std::string host;      // to connect to
  std::string bindHost;  // the coordinator's listening address (rank 0)
  uint16_t port = 0;
  std::string portFrom;  // "SINEW_COORDINATOR_PORT" or "derived from job 12 step 0"
  uint64_t token = 0;    // SINEW_TOKEN's, or 0: the token file's
  std::string tokenFile;
};

// SINEW_COORDINATOR_HOST, else 127.0.0.1 when the step has one node, else its first node
// (where srun places rank 0), listening on all addresses; the port as above; SINEW_TOKEN or the
// token file's path. Throws InvalidArgument naming a bad variable.
SlurmRendezvous slurmRendezvous(const SlurmStep& step);

// Rank 0: writes `token` to `path` (missing folders made 0700; the file 0600, written
// whole under another name, then renamed). Throws IoError naming the path.
void writeTokenFile(const std::string& path, uint64_t token);
// The others: the token in `path`, waiting for it until `timeout`. Throws Timeout naming the
// path and what to check, Corruption if it holds no token.
uint64_t readTokenFile(const std::string& path, std::chrono::milliseconds timeout);

}  // namespace runtime
}  // namespace sinew
