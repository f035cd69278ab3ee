// sinewctl: a scheduler's or a person's client of a running job's control API
// (docs/control_api.md). It finds the API in the job's coordinator.json (sinew-run writes it
// in its --log-dir; under mpirun, SINEW_LOG_DIR of rank 0), in etcd for a high-availability
// job (the leader key names the serving candidate's control API, docs/ha.md; the token is
// SINEW_TOKEN's unless --token), or takes --url and --token, and prints tables for people or
// the API's JSON with --json.
//
//   sinewctl [--log-dir DIR | --etcd EPS --job NAME | --url URL --token T] [--json]
//            status|scaling|metrics
//   sinewctl ... resize NODES
//   sinewctl ... drain (--workers 1,2 | --nodes a,b) (--deadline-s T | --dry-run)
//   sinewctl ... checkpoint
//   sinewctl ... stop [--deadline-s T]
//   sinewctl ... events [--count N]   (the newest N, newest first; default 20)
//   sinewctl ... events --follow [--count N]     (as they come; stops after N if given)
//   sinewctl ... events --after SEQ [--wait-s T] (those after SEQ, waiting up to T for one)
//   sinewctl ... limits [JSON]        (the job's limits; with JSON, changes them)
//   sinewctl --log-dir DIR outcome
//
// Exit status: 0 when the API answered 200, 1 when it answered an error (printed) or could not
// be reached, 2 for bad arguments. `outcome` reads how an ended job ended from DIR/outcome.json
// (no API: the job is over), prints its line and exits with the job's status: 0 finished, 75
// stopped (resumable), 1 failed; 2 when there is no outcome (the job has not ended). It is the
// honest status of a job under `mpirun --enable-recovery`, which exits 0 whatever happened.

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "control_http.h"
#include "sinew/base/parse.h"
#include "sinew/collectives/etcd_client.h"
#include "sinew/runtime/job_outcome.h"

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using asio::ip::tcp;
using nlohmann::json;

struct Target {
  std::string host;
  std::string port;
  std::string token;
};

[[noreturn]] void fail(int code, const std::string& why) {
  std::fprintf(stderr, "sinewctl: %s\n", why.c_str());
  std::exit(code);
}

Target findTarget(const std::string& logDir, const std::string& url, const std::string& token) {
  Target t;
  if (!url.empty()) {
    std::string rest = url;
    if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
    if (!rest.empty() && rest.back() == '/') rest.pop_back();
    auto colon = rest.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == rest.size()) {
      fail(2, "--url '" + url + "' is not http://host:port");
    }
    t.host = rest.substr(0, colon);
    t.port = rest.substr(colon + 1);
    t.token = token;
    if (t.token.empty()) fail(2, "--url needs --token (or use --log-dir)");
    return t;
  }
  const std::string path = (logDir.empty() ? std::string(".") : logDir) + "/coordinator.json";
  std::ifstream in(path);
  if (!in) fail(2, "cannot read " + path + " (give --log-dir of the job, or --url and --token)");
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("control_port")) {
    fail(2, path + " has no control_port: the job serves no control API (sinew-run --no-control?)");
  }
  t.host = j.value("control_host", std::string("127.0.0.1"));
  t.port = std::to_string(j.at("control_port").get<int>());
  t.token = token.empty() ? j.value("control_token", std::string()) : token;
  return t;
}

