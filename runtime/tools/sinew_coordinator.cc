// sinew-coordinator: one coordinator candidate of a job in high-availability mode (docs/ha.md).
// Run one on each of (at least) three nodes, all with the job's etcd endpoints, name and token;
// one leads (an etcd lease and election), the others stand by and take the job over from the
// state in etcd when the leader dies or is cut off. Workers find the leader through etcd
// (SINEW_ETCD, SINEW_JOB, SINEW_TOKEN, SINEW_WORKER_ID).
//
//   SINEW_TOKEN=<hex> sinew-coordinator --etcd host:port[,...] --job NAME --workers N
//       [--host ADDR] [--name NAME] [--lease-ttl-s S] [--takeover-wait-ms MS]
//       [--heartbeat-ms MS] [--dead-after-ms MS] [--step-deadline-ms MS] [--log-dir DIR]
//       [--control-port P [--control-host ADDR] [--control-timeout-ms MS]]
//
// With --control-port, the candidate serves the control API (docs/control_api.md) while it
// leads, on that port (0: a free one) of --control-host (default 127.0.0.1), with the job
// token in hex as the bearer token; the leader key in etcd names it (control_host,
// control_port), so `sinewctl --etcd EPS --job NAME` finds whichever candidate leads.
//
// Exit status: 0 when the job finished, 75 when it stopped (the leader that saw it; the others
// 0), 1 when it failed, 2 for bad arguments. The leader that sees the end writes
// DIR/outcome.json (docs/runtime.md, "How a job ends").

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

#include "sinew/base/parse.h"
#include "sinew/runtime/ha_coordinator.h"

namespace {

[[noreturn]] void usage(const std::string& error) {
  std::fprintf(stderr,
               "sinew-coordinator: %s\nusage: SINEW_TOKEN=<hex> sinew-coordinator --etcd "
               "host:port[,...] --job NAME --workers N [--host ADDR] [--name NAME]\n"
               "       [--lease-ttl-s S] [--takeover-wait-ms MS] [--heartbeat-ms MS] "
               "[--dead-after-ms MS] [--step-deadline-ms MS] [--log-dir DIR]\n"
               "       [--control-port P [--control-host ADDR] [--control-timeout-ms MS]]\n",
               error.c_str());
  std::exit(2);
}

int64_t number(const std::string& flag, const std::string& v, int64_t min, int64_t max) {
  int64_t x = 0;
  std::string error = sinew::detail::parseIntOrError(v, flag, min, max, &x);
  if (!error.empty()) usage(error);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("One coordinator candidate of a Sinew job in high-availability mode (etcd).",
               "sinew-coordinator");
  std::string etcd, job, workers, host = "127.0.0.1", name, ttl = "2", takeover = "3000",
                                  heartbeat = "100", deadAfter = "1000", stepDeadline = "3000",
                                  logDir, controlPort, controlHost = "127.0.0.1",
                                  controlTimeout = "10000";
  app.add_option("--etcd", etcd, "etcd client endpoints, host:port[,host:port...]")
      ->type_name("EPS");
  app.add_option("--job", job, "the job's name: its keys are under /sinew/<job>/")
      ->type_name("NAME");
  app.add_option("--workers", workers, "workers the first epoch waits for")->type_name("N");
  app.add_option("--host", host, "address to serve workers on while leading (default 127.0.0.1)")
      ->type_name("ADDR");
  app.add_option("--name", name, "this candidate's name in logs (default: host name and pid)")
      ->type_name("NAME");
  app.add_option("--lease-ttl-s", ttl, "the leader lease's TTL in seconds (default 2)")
      ->type_name("S");
  app.add_option("--takeover-wait-ms", takeover,
                 "how long a new leader waits for the members to reconnect (default 3000)")
      ->type_name("MS");
  app.add_option("--heartbeat-ms", heartbeat, "heartbeat interval in ms (default 100)")
      ->type_name("MS");
  app.add_option("--dead-after-ms", deadAfter, "silence before a worker is dead (default 1000)")
      ->type_name("MS");
  app.add_option("--step-deadline-ms", stepDeadline, "step deadline floor in ms (default 3000)")
      ->type_name("MS");
  app.add_option("--log-dir", logDir, "append coordinator events to DIR/coordinator-<name>.jsonl")
      ->type_name("DIR");
  app.add_option("--control-port", controlPort,
                 "serve the control API on this port while leading (0: a free one; default: off)")
      ->type_name("P");
  app.add_option("--control-host", controlHost,
                 "address of the control API (default 127.0.0.1; others need a firewall)")
      ->type_name("ADDR");
  app.add_option("--control-timeout-ms", controlTimeout,
                 "a control request must arrive within this (default 10000)")
      ->type_name("MS");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    usage(e.what());
  }
  if (etcd.empty()) usage("--etcd is required");
  if (job.empty()) usage("--job is required");
  if (workers.empty()) usage("--workers is required");
  const char* token = std::getenv("SINEW_TOKEN");
  if (token == nullptr || *token == '\0') usage("SINEW_TOKEN (the job token, hex) is not set");
  const std::string ts(token);
  const auto parsed = sinew::detail::tryParseToken(ts);
  if (!parsed) usage("SINEW_TOKEN='" + ts + "' is not a non-zero hexadecimal job token");
  const uint64_t t = *parsed;
  try {
    sinew::runtime::HaCoordinatorOptions o;
    // Credentials and TLS: SINEW_ETCD_USER, SINEW_ETCD_PASSWORD(_FILE), SINEW_ETCD_CA, ...
    o.etcd = sinew::collectives::etcdOptionsFromEnvironment(etcd, "--etcd");
    o.job = job;
    sinew::runtime::haPrefix(job);  // Checks the name.
    o.leaseTtlSeconds = number("--lease-ttl-s", ttl, 1, 3600);
    o.name = name.empty() ? host + "-" + std::to_string(::getpid()) : name;
    auto& c = o.coordinator;
    c.host = host;
    c.token = t;
    c.expectedWorkers = static_cast<int>(number("--workers", workers, 1, 1 << 24));
    c.takeoverWait = std::chrono::milliseconds(number("--takeover-wait-ms", takeover, 1, 1 << 30));
    c.heartbeatInterval =
        std::chrono::milliseconds(number("--heartbeat-ms", heartbeat, 1, 1 << 30));
    c.deadAfter = std::chrono::milliseconds(number("--dead-after-ms", deadAfter, 2, 1 << 30));
    c.progressFloor =
        std::chrono::milliseconds(number("--step-deadline-ms", stepDeadline, 0, 1 << 30));
    if (!controlPort.empty()) {
      c.controlPort = static_cast<int>(number("--control-port", controlPort, 0, 65535));
      c.controlHost = controlHost;
      c.controlTimeout =
          std::chrono::milliseconds(number("--control-timeout-ms", controlTimeout, 100, 1 << 30));
    }
    if (!logDir.empty()) c.eventLogPath = logDir + "/coordinator-" + o.name + ".jsonl";
    if (!logDir.empty()) o.outcomePath = logDir + "/outcome.json";
    return sinew::runtime::runHaCoordinator(o);
  } catch (const sinew::InvalidArgument& e) {
    usage(e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew-coordinator: %s\n", e.what());
    return 1;
  }
}
