#include "sinew/runtime/detail/wire.h"

#include "sinew/base/error.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace runtime {
namespace wire {
namespace {

using nlohmann::json;

enum class Kind { kInt, kString, kBool, kIntArray, kObject };

struct Field {
  const char* name;
  Kind kind;
  bool required;
  int64_t min = 0;  // kInt, kIntArray elements; kString: minimum length
  int64_t max = 0;  // kInt, kIntArray elements; kString and kIntArray: maximum length
  std::vector<Field> fields = {};  // kObject: its fields
};

enum class From { kWorker, kCoordinator };

// One message type: who sends it, its fields as decodeBody checks them, and what it means.
struct Message {
  Type type;
  const char* name;
  From from;
  std::vector<Field> fields;
  const char* meaning;
};

constexpr int64_t kMaxText = 4096;
constexpr int64_t kMaxMembers = 1 << 20;
constexpr int64_t kMaxWorkers = 1 << 20;

// The coordinator protocol: the only list of its messages. docs/coordinator_protocol.md holds
// messageTable()'s rendering of it (a test compares the two).
const std::vector<Message>& messages() {
  static const std::vector<Message> table = {
      {Type::kHello,
       "hello",
       From::kWorker,
       {{"worker", Kind::kInt, true, -1, kMaxWorkerId - 1},
        {"node", Kind::kString, true, 1, 255},
        {"pid", Kind::kInt, false, 0, INT32_MAX},
        {"rejoin",
         Kind::kObject,
         false,
         0,
         0,
         {{"epoch", Kind::kInt, true, -1, kMaxStep},
          {"committed", Kind::kInt, true, -1, kMaxStep}}}},
       "worker -1 asks to join; `rejoin` (HA mode, docs/ha.md): a member reconnecting to a new "
       "leader, with the last epoch and commit it had"},
      {Type::kWelcome,
       "welcome",
       From::kCoordinator,
       {{"worker", Kind::kInt, true, 0, kMaxWorkerId - 1},
        {"store_host", Kind::kString, true, 1, 255},
        {"store_port", Kind::kInt, true, 1, 65535},
        {"heartbeat_ms", Kind::kInt, true, 1, 3600 * 1000},
        {"dead_after_ms", Kind::kInt, false, 1, 24 * 3600 * 1000}},
       "the worker's id and the rendezvous store's address"},
      {Type::kHeartbeat,
       "heartbeat",
       From::kWorker,
       {{"step", Kind::kInt, true, -1, kMaxStep}, {"waiting", Kind::kBool, false}},
       "its step, and whether it waits on the others (rule 1 of docs/failure_semantics.md)"},
      {Type::kLost,
       "lost",
       From::kWorker,
       {{"worker", Kind::kInt, true, 0, kMaxWorkerId - 1}},
       "a peer the data plane lost (PeerLost)"},
      {Type::kVote,
       "vote",
       From::kWorker,
       {{"step", Kind::kInt, true, 0, kMaxStep},
        {"compute_us", Kind::kInt, false, 0, kMaxStep},
        {"stall_us", Kind::kInt, false, 0, kMaxStep},
        {"replicated_bytes", Kind::kInt, false, 0, kMaxStep},
        {"state_bytes_in", Kind::kInt, false, 0, kMaxStep}},
       "this worker reduced `step` in this epoch; its compute time and snapshot stall (for the "
       "control API's status and scaling), the peer-RAM replica bytes it sent since its last "
       "vote (for /metrics) and the state bytes it took in to enter the epoch (the epoch's "
       "cost)"},
      {Type::kCommit,
       "commit",
       From::kCoordinator,
       {{"step", Kind::kInt, true, 0, kMaxStep},
        {"next_epoch", Kind::kBool, false},
        {"checkpoint", Kind::kBool, false},
        {"step_deadline_ms", Kind::kInt, false, 0, kMaxStep}},
       "every member voted for `step`; `next_epoch`: a new epoch follows; `checkpoint`: make "
       "this step durable (a control API checkpoint, drain or stop)"},
      {Type::kEpoch,
       "epoch",
       From::kCoordinator,
       {{"epoch", Kind::kInt, true, 0, kMaxStep},
        {"members", Kind::kIntArray, true, 0, kMaxMembers},
        {"resume_step", Kind::kInt, true, 0, kMaxStep},
        {"source", Kind::kInt, true, -1, kMaxWorkerId - 1},
        {"joined", Kind::kIntArray, true, 0, kMaxMembers},
        {"sync", Kind::kBool, true},
        {"plan", Kind::kString, false, 2, kMaxPlanBytes},
        {"step_deadline_ms", Kind::kInt, false, 0, kMaxStep}},
       "the next configuration; `plan`: a pipeline job's plan for it (pipeline::planToJson)"},
      {Type::kDone,
       "done",
       From::kWorker,
       {{"step", Kind::kInt, true, -1, kMaxStep}},
       "finished every step"},
      {Type::kExpelled,
       "expelled",
       From::kCoordinator,
       {{"reason", Kind::kString, false, 0, kMaxText}},
       "declared dead; the coordinator closes the connection after it"},
      {Type::kRebuild,
       "rebuild",
       From::kWorker,
       {},
       "this epoch's communicator could not be built"},
      {Type::kReady,
       "ready",
       From::kWorker,
       {{"resume_step", Kind::kInt, true, 0, kMaxStep},
        {"global_batch", Kind::kInt, false, 1, kMaxStep},
        {"microbatch", Kind::kInt, false, 1, kMaxStep},
        {"steps", Kind::kInt, false, 0, kMaxStep},
        {"checkpoints", Kind::kBool, false}},
       "ready to train from `resume_step` (after its durable checkpoint; 0: none); the job's "
       "shape, for the control API"},
      {Type::kLeave,
       "leave",
       From::kWorker,
       {{"step", Kind::kInt, true, -1, kMaxStep}},
       "preempted (SIGTERM): leave at the next step boundary"},
      {Type::kReleased,
       "released",
       From::kCoordinator,
       {{"step", Kind::kInt, true, -1, kMaxStep},
        {"reason", Kind::kString, false, 0, kMaxText},
        {"job_stopped", Kind::kBool, false}},
       "left cleanly after `step`; the coordinator closes the connection after it; "
       "`job_stopped`: every member left with it (the job stopped, resumable)"},
      {Type::kPipeline,
       "pipeline",
       From::kWorker,
       {{"profile", Kind::kString, true, 2, kMaxProfileBytes},
        {"fault_tolerance", Kind::kInt, true, 0, kMaxWorkerId - 1},
        {"microbatches", Kind::kInt, true, 1, INT32_MAX},
        {"max_workers", Kind::kInt, false, 0, kMaxWorkers}},
       "plan this job as pipelines (`profile`: docs/profile_format.md), with templates for up to "
       "`max_workers` workers (0 or absent: the starting workers); only a job's first request "
       "counts"},
      {Type::kDurable,
       "durable",
       From::kWorker,
       {{"step", Kind::kInt, true, 0, kMaxStep},
        {"bytes", Kind::kInt, true, 0, kMaxStep},
        {"flush_us", Kind::kInt, true, 0, kMaxStep},
        {"path", Kind::kString, true, 1, kMaxText}},
       "the version of `step` is durable (from the writer that moved LATEST)"},
      {Type::kRollback,
       "rollback",
       From::kWorker,
       {{"step", Kind::kInt, true, -1, kMaxStep}},
       "(pipelines) some layer has no live copy after the epoch's resume step: resume after the "
       "older version `step` (docs/pipeline.md, \"Rollback\")"},
      {Type::kWithdraw,
       "withdraw",
       From::kWorker,
       {{"step", Kind::kInt, true, 0, kMaxStep}},
       "no verdict on its vote for `step` came in time: count it only if `step` is already "
       "committed (then the commit is on its way), else drop it and start the next epoch, which "
       "resumes at `step`"},
  };
  return table;
}

const Message* find(uint8_t type) {
  for (const Message& m : messages()) {
    if (static_cast<uint8_t>(m.type) == type) return &m;
  }
  return nullptr;
}

bool isInt(const json& v) { return v.is_number_integer(); }

int64_t intValue(const json& v) {
  // An unsigned value above INT64_MAX is out of every range we accept.
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) return INT64_MAX;
  return v.get<int64_t>();
}

// Checks `body`'s fields against `fields`; `name` is the message's, `prefix` the path of an
// enclosing object field ("rejoin.").
void checkFields(const char* name, const json& body, const std::vector<Field>& fields,
                 const std::string& prefix) {
  for (const Field& f : fields) {
    const std::string field = prefix + f.name;
    auto it = body.find(f.name);
    if (it == body.end()) {
      if (f.required) SINEW_THROW(Corruption, name, " message: field '", field, "' is missing");
      continue;
    }
    const json& v = *it;
    switch (f.kind) {
      case Kind::kInt: {
        if (!isInt(v)) {
          SINEW_THROW(Corruption, name, " message: field '", field, "' = ", detail::jsonPreview(v),
                      " is not an integer");
        }
        int64_t x = intValue(v);
        if (x < f.min || x > f.max) {
          SINEW_THROW(Corruption, name, " message: field '", field, "' = ", detail::jsonPreview(v),
                      " is outside [", f.min, ", ", f.max, "]");
        }
        break;
      }
      case Kind::kString:
        if (!v.is_string()) {
          SINEW_THROW(Corruption, name, " message: field '", field, "' is not a string");
        }
        if (int64_t(v.get_ref<const std::string&>().size()) < f.min ||
            int64_t(v.get_ref<const std::string&>().size()) > f.max) {
          SINEW_THROW(Corruption, name, " message: field '", field, "' has ",
                      v.get_ref<const std::string&>().size(), " characters, outside [", f.min, ", ",
                      f.max, "]");
        }
        break;
      case Kind::kBool:
        if (!v.is_boolean()) {
          SINEW_THROW(Corruption, name, " message: field '", field, "' = ", detail::jsonPreview(v),
                      " is not a boolean");
        }
        break;
      case Kind::kIntArray:
        if (!v.is_array() || int64_t(v.size()) > f.max) {
          SINEW_THROW(Corruption, name, " message: field '", field, "' is not an array of at most ",
                      f.max, " worker ids");
        }
        for (const json& e : v) {
          if (!isInt(e) || intValue(e) < 0 || intValue(e) >= kMaxWorkerId) {
            SINEW_THROW(Corruption, name, " message: field '", field, "' holds ",
                        detail::jsonPreview(e), ", not a worker id in [0, ", kMaxWorkerId, ")");
          }
        }
        break;
      case Kind::kObject:
        if (!v.is_object()) {
          SINEW_THROW(Corruption, name, " message: field '", field, "' is not an object");
        }
        checkFields(name, v, f.fields, field + ".");
        break;
    }
  }
}

// A field as the protocol doc shows it: "`name` int in [a, b]", "`name`? string of a-b
// characters", ... (? marks an optional field).
std::string describeField(const Field& f) {
  std::string s = "`" + std::string(f.name) + "`" + (f.required ? "" : "?") + " ";
  switch (f.kind) {
    case Kind::kInt:
      return s + "int in [" + std::to_string(f.min) + ", " + std::to_string(f.max) + "]";
    case Kind::kString:
      return s + "string of " + std::to_string(f.min) + "-" + std::to_string(f.max) + " bytes";
    case Kind::kBool:
      return s + "bool";
    case Kind::kIntArray:
      return s + "worker ids (at most " + std::to_string(f.max) + ")";
    case Kind::kObject: {
      s += "{";
      for (size_t i = 0; i < f.fields.size(); ++i) {
        s += (i ? ", " : "") + describeField(f.fields[i]);
      }
      return s + "}";
    }
  }
  return s;
}

}  // namespace