// A high-availability job's control API: the one its serving leader names in etcd (waits up to
// `timeout` for a leader that serves, as one may be taking over).
Target findLeader(const std::string& endpoints, const std::string& job, const std::string& token,
                  std::chrono::seconds timeout) {
  Target t;
  if (job.empty()) fail(2, "--etcd needs --job");
  t.token = token;
  // The job token (SINEW_TOKEN), when this shell has it: the leader's value must be sealed with
  // it, so the bearer token goes only to an address a leader of this job named.
  const char* env = std::getenv("SINEW_TOKEN");
  const auto jobToken = sinew::detail::tryParseToken(env ? env : "");
  if (t.token.empty()) {
    // The control API's default token is the job token in hex, as sinew-coordinator prints it.
    if (!jobToken)
      fail(2, "--etcd needs --token, or SINEW_TOKEN set to the job token (hexadecimal)");
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%llx", static_cast<unsigned long long>(*jobToken));
    t.token = hex;
  }
  const std::string key = "/sinew/" + job + "/leader";
  json leader;
  try {
    // Credentials and TLS from SINEW_ETCD_USER, SINEW_ETCD_PASSWORD(_FILE), SINEW_ETCD_CA, ...
    sinew::collectives::EtcdOptions o =
        sinew::collectives::etcdOptionsFromEnvironment(endpoints, "--etcd");
    o.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
    sinew::collectives::EtcdClient etcd(o);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string why = "no leader key";
    while (true) {
      auto kv = etcd.get(key);
      if (kv && jobToken) {
        auto opened = sinew::collectives::openServingLeader(*kv, *jobToken, &why);
        if (opened) leader = json::parse(*opened);
      } else if (kv) {
        leader = sinew::detail::tryParseJson(kv->value);  // not checked: no job token here
      }
      if (leader.is_object() && leader.contains("port")) break;  // It serves.
      if (std::chrono::steady_clock::now() >= deadline) {
        fail(1, "job '" + job + "' has no serving leader in etcd (" + key + "; " + why + ")");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception& e) {
    fail(1, std::string("cannot read the job's leader from etcd: ") + e.what());
  }
  const int port = leader.value("control_port", 0);
  if (port <= 0) {
    fail(1, "the leader of job '" + job + "' (" + leader.value("candidate", std::string("?")) +
                ") serves no control API: start sinew-coordinator with --control-port");
  }
  t.host = leader.value("control_host", std::string("127.0.0.1"));
  t.port = std::to_string(port);
  return t;
}

tcp::socket connectTo(asio::io_context& io, const Target& t) {
  tcp::resolver resolver(io);
  tcp::socket socket(io);
  boost::system::error_code ec;
  auto endpoints = resolver.resolve(t.host, t.port, ec);
  if (!ec) asio::connect(socket, endpoints, ec);
  if (ec) fail(1, "cannot reach the control API at " + t.host + ":" + t.port + ": " + ec.message());
  return socket;
}

// One request; returns (status, body), or fails (exit 1) saying why.
std::pair<int, std::string> request(const Target& t, http::verb method, const std::string& path,
                                    const std::string& body, std::chrono::seconds timeout) {
  try {
    return sinew::tools::controlRequest({t.host, t.port, t.token}, method, path, body, timeout,
                                        "sinewctl");
  } catch (const std::exception& e) {
    fail(1, e.what());
  }
}

std::string num(const json& v, int precision = 0) {
  if (v.is_null()) return "-";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (!v.is_number()) return v.dump();
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", precision, v.get<double>());
  return buf;
}

std::string bytes(int64_t b) {
  char buf[64];
  if (b >= (1 << 30)) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", b / double(1 << 30));
  } else if (b >= (1 << 20)) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", b / double(1 << 20));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", b / 1024.0);
  }
  return buf;
}

void printStatus(json s) {  // A copy: a missing field reads as null.
  std::printf("state %s   step %s/%s   epoch %s   nodes %s   samples/s %s (average %s)\n",
              s.value("state", "?").c_str(), num(s["step"]).c_str(), num(s["steps"]).c_str(),
              num(s["epoch"]).c_str(), num(s["nodes"]).c_str(),
              num(s["samples_per_s"]["now"]).c_str(), num(s["samples_per_s"]["average"]).c_str());
  const json& d = s["checkpoint"]["last_durable"];
  if (!s["checkpoint"].value("enabled", false)) {
    std::printf("checkpoints: off\n");
  } else if (d.is_null()) {
    std::printf("checkpoints: none durable yet\n");
  } else {
    std::printf("checkpoint: step %s durable, %s, %s s ago, in %s\n", num(d["step"]).c_str(),
                bytes(d.value("bytes", int64_t(0))).c_str(), num(d["age_s"], 1).c_str(),
                d.value("path", "?").c_str());
  }
  std::string rec;
  for (const auto& r : s["recovery_s"]) rec += (rec.empty() ? "" : ", ") + num(r, 2) + " s";
  std::printf("failures %s; recoveries [%s]; effective training %s s of %s s\n",
              num(s["failures"]).c_str(), rec.c_str(), num(s["effective_training_s"], 1).c_str(),
              num(s["wall_s"], 1).c_str());
  std::printf("%-7s %-20s %-8s %-8s %-10s %-10s %s\n", "WORKER", "NODE", "PID", "STEP", "HEARTBEAT",
              "COMPUTE", "SHARE");
  for (const auto& m : s["members"]) {
    std::printf("%-7s %-20s %-8s %-8s %-10s %-10s %s%s\n", num(m["worker"]).c_str(),
                m.value("node", "?").c_str(), num(m["pid"]).c_str(), num(m["step"]).c_str(),
                (num(m["heartbeat_age_s"], 3) + " s").c_str(),
                m["compute_s"].is_null() ? "-" : (num(m["compute_s"], 4) + " s").c_str(),
                num(m["step_time_share"], 2).c_str(), m.value("leaving", false) ? " leaving" : "");
  }
  for (const auto& dr : s["drains"]) {
    std::string ws;
    for (const auto& w : dr["workers"]) {
      ws += (ws.empty() ? "" : ", ") + num(w["worker"]) + " " + w.value("state", "?");
    }
    std::printf("drain %s: [%s] release step %s, safe to kill: %s%s\n", num(dr["id"]).c_str(),
                ws.c_str(), num(dr["release_step"]).c_str(),
                dr.value("safe_to_kill", false) ? "yes" : "no",
                dr.value("deadline_missed", false) ? " (deadline missed)" : "");
  }
}

