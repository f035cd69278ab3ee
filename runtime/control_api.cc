#include "sinew/runtime/control_api.h"

#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <set>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace runtime {
int signalNumber(const std::string& what, const std::string& name) {
  static const std::pair<const char*, int> kNames[] = {
      {"HUP", SIGHUP},   {"INT", SIGINT},   {"QUIT", SIGQUIT}, {"USR1", SIGUSR1},
      {"USR2", SIGUSR2}, {"TERM", SIGTERM}, {"XCPU", SIGXCPU}, {"URG", SIGURG}};
  std::string n = name.rfind("SIG", 0) == 0 ? name.substr(3) : name;
  for (const auto& [text, number] : kNames) {
    if (n == text) return number;
  }
  if (!n.empty() && n.size() <= 2 && std::all_of(n.begin(), n.end(), ::isdigit)) {
    const int number = std::stoi(n);
    if (number >= 1 && number <= 64 && number != SIGKILL && number != SIGSTOP) return number;
  }
  SINEW_THROW(InvalidArgument, what, " = '", name,
              "' is not a signal that can be caught (USR1, USR2, TERM, HUP, INT, QUIT, XCPU, "
              "URG, or a number)");
}

namespace control {

using nlohmann::json;

namespace {

// The paths, and the method each takes.
struct Route {
  const char* path;
  const char* method;
};
constexpr Route kRoutes[] = {
    {"/v1/status", "GET"},      {"/v1/scaling", "GET"}, {"/v1/events", "GET"},
    {"/metrics", "GET"},        {"/v1/resize", "POST"}, {"/v1/drain", "POST"},
    {"/v1/checkpoint", "POST"}, {"/v1/stop", "POST"},   {"/v1/limits", "POST"},
};

std::string pathList() {
  std::string out;
  for (const Route& r : kRoutes)
    out += std::string(out.empty() ? "" : ", ") + r.method + " " + r.path;
  return out;
}

// Fields other than `known` are an error: a misspelt field must not be silently ignored.
void onlyFields(const json& body, std::initializer_list<const char*> known, const char* what) {
  for (auto it = body.begin(); it != body.end(); ++it) {
    bool ok = false;
    for (const char* k : known) ok = ok || it.key() == k;
    if (!ok) {
      std::string names;
      for (const char* k : known) names += std::string(names.empty() ? "" : ", ") + "'" + k + "'";
      SINEW_THROW(InvalidArgument, what, ": unknown field '", it.key(), "' (known: ", names, ")");
    }
  }
}

double deadlineOf(const json& v, const char* what) {
  if (!v.is_number()) {
    SINEW_THROW(InvalidArgument, what, ": 'deadline_s' = ", detail::jsonPreview(v),
                " is not a number");
  }
  double d = v.get<double>();
  if (!(d > 0) || !(d <= kMaxDeadlineSeconds)) {
    SINEW_THROW(InvalidArgument, what, ": 'deadline_s' = ", detail::jsonPreview(v),
                " must be in (0, ", kMaxDeadlineSeconds, "] seconds");
  }
  return d;
}

Answer jsonAnswer(const ControlReply& r) {
  Answer a;
  a.status = r.status;
  a.body = r.body.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  return a;
}

}  // namespace

bool authorized(std::string_view authorization, const std::string& token) {
  // The scheme is case-insensitive (RFC 9110, section 11.1): "bearer" and "BEARER" too.
  constexpr std::string_view kBearer = "bearer ";
  if (token.empty() || authorization.size() != kBearer.size() + token.size()) return false;
  for (size_t i = 0; i < kBearer.size(); ++i) {
    const char c = authorization[i];
    if ((c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c) != kBearer[i]) return false;
  }
  unsigned diff = 0;
  for (size_t i = 0; i < token.size(); ++i) {
    diff |= static_cast<unsigned char>(authorization[kBearer.size() + i]) ^
            static_cast<unsigned char>(token[i]);
  }
  return diff == 0;
}

Role roleOf(std::string_view authorization, const std::string& controlToken,
            const std::string& readToken) {
  if (authorized(authorization, controlToken)) return Role::kControl;
  if (!readToken.empty() && authorized(authorization, readToken)) return Role::kRead;
  return Role::kNone;
}

bool allows(Role role, std::string_view method) {
  return role == Role::kControl || (role == Role::kRead && method == "GET");
}

Answer errorAnswer(int status, const std::string& message) {
  ControlReply r;
  r.status = status;
  r.body = json{{"error", message}};
  return jsonAnswer(r);
}

json parseObject(std::string_view body) {
  if (body.empty()) return json::object();
  if (detail::jsonTooDeep(body.data(), body.data() + body.size())) {
    SINEW_THROW(InvalidArgument, "the request body nests JSON deeper than ", detail::kMaxJsonDepth,
                " levels");
  }
  json v = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) SINEW_THROW(InvalidArgument, "the request body is not valid JSON");
  if (!v.is_object()) {
    SINEW_THROW(InvalidArgument, "the request body must be a JSON object, not ", v.type_name());
  }
  return v;
}

