#pragma once

// How a job ended, as its coordinator records it once every worker has left (docs/runtime.md,
// "How a job ends"): a JSON object
//   {"outcome": "finished" | "stopped" | "failed", "exit_status": 0 | 75 | 1,
//    "step": <the last committed step, -1: none>, "epoch": <its epoch>,
//    "workers_lost": [...], "released": [...], "last_durable": {step, path, ...} | null,
//    "reason": "<why it failed>" (failed only)}
// kept in <log-dir>/outcome.json and said in the launch's last line (outcomeLine).
// Internal: included by .cc files only; not installed.

#include <nlohmann/json.hpp>
#include <string>

namespace sinew {
namespace runtime {

// The file name of the outcome in a job's log folder.
constexpr const char* kOutcomeFile = "outcome.json";

// The exit status that says `outcome`: 0 finished, 75 (EX_TEMPFAIL) stopped at a step
// boundary, resumable from its checkpoint folder, 1 failed (and for anything else).
int outcomeExitStatus(const nlohmann::json& outcome);

// One line for a person: "sinew: job finished at step 60, epoch 3; workers lost: [2]; ...",
// "sinew: job stopped after step 41 ...; rerun it to resume (exit 75)", "sinew: job FAILED ...".
std::string outcomeLine(const nlohmann::json& outcome);

// Writes `outcome` to `path` whole (a reader sees the old file or the new one). Throws IoError
// naming the path.
void writeOutcomeFile(const nlohmann::json& outcome, const std::string& path);

// Reads an outcome file. Throws IoError when it cannot be read (the job has not ended, or ran
// without a log folder) and Corruption when it is not an outcome, each naming the path.
nlohmann::json readOutcomeFile(const std::string& path);

}  // namespace runtime
}  // namespace sinew