void printScaling(json s) {
  std::printf("model: %s\n", s.value("model", "?").c_str());
  std::printf("%-6s %-8s %-9s %-10s %-10s %-13s %-9s %-10s %-9s %s\n", "NODES", "WORKERS",
              "FEASIBLE", "MEASURED", "PREDICTED", "BASIS", "PAUSE_S", "BYTES", "ROLLBACK",
              "FINISH_S");
  for (auto p : s["points"]) {
    json c = p.value("cost", json::object());
    std::printf(
        "%-6s %-8s %-9s %-10s %-10s %-13s %-9s %-10s %-9s %s%s\n", num(p["nodes"]).c_str(),
        num(p["workers"]).c_str(), p.value("feasible", false) ? "yes" : "no",
        p.contains("measured_samples_per_s") ? num(p["measured_samples_per_s"]).c_str() : "-",
        num(p.value("predicted_samples_per_s", json(nullptr))).c_str(),
        p.value("basis", json("-")).is_string() ? p.value("basis", "-").c_str() : "-",
        num(c["pause_s"], 2).c_str(),
        c["bytes"].is_number() ? bytes(c["bytes"].get<int64_t>()).c_str() : "-",
        c["rollback"].is_boolean() ? (c["rollback"].get<bool>() ? "yes" : "no") : "-",
        num(p.value("time_to_finish_s", json(nullptr)), 1).c_str(),
        p.value("nodes", 0) == s.value("nodes_now", -1) ? "   <- now" : "");
  }
  if (s["node_costs"].is_array() && !s["node_costs"].empty()) {
    std::printf("cheapest nodes to take back first:\n%-20s %-10s %-14s %s\n", "NODE", "WORKERS",
                "SAMPLES/S AFTER", "BYTES");
    for (auto c : s["node_costs"]) {
      std::printf("%-20s %-10s %-14s %s\n", c.value("node", "?").c_str(),
                  c["workers"].dump().c_str(), num(c["samples_per_s_after"]).c_str(),
                  c["bytes"].is_number() ? bytes(c["bytes"].get<int64_t>()).c_str() : "-");
    }
  }
}

// One event as a line: its time, its name and its other fields. An event that is no object
// (or is nested too deep to parse) is not shown.
void printEvent(const json& e) {
  if (!e.is_object()) return;
  std::string rest;
  for (auto it = e.begin(); it != e.end(); ++it) {
    if (it.key() == "event" || it.key() == "time") continue;
    rest += " " + it.key() + "=" + it.value().dump();
  }
  const auto time = e.find("time");
  const auto name = e.find("event");
  std::printf("%.3f %s%s\n", time != e.end() && time->is_number() ? time->get<double>() : 0.0,
              name != e.end() && name->is_string() ? name->get<std::string>().c_str() : "?",
              rest.c_str());
}