// Whether v is an integer in [lo, hi] (a large unsigned one is not read as negative).
static bool integerIn(const json& v, int64_t lo, int64_t hi) {
  return v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi)) &&
         v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
}

int64_t parseResize(const json& body) {
  onlyFields(body, {"nodes"}, "resize");
  if (!body.contains("nodes")) SINEW_THROW(InvalidArgument, "resize: field 'nodes' is missing");
  const json& v = body.at("nodes");
  if (!integerIn(v, 1, kMaxNodes)) {
    SINEW_THROW(InvalidArgument, "resize: 'nodes' = ", detail::jsonPreview(v),
                " must be an integer in [1, ", kMaxNodes, "]");
  }
  return v.get<int64_t>();
}

DrainRequest parseDrain(const json& body) {
  onlyFields(body, {"nodes", "workers", "deadline_s", "dry_run"}, "drain");
  DrainRequest r;
  if (body.contains("dry_run")) {
    if (!body.at("dry_run").is_boolean()) {
      SINEW_THROW(InvalidArgument, "drain: 'dry_run' is ", detail::jsonPreview(body.at("dry_run")),
                  ", not true or false");
    }
    r.dryRun = body.at("dry_run").get<bool>();
  }
  const bool nodes = body.contains("nodes"), workers = body.contains("workers");
  if (nodes == workers) {
    SINEW_THROW(InvalidArgument, "drain: give exactly one of 'nodes' (names) and 'workers' (ids)");
  }
  const json& list = body.at(nodes ? "nodes" : "workers");
  const char* field = nodes ? "nodes" : "workers";
  if (!list.is_array() || list.empty() || list.size() > kMaxListed) {
    SINEW_THROW(InvalidArgument, "drain: '", field, "' must be a non-empty array of at most ",
                kMaxListed, " entries");
  }
  for (const json& e : list) {
    if (nodes) {
      if (!e.is_string() || e.get<std::string>().empty() || e.get<std::string>().size() > 255) {
        SINEW_THROW(InvalidArgument, "drain: 'nodes' holds ", detail::jsonPreview(e),
                    ", not a node name of 1 to 255 characters");
      }
      r.nodes.push_back(e.get<std::string>());
    } else {
      if (!integerIn(e, 0, INT32_MAX)) {
        SINEW_THROW(InvalidArgument, "drain: 'workers' holds ", detail::jsonPreview(e),
                    ", not a worker id");
      }
      r.workers.push_back(e.get<int>());
    }
  }
  if (!body.contains("deadline_s")) {
    if (r.dryRun) return r;
    SINEW_THROW(InvalidArgument, "drain: field 'deadline_s' is missing");
  }
  r.deadlineSeconds = deadlineOf(body.at("deadline_s"), "drain");
  return r;
}

std::string JobLimits::refuses(int64_t nodes) const {
  if (minNodes > 0 && nodes < minNodes) {
    return "below the job's min_nodes " + std::to_string(minNodes);
  }
  if (maxNodes > 0 && nodes > maxNodes) {
    return "above the job's max_nodes " + std::to_string(maxNodes);
  }
  if (!sizes.empty() && !std::binary_search(sizes.begin(), sizes.end(), nodes)) {
    std::string list;
    for (int64_t n : sizes) list += (list.empty() ? "" : ", ") + std::to_string(n);
    return "not one of the job's sizes [" + list + "]";
  }
  return "";
}

json JobLimits::toJson() const {
  return json{
      {"min_nodes", minNodes > 0 ? json(minNodes) : json(nullptr)},
      {"max_nodes", maxNodes > 0 ? json(maxNodes) : json(nullptr)},
      {"sizes", sizes},
      {"deadline_unix_s", deadlineUnixSeconds > 0 ? json(deadlineUnixSeconds) : json(nullptr)},
      {"preemptible", preemptible},
      {"priority", priority}};
}