const char* typeName(uint8_t type) {
  const Message* m = find(type);
  return m ? m->name : nullptr;
}

const char* workerTypeName(uint8_t type) {
  const Message* m = find(type);
  return m && m->from == From::kWorker ? m->name : nullptr;
}

const char* coordinatorTypeName(uint8_t type) {
  const Message* m = find(type);
  return m && m->from == From::kCoordinator ? m->name : nullptr;
}

std::string messageTable() {
  std::string out = "| type | name | from | fields | meaning |\n|---|---|---|---|---|\n";
  for (const Message& m : messages()) {
    std::string fields;
    for (const Field& f : m.fields) fields += (fields.empty() ? "" : "; ") + describeField(f);
    out += "| " + std::to_string(static_cast<int>(m.type)) + " | " + m.name + " | " +
           (m.from == From::kWorker ? "worker" : "coordinator") + " | " +
           (fields.empty() ? "none" : fields) + " | " + m.meaning + " |\n";
  }
  return out;
}

collectives::transport::FrameRules coordinatorRules(uint64_t token, uint32_t maxBytes) {
  collectives::transport::FrameRules r;
  r.service = collectives::transport::Service::kCoordinator;
  r.token = token;
  r.typeName = &workerTypeName;
  r.maxPayloadBytes = maxBytes;
  return r;
}

collectives::transport::FrameRules clientRules(uint64_t token) {
  collectives::transport::FrameRules r;
  r.service = collectives::transport::Service::kCoordinator;
  r.token = token;
  r.typeName = &coordinatorTypeName;
  r.maxPayloadBytes = 64u << 20;  // An epoch message lists every member.
  return r;
}

std::vector<uint8_t> encodeBody(const json& body) {
  std::string text = body.dump();
  return std::vector<uint8_t>(text.begin(), text.end());
}

json decodeBody(uint8_t type, const std::vector<uint8_t>& payload) {
  const Message* m = find(type);
  if (m == nullptr) SINEW_THROW(Corruption, "coordinator message of unknown type ", int(type));
  const char* text = reinterpret_cast<const char*>(payload.data());
  if (detail::jsonTooDeep(text, text + payload.size())) {
    SINEW_THROW(Corruption, m->name, " message: payload nests JSON deeper than ",
                detail::kMaxJsonDepth, " levels");
  }
  json body = json::parse(payload.begin(), payload.end(), nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    SINEW_THROW(Corruption, m->name, " message: payload is not a JSON object");
  }
  checkFields(m->name, body, m->fields, "");
  return body;
}

}  // namespace wire
}  // namespace runtime
}  // namespace sinew
