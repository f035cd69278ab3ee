#include "sinew/runtime/job_outcome.h"

#include <fstream>
#include <sstream>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/base/private_file.h"

namespace sinew {
namespace runtime {

using json = nlohmann::json;

namespace {

std::string listOf(const json& ids) {
  std::string out;
  if (!ids.is_array()) return out;
  for (const json& id : ids) out += (out.empty() ? "" : ",") + id.dump();
  return out;
}

}  // namespace

int outcomeExitStatus(const json& outcome) {
  const std::string o = outcome.value("outcome", std::string());
  if (o == "finished") return 0;
  if (o == "stopped") return 75;
  return 1;
}

std::string outcomeLine(const json& outcome) {
  const std::string o = outcome.value("outcome", std::string("unknown"));
  const int64_t step = outcome.value("step", int64_t(-1));
  const json durable = outcome.value("last_durable", json());
  std::ostringstream line;
  line << "sinew: job ";
  if (o == "finished") {
    line << "finished at step " << step + 1 << ", epoch " << outcome.value("epoch", int64_t(-1));
  } else if (o == "stopped") {
    line << "stopped after step " << step;
  } else {
    line << "FAILED after step " << step << ": " << outcome.value("reason", std::string("?"));
  }
  line << "; workers lost: [" << listOf(outcome.value("workers_lost", json::array()))
       << "]; released: [" << listOf(outcome.value("released", json::array())) << "]";
  if (durable.is_object()) {
    line << "; durable checkpoint: step " << durable.value("step", int64_t(-1)) << " in "
         << durable.value("path", std::string("?"));
  }
  if (o == "stopped") {
    line << (durable.is_object() ? "; run it again on that folder to resume"
                                 : "; no durable checkpoint, a new run starts over");
  }
  line << " (exit " << outcomeExitStatus(outcome) << ")";
  return line.str();
}

void writeOutcomeFile(const json& outcome, const std::string& path) {
  detail::writePrivateFile(path, outcome.dump() + "\n");
}

json readOutcomeFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    SINEW_THROW(IoError, "no job outcome at '", path,
                "': the job has not ended, or ran without this log folder");
  }
  std::stringstream text;
  text << in.rdbuf();
  json j = detail::tryParseJson(text.str());
  if (!j.is_object() || !j.contains("outcome") || !j.at("outcome").is_string()) {
    SINEW_THROW(Corruption, "'", path, "' is not a job outcome (no \"outcome\" string in it)");
  }
  return j;
}

}  // namespace runtime
}  // namespace sinew