void validateLimits(const JobLimits& l) {
  auto count = [](const char* field, int64_t v) {
    if (v < 0 || v > kMaxNodes) {
      SINEW_THROW(InvalidArgument, "limits: '", field, "' = ", v, " must be in [0, ", kMaxNodes,
                  "] (0: no limit)");
    }
  };
  count("min_nodes", l.minNodes);
  count("max_nodes", l.maxNodes);
  if (l.minNodes > 0 && l.maxNodes > 0 && l.minNodes > l.maxNodes) {
    SINEW_THROW(InvalidArgument, "limits: min_nodes ", l.minNodes, " is above max_nodes ",
                l.maxNodes);
  }
  if (l.sizes.size() > kMaxListed) {
    SINEW_THROW(InvalidArgument, "limits: 'sizes' lists more than ", kMaxListed, " counts");
  }
  for (size_t i = 0; i < l.sizes.size(); ++i) {
    const int64_t n = l.sizes[i];
    if (n < 1 || n > kMaxNodes) {
      SINEW_THROW(InvalidArgument, "limits: 'sizes' holds ", n, ", not a node count in [1, ",
                  kMaxNodes, "]");
    }
    if (i > 0 && n <= l.sizes[i - 1]) {
      SINEW_THROW(InvalidArgument, "limits: 'sizes' must ascend without repeats (", l.sizes[i - 1],
                  " then ", n, ")");
    }
    if ((l.minNodes > 0 && n < l.minNodes) || (l.maxNodes > 0 && n > l.maxNodes)) {
      SINEW_THROW(InvalidArgument, "limits: size ", n, " is outside [min_nodes, max_nodes] = [",
                  l.minNodes, ", ", l.maxNodes > 0 ? std::to_string(l.maxNodes) : "none", "]");
    }
  }
  if (!std::isfinite(l.deadlineUnixSeconds) || l.deadlineUnixSeconds < 0 ||
      l.deadlineUnixSeconds > 1e11) {
    SINEW_THROW(InvalidArgument, "limits: 'deadline_unix_s' = ", l.deadlineUnixSeconds,
                " is not a time in seconds since 1970 (0: none)");
  }
  if (l.priority < -1000 || l.priority > 1000) {
    SINEW_THROW(InvalidArgument, "limits: 'priority' = ", l.priority, " must be in [-1000, 1000]");
  }
}

JobLimits parseLimits(const json& body, JobLimits l) {
  onlyFields(body,
             {"min_nodes", "max_nodes", "sizes", "deadline_unix_s", "preemptible", "priority"},
             "limits");
  auto integer = [&](const char* field, int64_t lo, int64_t hi) -> int64_t {
    const json& v = body.at(field);
    if (v.is_null()) return 0;
    if (!integerIn(v, lo, hi)) {
      SINEW_THROW(InvalidArgument, "limits: '", field, "' = ", detail::jsonPreview(v),
                  " must be an integer in [", lo, ", ", hi, "] or null");
    }
    return v.get<int64_t>();
  };
  if (body.contains("min_nodes")) l.minNodes = integer("min_nodes", 0, kMaxNodes);
  if (body.contains("max_nodes")) l.maxNodes = integer("max_nodes", 0, kMaxNodes);
  if (body.contains("priority")) l.priority = integer("priority", -1000, 1000);
  if (body.contains("sizes")) {
    const json& v = body.at("sizes");
    l.sizes.clear();
    if (!v.is_null()) {
      if (!v.is_array() || v.size() > kMaxListed) {
        SINEW_THROW(InvalidArgument, "limits: 'sizes' must be an array of at most ", kMaxListed,
                    " node counts, or null");
      }
      for (const json& e : v) {
        if (!integerIn(e, 1, kMaxNodes)) {
          SINEW_THROW(InvalidArgument, "limits: 'sizes' holds ", detail::jsonPreview(e),
                      ", not a node count in [1, ", kMaxNodes, "]");
        }
        l.sizes.push_back(e.get<int64_t>());
      }
    }
  }
  if (body.contains("deadline_unix_s")) {
    const json& v = body.at("deadline_unix_s");
    if (v.is_null()) {
      l.deadlineUnixSeconds = 0;
    } else if (!v.is_number()) {
      SINEW_THROW(InvalidArgument, "limits: 'deadline_unix_s' = ", detail::jsonPreview(v),
                  " is not a number of seconds since 1970, or null");
    } else {
      l.deadlineUnixSeconds = v.get<double>();
    }
  }
  if (body.contains("preemptible")) {
    const json& v = body.at("preemptible");
    if (!v.is_boolean()) {
      SINEW_THROW(InvalidArgument, "limits: 'preemptible' = ", detail::jsonPreview(v),
                  " is not true or false");
    }
    l.preemptible = v.get<bool>();
  }
  validateLimits(l);
  return l;
}

