#pragma once

// Internal: how the tasks of one `srun` step meet without MPI (docs/runtime.md, "Under srun").
// srun gives every task its rank, the step's size and nodes in the environment; the task of
// rank 0 starts the job's coordinator and the others connect to it. They learn where and with
// which job token in one of two ways:
// - a rendezvous file: rank 0 writes "address port token" to a file only this user can read, in
//   a folder every node sees (SINEW_RENDEZVOUS_DIR, default $HOME/.sinew), and the others read
//   it; the coordinator listens on a free port (or SINEW_COORDINATOR_PORT) of rank 0's address
//   (SINEW_COORDINATOR_HOST, 127.0.0.1 for a one-node step, else its host name's address);
// - SINEW_TOKEN in the environment (srun passes the submitter's environment on): no file; the
//   coordinator listens on SINEW_COORDINATOR_PORT or a port derived from the job and step ids,
//   at SINEW_COORDINATOR_HOST or the step's first node, where srun places rank 0.
// No PMI, PMIx or MPI_Init is involved, so a task that dies does not take the step down with
// it, and nothing waits in MPI_Finalize at the end.
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

// Where and how the tasks of `step` meet, as far as the environment says.
struct SlurmRendezvous {
  // Where rank 0's coordinator listens and the others connect: SINEW_COORDINATOR_HOST, else
  // 127.0.0.1 for a one-node step; else empty (with a file: rank 0's host name's address,
  // SINEW_TOKEN: the step's first node).
  std::string host;
  uint16_t port = 0;     // SINEW_COORDINATOR_PORT, derived (SINEW_TOKEN), or 0: a free one
  std::string portFrom;  // "SINEW_COORDINATOR_PORT", "derived from job 12 step 0", "free"
  uint64_t token = 0;    // SINEW_TOKEN's, or 0: the rendezvous file's
  std::string file;      // the rendezvous file (used when token is 0)
};

// Reads the rendezvous settings for `step`. Throws InvalidArgument naming a bad variable.
SlurmRendezvous slurmRendezvous(const SlurmStep& step);

// The IPv4 address `name` resolves to. Throws IoError naming it when it has none.
std::string addressOf(const std::string& name);
// This host's address (its host name's), for others to reach it.
std::string ownAddress();

// What a rendezvous file says.
struct RendezvousRecord {
  std::string host;
  uint16_t port = 0;
  uint64_t token = 0;
};

// Rank 0: writes `record` to `path` (missing folders made 0700; the file 0600, written whole
// under another name, then renamed). Throws IoError naming the path.
void writeRendezvousFile(const std::string& path, const RendezvousRecord& record);
// The others: the record in `path`, waiting for it until `timeout`. Throws Timeout naming the
// path and what to check, Corruption naming it if it is not a record.
RendezvousRecord readRendezvousFile(const std::string& path, std::chrono::milliseconds timeout);

}  // namespace runtime
}  // namespace sinew
