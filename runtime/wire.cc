#include "sinew/runtime/detail/wire.h"

#include "sinew/collectives/error.h"

namespace sinew {
namespace runtime {
namespace wire {
namespace {

using nlohmann::json;

enum class Kind { kInt, kString, kBool, kIntArray };

struct Field {
  const char* name;
  Kind kind;
  bool required;
  int64_t min;  // kInt, kIntArray elements; kString: minimum length
  int64_t max;  // kInt, kIntArray elements; kString and kIntArray: maximum length
};

constexpr int64_t kMaxText = 4096;
constexpr int64_t kMaxMembers = 1 << 20;

std::vector<Field> fieldsOf(Type type) {
  switch (type) {
    case Type::kHello:
      return {{"worker", Kind::kInt, true, -1, kMaxWorkerId - 1},
              {"node", Kind::kString, true, 1, 255},
              {"pid", Kind::kInt, false, 0, INT32_MAX}};
    case Type::kWelcome:
      return {{"worker", Kind::kInt, true, 0, kMaxWorkerId - 1},
              {"store_host", Kind::kString, true, 1, 255},
              {"store_port", Kind::kInt, true, 1, 65535},
              {"heartbeat_ms", Kind::kInt, true, 1, 3600 * 1000},
              {"dead_after_ms", Kind::kInt, false, 1, 24 * 3600 * 1000}};
    case Type::kHeartbeat:
      return {{"step", Kind::kInt, true, -1, kMaxStep}, {"waiting", Kind::kBool, false, 0, 0}};
    case Type::kLost:
      return {{"worker", Kind::kInt, true, 0, kMaxWorkerId - 1}};
    case Type::kVote:
      return {{"step", Kind::kInt, true, 0, kMaxStep},
              {"compute_us", Kind::kInt, false, 0, kMaxStep},
              {"stall_us", Kind::kInt, false, 0, kMaxStep}};
    case Type::kCommit:
      return {{"step", Kind::kInt, true, 0, kMaxStep},
              {"next_epoch", Kind::kBool, false, 0, 0},
              {"checkpoint", Kind::kBool, false, 0, 0},
              {"step_deadline_ms", Kind::kInt, false, 0, kMaxStep}};
    case Type::kEpoch:
      return {{"epoch", Kind::kInt, true, 0, kMaxStep},
              {"members", Kind::kIntArray, true, 0, kMaxMembers},
              {"resume_step", Kind::kInt, true, 0, kMaxStep},
              {"source", Kind::kInt, true, -1, kMaxWorkerId - 1},
              {"joined", Kind::kIntArray, true, 0, kMaxMembers},
              {"sync", Kind::kBool, true, 0, 0},
              {"plan", Kind::kString, false, 2, kMaxPlanBytes},
              {"step_deadline_ms", Kind::kInt, false, 0, kMaxStep}};
    case Type::kPipeline:
      return {{"profile", Kind::kString, true, 2, kMaxProfileBytes},
              {"fault_tolerance", Kind::kInt, true, 0, kMaxWorkerId - 1},
              {"microbatches", Kind::kInt, true, 1, INT32_MAX}};
    case Type::kDone:
      return {{"step", Kind::kInt, true, -1, kMaxStep}};
    case Type::kExpelled:
      return {{"reason", Kind::kString, false, 0, kMaxText}};
    case Type::kRebuild:
      return {};
    case Type::kReady:
      return {{"resume_step", Kind::kInt, true, 0, kMaxStep},
              {"global_batch", Kind::kInt, false, 1, kMaxStep},
              {"microbatch", Kind::kInt, false, 1, kMaxStep},
              {"steps", Kind::kInt, false, 0, kMaxStep},
              {"checkpoints", Kind::kBool, false, 0, 0}};
    case Type::kDurable:
      return {{"step", Kind::kInt, true, 0, kMaxStep},
              {"bytes", Kind::kInt, true, 0, kMaxStep},
              {"flush_us", Kind::kInt, true, 0, kMaxStep},
              {"path", Kind::kString, true, 1, kMaxText}};
    case Type::kLeave:
      return {{"step", Kind::kInt, true, -1, kMaxStep}};
    case Type::kRollback:
      return {{"step", Kind::kInt, true, -1, kMaxStep}};
    case Type::kReleased:
      return {{"step", Kind::kInt, true, -1, kMaxStep},
              {"reason", Kind::kString, false, 0, kMaxText}};
  }
  return {};
}

bool isInt(const json& v) { return v.is_number_integer(); }

int64_t intValue(const json& v) {
  // An unsigned value above INT64_MAX is out of every range we accept.
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) return INT64_MAX;
  return v.get<int64_t>();
}

}  // namespace

const char* typeName(uint8_t type) {
  switch (static_cast<Type>(type)) {
    case Type::kHello:
      return "hello";
    case Type::kWelcome:
      return "welcome";
    case Type::kHeartbeat:
      return "heartbeat";
    case Type::kLost:
      return "lost";
    case Type::kVote:
      return "vote";
    case Type::kCommit:
      return "commit";
    case Type::kEpoch:
      return "epoch";
    case Type::kDone:
      return "done";
    case Type::kExpelled:
      return "expelled";
    case Type::kRebuild:
      return "rebuild";
    case Type::kReady:
      return "ready";
    case Type::kLeave:
      return "leave";
    case Type::kReleased:
      return "released";
    case Type::kPipeline:
      return "pipeline";
    case Type::kDurable:
      return "durable";
    case Type::kRollback:
      return "rollback";
  }
  return nullptr;
}

const char* workerTypeName(uint8_t type) {
  switch (static_cast<Type>(type)) {
    case Type::kHello:
    case Type::kHeartbeat:
    case Type::kLost:
    case Type::kVote:
    case Type::kDone:
    case Type::kRebuild:
    case Type::kReady:
    case Type::kLeave:
    case Type::kPipeline:
    case Type::kDurable:
    case Type::kRollback:
      return typeName(type);
    default:
      return nullptr;
  }
}

const char* coordinatorTypeName(uint8_t type) {
  if (typeName(type) == nullptr || workerTypeName(type) != nullptr) return nullptr;
  return typeName(type);
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
  const char* name = typeName(type);
  if (name == nullptr) SINEW_THROW(Corruption, "coordinator message of unknown type ", int(type));
  json body = json::parse(payload.begin(), payload.end(), nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    SINEW_THROW(Corruption, name, " message: payload is not a JSON object");
  }
  for (const Field& f : fieldsOf(static_cast<Type>(type))) {
    auto it = body.find(f.name);
    if (it == body.end()) {
      if (f.required) SINEW_THROW(Corruption, name, " message: field '", f.name, "' is missing");
      continue;
    }
    const json& v = *it;
    switch (f.kind) {
      case Kind::kInt: {
        if (!isInt(v)) {
          SINEW_THROW(Corruption, name, " message: field '", f.name, "' = ", v.dump(),
                      " is not an integer");
        }
        int64_t x = intValue(v);
        if (x < f.min || x > f.max) {
          SINEW_THROW(Corruption, name, " message: field '", f.name, "' = ", v.dump(),
                      " is outside [", f.min, ", ", f.max, "]");
        }
        break;
      }
      case Kind::kString:
        if (!v.is_string()) {
          SINEW_THROW(Corruption, name, " message: field '", f.name, "' is not a string");
        }
        if (int64_t(v.get_ref<const std::string&>().size()) < f.min ||
            int64_t(v.get_ref<const std::string&>().size()) > f.max) {
          SINEW_THROW(Corruption, name, " message: field '", f.name, "' has ",
                      v.get_ref<const std::string&>().size(), " characters, outside [", f.min, ", ",
                      f.max, "]");
        }
        break;
      case Kind::kBool:
        if (!v.is_boolean()) {
          SINEW_THROW(Corruption, name, " message: field '", f.name, "' = ", v.dump(),
                      " is not a boolean");
        }
        break;
      case Kind::kIntArray:
        if (!v.is_array() || int64_t(v.size()) > f.max) {
          SINEW_THROW(Corruption, name, " message: field '", f.name,
                      "' is not an array of at most ", f.max, " worker ids");
        }
        for (const json& e : v) {
          if (!isInt(e) || intValue(e) < 0 || intValue(e) >= kMaxWorkerId) {
            SINEW_THROW(Corruption, name, " message: field '", f.name, "' holds ", e.dump(),
                        ", not a worker id in [0, ", kMaxWorkerId, ")");
          }
        }
        break;
    }
  }
  return body;
}

}  // namespace wire
}  // namespace runtime
}  // namespace sinew