void parseCheckpoint(const json& body) {
  onlyFields(body, {"durable"}, "checkpoint");
  if (body.contains("durable")) {
    const json& v = body.at("durable");
    if (!v.is_boolean()) {
      SINEW_THROW(InvalidArgument, "checkpoint: 'durable' = ", detail::jsonPreview(v),
                  " is not true or false");
    }
    if (!v.get<bool>()) {
      SINEW_THROW(InvalidArgument,
                  "checkpoint: 'durable' = false (a copy in host memory only) is not offered: "
                  "every checkpoint this job takes is written to its checkpoint directory");
    }
  }
}

double parseStop(const json& body) {
  onlyFields(body, {"deadline_s"}, "stop");
  return body.contains("deadline_s") ? deadlineOf(body.at("deadline_s"), "stop") : 0;
}

// GET /v1/events: a stream without a query; with after, wait_s or limit, a long poll.
static Answer eventsAnswer(std::string_view target) {
  Answer a;
  const size_t q = target.find('?');
  if (q == std::string_view::npos) {
    a.contentType = "text/event-stream";
    a.eventStream = true;
    return a;
  }
  a.longPoll = true;
  std::string_view query = target.substr(q + 1);
  while (!query.empty()) {
    const std::string_view pair = query.substr(0, query.find('&'));
    query = pair.size() < query.size() ? query.substr(pair.size() + 1) : std::string_view();
    if (pair.empty()) continue;
    const size_t eq = pair.find('=');
    const std::string key(pair.substr(0, std::min(eq, size_t{32})));
    const std::string value(eq == std::string_view::npos ? "" : pair.substr(eq + 1, 32));
    auto number = [&](double lo, double hi) {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);
      if (value.empty() || end != value.c_str() + value.size() || !(v >= lo && v <= hi)) {
        SINEW_THROW(InvalidArgument, "events: '", key, "' is '", value, "', not a number in [", lo,
                    ", ", hi, "]");
      }
      return v;
    };
    if (key == "after") {
      a.after = static_cast<int64_t>(number(-1, 9e15));
    } else if (key == "wait_s") {
      a.waitSeconds = number(0, kMaxEventWaitSeconds);
    } else if (key == "limit") {
      a.limit = static_cast<size_t>(number(1, 1000));
    } else {
      SINEW_THROW(InvalidArgument, "events: unknown query parameter '", key,
                  "' (the parameters are after, wait_s and limit)");
    }
  }
  return a;
}

Answer route(Backend& backend, std::string_view method, std::string_view target,
             std::string_view body) {
  std::string_view path = target.substr(0, target.find('?'));
  const Route* found = nullptr;
  for (const Route& r : kRoutes) {
    if (path == r.path) found = &r;
  }
  if (found == nullptr) {
    std::string shown(path.substr(0, 200));
    return errorAnswer(404, "no such path '" + shown + "' (the API has: " + pathList() + ")");
  }
  if (method != found->method) {
    Answer a = errorAnswer(405, std::string(found->path) + " takes " + found->method + ", not " +
                                    std::string(method.substr(0, 32)));
    a.allow = found->method;
    return a;
  }
  try {
    if (path == "/v1/status") return jsonAnswer(backend.status());
    if (path == "/v1/scaling") return jsonAnswer(backend.scaling());
    if (path == "/metrics") {
      Answer a;
      a.contentType = "text/plain; version=0.0.4; charset=utf-8";
      a.body = backend.metrics();
      return a;
    }
    if (path == "/v1/events") return eventsAnswer(target);
    json request = parseObject(body);
    if (path == "/v1/resize") return jsonAnswer(backend.resize(parseResize(request)));
    if (path == "/v1/limits") return jsonAnswer(backend.limits(request));
    if (path == "/v1/drain") return jsonAnswer(backend.drain(parseDrain(request)));
    if (path == "/v1/checkpoint") {
      parseCheckpoint(request);
      return jsonAnswer(backend.checkpoint());
    }
    return jsonAnswer(backend.stop(parseStop(request)));
  } catch (const InvalidArgument& e) {
    return errorAnswer(400, e.what());
  } catch (const std::exception& e) {
    return errorAnswer(500, std::string("internal error: ") + e.what());
  }
}

std::string sseEvent(int64_t seq, const json& event) {
  std::string name = event.value("event", std::string("event"));
  // An event name is one line of safe characters.
  for (char& c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) c = '_';
  }
  return "id: " + std::to_string(seq) + "\nevent: " + name +
         "\ndata: " + event.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

}  // namespace control
}  // namespace runtime
}  // namespace sinew
