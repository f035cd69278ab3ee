#pragma once

// The coordinator's HTTP control API (docs/architecture.md section 7, docs/control_api.md): the
// routing and the checking of requests, apart from the sockets (control_server.h) so that a fuzzer
// can drive it byte by byte. Paths are versioned (/v1/...), bodies are JSON objects, answers are
// JSON (Prometheus text for /metrics). Every request carries the bearer token, checked from
// the headers before the body is read.
//
// Internal to sinew_runtime. Thread safety: the functions are pure; a Backend says its own.

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace sinew {
namespace runtime {

// What a control operation answers: an HTTP status (200 done or accepted, 400 a request
// that names something wrong, 409 not possible in the job's present state) and a JSON body
// (an object; {"error": "..."} when the status is not 200).
struct ControlReply {
  int status = 200;
  nlohmann::json body = nlohmann::json::object();
};

// The signal a scheduler's advance warning uses ("USR1", "SIGUSR1", "TERM", or a number in
// [1, 64]); throws InvalidArgument naming `what` (the flag or variable) and the value.
int signalNumber(const std::string& what, const std::string& name);

namespace control {

// Limits of one request (a larger one is refused before it is read).
constexpr size_t kMaxHeaderBytes = 8 * 1024;
constexpr size_t kDefaultMaxBodyBytes = 64 * 1024;
// Lists in a drain request, and node counts a resize may ask for.
constexpr size_t kMaxListed = 4096;
constexpr int64_t kMaxNodes = 1 << 20;
// Deadlines a request may give, in seconds.
constexpr double kMaxDeadlineSeconds = 1e7;

// What a drain asks for: the workers by id, or the nodes by name, to be free by a deadline.
struct DrainRequest {
  std::vector<int> workers;
  std::vector<std::string> nodes;
  double deadlineSeconds = 0;
  // Only say what the drain would cost (the job's throughput after it, the pause, the bytes
  // moved, whether it forces a rollback); drain nothing. deadline_s may then be left out.
  bool dryRun = false;
};

// A job's limits and wishes (docs/control_api.md, "Limits"), set at launch and changed with
// POST /v1/limits: the sizes a resize may ask for, and what a scheduler should know when it
// plans. 0 or empty: no limit.
struct JobLimits {
  int64_t minNodes = 0;
  int64_t maxNodes = 0;
  // The node counts the job can use, ascending, without repeats; empty: every count in
  // [minNodes, maxNodes].
  std::vector<int64_t> sizes;
  // When the job should be done, in seconds since 1970 (UTC); 0: no deadline.
  double deadlineUnixSeconds = 0;
  // Whether a scheduler may take the job's nodes back before it is done (stop it, or drain it
  // after lowering minNodes). For the scheduler: the job itself refuses a drain below
  // minNodes either way.
  bool preemptible = true;
  // The scheduler's order among jobs: higher first. In [-1000, 1000].
  int64_t priority = 0;

  // Why a job of these limits may not run on `nodes` nodes ("below the job's min_nodes 2"),
  // or empty when it may.
  std::string refuses(int64_t nodes) const;
  nlohmann::json toJson() const;
};

// Throws InvalidArgument naming the field when the limits contradict themselves: a minimum
// above the maximum, a size outside them, sizes not ascending, a count outside
// [0, kMaxNodes], a deadline that is not a finite time after 1970, a priority outside
// [-1000, 1000].
void validateLimits(const JobLimits& limits);

// The limits after a POST /v1/limits body: each field given replaces the current one
// (min_nodes, max_nodes, sizes, deadline_unix_s, preemptible, priority; null or 0 clears a
// limit), the others stay; the result is validated. Throws InvalidArgument naming the field.
JobLimits parseLimits(const nlohmann::json& body, JobLimits current);

// The operations behind the API, implemented by the coordinator.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual ControlReply status() = 0;
  virtual ControlReply scaling() = 0;
  virtual ControlReply resize(int64_t nodes) = 0;
  // POST /v1/limits: the job's limits after the update `body` (parseLimits).
  virtual ControlReply limits(const nlohmann::json& body) = 0;
  virtual ControlReply drain(const DrainRequest& request) = 0;
  virtual ControlReply checkpoint() = 0;
  // deadlineSeconds <= 0: no deadline.
  virtual ControlReply stop(double deadlineSeconds) = 0;
  virtual std::string metrics() = 0;
};

// One answer on the wire.
// The longest wait of a long poll of GET /v1/events.
constexpr double kMaxEventWaitSeconds = 60;

struct Answer {
  int status = 200;
  std::string contentType = "application/json";
  std::string body;
  // GET /v1/events: the server keeps the connection and streams events (server-sent events).
  bool eventStream = false;
  // GET /v1/events?after=SEQ&wait_s=T&limit=N: one JSON answer with the events after SEQ,
  // waiting up to T seconds for the first if there is none yet (a long poll).
  bool longPoll = false;
  int64_t after = -1;
  double waitSeconds = 0;
  size_t limit = 100;
  // 405: the methods the path allows.
  std::string allow;
};

// Whether an Authorization header value is "Bearer <token>" for this token (compared in
// time independent of where they differ).
bool authorized(std::string_view authorization, const std::string& token);

// What a request's token lets it do: the control token everything, the read token (a scrape
// or dashboard credential) only GET (status, scaling, metrics, events).
enum class Role { kNone, kRead, kControl };
Role roleOf(std::string_view authorization, const std::string& controlToken,
            const std::string& readToken);
// Whether `role` may send a request of `method`.
bool allows(Role role, std::string_view method);

// The answer to a request whose token was checked: method and target as sent, the body as
// read. Never throws: a bad path, method or body is a 4xx answer naming what was wrong.
Answer route(Backend& backend, std::string_view method, std::string_view target,
             std::string_view body);

// An error answer: {"error": message}.
Answer errorAnswer(int status, const std::string& message);

// Parses a request body that must be a JSON object (an empty body is the empty object);
// checks the fields of each operation. Throw InvalidArgument naming the field and value.
nlohmann::json parseObject(std::string_view body);
int64_t parseResize(const nlohmann::json& body);
DrainRequest parseDrain(const nlohmann::json& body);
// durable must be true (or absent): a data-parallel job's checkpoints are all durable.
void parseCheckpoint(const nlohmann::json& body);
double parseStop(const nlohmann::json& body);

// One server-sent event: "id: <seq>\nevent: <name>\ndata: <json>\n\n".
std::string sseEvent(int64_t seq, const nlohmann::json& event);

}  // namespace control
}  // namespace runtime
}  // namespace sinew