// GET /v1/events?after=...: the events after `after` (waiting up to `waitS` for one), printed
// oldest first; or, with newest > 0 and after < 0, the newest `newest` of those the job keeps,
// newest first.
int pollEvents(const Target& t, bool asJson, int64_t after, double waitS, int newest,
               std::chrono::seconds timeout) {
  char query[96];
  std::snprintf(query, sizeof(query), "/v1/events?after=%lld&wait_s=%g&limit=1000",
                static_cast<long long>(after), waitS);
  auto [code, text] = request(t, http::verb::get, query, "",
                              timeout + std::chrono::seconds(static_cast<int64_t>(waitS)));
  const json j = sinew::detail::tryParseJson(text);
  if (code != 200 || !j.is_object() || !j.contains("events") || !j["events"].is_array()) {
    const std::string why =
        code != 200 && j.is_object() && j.contains("error") && j["error"].is_string()
            ? j["error"].get<std::string>()
            : text.substr(0, 200);
    std::fprintf(stderr, "sinewctl: /v1/events answered %d: %s\n", code, why.c_str());
    return 1;
  }
  std::vector<json> events(j["events"].begin(), j["events"].end());
  if (newest > 0 && after < 0) {
    std::reverse(events.begin(), events.end());
    if (events.size() > static_cast<size_t>(newest)) events.resize(newest);
  }
  for (const json& e : events) {
    if (asJson) {
      std::printf("%s\n", e.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
    } else {
      printEvent(e);
    }
  }
  if (!asJson) std::fprintf(stderr, "next: %s\n", j.value("next", json(nullptr)).dump().c_str());
  return 0;
}

// GET /v1/events: prints each event as it comes until the stream ends or `count` were seen.
int streamEvents(const Target& t, bool asJson, int count) {
  asio::io_context io;
  tcp::socket socket = connectTo(io, t);
  std::string req = "GET /v1/events HTTP/1.1\r\nHost: " + t.host + "\r\nAuthorization: Bearer " +
                    t.token + "\r\nAccept: text/event-stream\r\n\r\n";
  boost::system::error_code ec;
  asio::write(socket, asio::buffer(req), ec);
  if (ec) fail(1, "events: " + ec.message());
  asio::streambuf buf;
  asio::read_until(socket, buf, "\r\n\r\n", ec);
  if (ec) fail(1, "events: " + ec.message());
  std::istream in(&buf);
  std::string status;
  std::getline(in, status);
  if (status.find(" 200 ") == std::string::npos) {
    fail(1, "events: the API answered '" + status.substr(0, status.size() - 1) + "'");
  }
  std::string line;
  while (std::getline(in, line) && line != "\r") {
  }
  int seen = 0;
  while (true) {
    while (std::getline(in, line)) {
      if (in.eof()) {  // A partial line: keep it for the next read.
        std::string rest = line;
        in.clear();
        std::ostream out(&buf);
        out << rest;
        break;
      }
      if (line.rfind("data: ", 0) != 0) continue;
      const std::string data = line.substr(6);
      // An event that is no object (or is nested too deep to parse) is not shown.
      const json e = sinew::detail::tryParseJson(data);
      if (asJson) {
        std::printf("%s\n", data.c_str());
      } else {
        printEvent(e);
      }
      std::fflush(stdout);
      if (count > 0 && ++seen >= count) return 0;
    }
    in.clear();
    asio::read(socket, buf, asio::transfer_at_least(1), ec);
    if (ec) return 0;  // The job ended.
  }
}

// `outcome`: how the ended job ended, from <logDir>/outcome.json; exits with its status.
int showOutcome(const std::string& logDir, bool asJson) {
  const std::string path =
      (logDir.empty() ? std::string(".") : logDir) + "/" + sinew::runtime::kOutcomeFile;
  try {
    const json o = sinew::runtime::readOutcomeFile(path);
    std::printf("%s\n", asJson ? o.dump(2).c_str() : sinew::runtime::outcomeLine(o).c_str());
    return sinew::runtime::outcomeExitStatus(o);
  } catch (const std::exception& e) {
    fail(2, e.what());
  }
}

// The command line: the global options, each subcommand's, and which subcommand was given.
struct Command {
  std::string logDir, url, token, etcdEndpoints, job;
  bool asJson = false;
  int timeoutS = 30;
  int64_t nodes = 0;    // resize
  bool dryRun = false;  // drain
  std::vector<int> drainWorkers;
  std::vector<std::string> drainNodes;
  double deadline = 0;  // drain, stop
  int count = 0;        // events
  bool follow = false;
  int64_t after = -1;
  double waitS = 0;
  std::string limitsJson;  // limits
  CLI::App* status = nullptr;
  CLI::App* scaling = nullptr;
  CLI::App* metrics = nullptr;
  CLI::App* resize = nullptr;
  CLI::App* drain = nullptr;
  CLI::App* checkpoint = nullptr;
  CLI::App* stop = nullptr;
  CLI::App* events = nullptr;
  CLI::App* limits = nullptr;
  CLI::App* outcome = nullptr;
  CLI::Option* afterOpt = nullptr;
};

// Declares every option and subcommand of `app`, parsed into `c`.
void declare(CLI::App& app, Command& c) {
  app.add_option("--log-dir", c.logDir, "the job's log directory (holds coordinator.json)");
  app.add_option("--url", c.url, "http://host:port of the control API (instead of --log-dir)");
  app.add_option("--etcd", c.etcdEndpoints,
                 "etcd endpoints of a high-availability job (with --job): talk to its leader")
      ->type_name("EPS");
  app.add_option("--job", c.job, "the high-availability job's name (with --etcd)")
      ->type_name("NAME");
  app.add_option("--token", c.token,
                 "bearer token (default: coordinator.json's; with --etcd, SINEW_TOKEN's)");
  app.add_flag("--json", c.asJson, "print the API's JSON instead of tables");
  app.add_option("--timeout-s", c.timeoutS, "seconds to wait for an answer (default 30)")
      ->check(CLI::Range(1, 3600));
  app.require_subcommand(1);
  c.status = app.add_subcommand("status", "the job's state, members and checkpoints");
  c.scaling = app.add_subcommand("scaling", "samples/s per node count, measured and predicted");
  c.metrics = app.add_subcommand("metrics", "the Prometheus metrics");
  c.resize = app.add_subcommand("resize", "shrink or grow the job to NODES nodes");
  c.resize->add_option("nodes", c.nodes, "target node count")
      ->required()
      ->check(CLI::Range(1, 1 << 20));
  c.drain = app.add_subcommand("drain", "free these workers or nodes by a deadline");
  auto* dw = c.drain->add_option("--workers", c.drainWorkers, "worker ids")->delimiter(',');
  auto* dn = c.drain->add_option("--nodes", c.drainNodes, "node names")->delimiter(',');
  dw->excludes(dn);
  c.drain->add_option("--deadline-s", c.deadline, "seconds (required unless --dry-run)");
  c.checkpoint = app.add_subcommand("checkpoint", "a durable checkpoint at the next step");
  c.stop = app.add_subcommand("stop", "stop at the next step boundary, checkpoint durable");
  c.stop->add_option("--deadline-s", c.deadline, "seconds (default: none)");
  c.events = app.add_subcommand(
      "events", "the job's newest events, newest first; or follow them, or wait for the next");
  c.events->add_option("--count", c.count,
                       "the newest this many (default 20); with --follow, stop after this many");
  auto* followFlag = c.events->add_flag("--follow", c.follow, "print each event as it comes");
  c.afterOpt = c.events->add_option("--after", c.after,
                                    "the events after this sequence number (its 'seq'), "
                                    "oldest first");
  c.events->add_option("--wait-s", c.waitS, "with --after: wait up to this long for one")
      ->check(CLI::Range(0.0, 60.0));
  followFlag->excludes(c.afterOpt);
  c.drain->add_flag("--dry-run", c.dryRun, "say what the drain would cost; drain nothing");
  c.limits = app.add_subcommand(
      "limits", "the job's limits and wishes; with JSON (e.g. '{\"min_nodes\": 2}'), change them");
  c.limits->add_option("json", c.limitsJson,
                       "fields of POST /v1/limits: min_nodes, max_nodes, sizes, deadline_unix_s, "
                       "preemptible, priority (null clears one)");
  c.outcome = app.add_subcommand("outcome", "how the ended job ended (exit: its status)");
}

// The control API request of a subcommand other than events and outcome.
struct ApiRequest {
  http::verb verb = http::verb::get;
  std::string path, body;
};

ApiRequest requestOf(const Command& c) {
  ApiRequest q;
  if (c.status->parsed()) q.path = "/v1/status";
  if (c.scaling->parsed()) q.path = "/v1/scaling";
  if (c.metrics->parsed()) q.path = "/metrics";
  if (c.resize->parsed()) q = {http::verb::post, "/v1/resize", json{{"nodes", c.nodes}}.dump()};
  if (c.drain->parsed()) {
    json b = json::object();
    if (!c.dryRun || c.deadline > 0) b["deadline_s"] = c.deadline;
    if (c.dryRun) b["dry_run"] = true;
    if (!c.drainWorkers.empty()) b["workers"] = c.drainWorkers;
    if (!c.drainNodes.empty()) b["nodes"] = c.drainNodes;
    q = {http::verb::post, "/v1/drain", b.dump()};
  }
  if (c.checkpoint->parsed()) {
    q = {http::verb::post, "/v1/checkpoint", json{{"durable", true}}.dump()};
  }
  if (c.limits->parsed()) {
    // The server checks it.
    q = {http::verb::post, "/v1/limits", c.limitsJson.empty() ? "{}" : c.limitsJson};
  }
  if (c.stop->parsed()) {
    q = {http::verb::post, "/v1/stop",
         c.deadline > 0 ? json{{"deadline_s", c.deadline}}.dump() : "{}"};
  }
  return q;
}

// Prints the answer (`code`, `text`) to the request of `path`; returns the exit status.
int showAnswer(const Command& c, const std::string& path, int code, const std::string& text) {
  if (c.metrics->parsed()) {
    std::fputs(text.c_str(), code == 200 ? stdout : stderr);
    return code == 200 ? 0 : 1;
  }
  // An answer nested too deep is shown as text: formatting it would recurse that deep.
  json j = sinew::detail::tryParseJson(text);
  if (code != 200) {
    const std::string why = !j.is_discarded() && j.is_object() && j.contains("error")
                                ? j["error"].get<std::string>()
                                : text;
    std::fprintf(stderr, "sinewctl: %s answered %d: %s\n", path.c_str(), code, why.c_str());
    return 1;
  }
  try {
    if (c.asJson || j.is_discarded()) {
      std::printf("%s\n", j.is_discarded() ? text.c_str() : j.dump(2).c_str());
    } else if (c.status->parsed()) {
      printStatus(j);
    } else if (c.scaling->parsed()) {
      printScaling(j);
    } else if (j.is_object()) {
      for (auto it = j.begin(); it != j.end(); ++it) {
        std::printf("%s: %s\n", it.key().c_str(), it.value().dump().c_str());
      }
    } else {
      std::printf("%s\n", j.dump().c_str());
    }
  } catch (const std::exception& e) {
    // An answer without the fields it should have (another program on the port, a newer or
    // older coordinator): said, never an abort.
    std::fflush(stdout);
    std::fprintf(stderr, "sinewctl: %s answered 200 with a body it cannot show (%s): %s\n",
                 path.c_str(), e.what(), text.substr(0, 200).c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Talks to a running Sinew job's control API (docs/control_api.md).", "sinewctl");
  Command c;
  declare(app, c);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (c.outcome->parsed()) return showOutcome(c.logDir, c.asJson);
  if (!c.etcdEndpoints.empty() && (!c.logDir.empty() || !c.url.empty())) {
    fail(2, "give one of --log-dir, --etcd and --url");
  }
  if (c.drain->parsed() && c.drainWorkers.empty() && c.drainNodes.empty()) {
    fail(2, "drain needs --workers or --nodes");
  }
  if (c.drain->parsed() && !c.dryRun && c.deadline <= 0) fail(2, "drain needs --deadline-s T");
  const std::chrono::seconds timeout(c.timeoutS);
  const Target t = c.etcdEndpoints.empty() ? findTarget(c.logDir, c.url, c.token)
                                           : findLeader(c.etcdEndpoints, c.job, c.token, timeout);
  if (c.events->parsed()) {
    if (c.follow) return streamEvents(t, c.asJson, c.count);
    const bool after = c.afterOpt->count() > 0;
    return pollEvents(t, c.asJson, c.after, after ? c.waitS : 0,
                      after ? 0 : (c.count > 0 ? c.count : 20), timeout);
  }
  const ApiRequest q = requestOf(c);
  auto [code, text] = request(t, q.verb, q.path, q.body, timeout);
  return showAnswer(c, q.path, code, text);
}
