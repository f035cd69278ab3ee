#pragma once

// The coordinator (docs/architecture.md section 3): a Boost.Asio server, in a process of its own so
// that it outlives any worker. It holds membership, the epoch, the last committed step and the
// rendezvous store (a TcpStoreServer on a second port), detects failures from heartbeats,
// closed connections and workers' PeerLost reports, and runs the step agreement. The
// protocol is in docs/coordinator_protocol.md.
//
// Preemption: a worker that must go (SIGTERM, a scheduler) sends leave; at the next commit
// the coordinator releases it (it applies that step, then exits cleanly) and starts an epoch
// without it. If every member leaves, the job stops at that step.
//
// Step agreement (a step is applied everywhere or nowhere):
//   1. Each member reduces its gradients for step s, then votes (s, epoch).
//   2. When every member of the epoch voted for s, the coordinator records s as committed
//      and sends commit(s) to every member; members apply the optimizer step only then.
//   3. If a member dies first, the coordinator bumps the epoch instead; commit(s) is never
//      sent, and the new epoch's resume_step is the last committed step + 1, so survivors
//      redo step s. A commit precedes any later epoch message on every connection, so a
//      survivor that voted learns the verdict before it learns of the new epoch.
//
// Thread safety: the public methods may be called from any thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sinew/runtime/control_api.h"

namespace sinew {
namespace runtime {

struct CoordinatorOptions {
  // Address for both ports. Loopback by default.
  std::string host = "127.0.0.1";
  // 0 picks a free port.
  uint16_t port = 0;
  // Every message must carry it; 0 draws a random one.
  uint64_t token = 0;
  // The first epoch forms when this many workers have said hello (or at startTimeout
  // with those present).
  int expectedWorkers = 1;
  // The job's limits and wishes for schedulers (docs/control_api.md, "Limits"); changed
  // with POST /v1/limits. A resize outside them is refused.
  control::JobLimits limits;
  std::chrono::milliseconds startTimeout{120000};
  // Workers send a heartbeat this often...
  std::chrono::milliseconds heartbeatInterval{100};
  // ...and are declared dead after this much silence (or at once on a closed connection).
  std::chrono::milliseconds deadAfter{1000};
  // Progress (docs/failure_semantics.md, rule 1): once a member has waited on the others for
  // step S (in a collective or for its vote's verdict) longer than the step deadline, every
  // member still computing step S (or an older one) is declared dead. The step deadline is
  // max(progressFloor, progressFactor x the median time between the last 20 commits); a
  // progressFloor of 0 turns the check off.
  std::chrono::milliseconds progressFloor{3000};
  int progressFactor = 20;
  // Largest message accepted; a larger one drops the connection.
  uint32_t maxMessageBytes = 1u << 20;
  // Connections beyond this many are refused (both ports).
  size_t maxConnections = 4096;
  // A connection that sends no complete message for this long (and at least 2 x deadAfter)
  // is closed: workers heartbeat far more often, so only strangers and stalled peers hit it.
  std::chrono::milliseconds idleTimeout{10000};
  // A message's payload must arrive within this of its header.
  std::chrono::milliseconds frameTimeout{10000};
  // Where protocol violations and membership changes are logged; stderr by default.
  std::function<void(const std::string&)> log;
  // If set, membership events are appended here as JSON lines.
  std::string eventLogPath;

  // The HTTP control API (docs/architecture.md section 7, docs/control_api.md): served when
  // controlPort
  // >= 0 (0 picks a free port), on controlHost (default: host), to requests that carry
  // controlToken as a bearer token (default: the job token in hex, as coordinator.json has it).
  int controlPort = -1;
  std::string controlHost;
  std::string controlToken;
  // A token for GET only (status, scaling, metrics, events: what Prometheus and dashboards
  // need); empty: one is drawn (16 hex digits). In coordinator.json as control_read_token.
  std::string controlReadToken;
  // A request must arrive within this; idle keep-alive connections are closed after it.
  std::chrono::milliseconds controlTimeout{10000};
  size_t controlMaxConnections = 128;
  // Growth: a resize that needs `count` more workers calls this; it returns how many workers
  // it starts (each joins with SINEW_COORDINATOR). Called with the coordinator's lock held:
  // it must not block or call the coordinator. Unset: the scheduler starts joiners itself.
  std::function<int(int count)> startWorkers;

  // High availability (docs/ha.md). persist, when set, stores the coordinator's durable state
  // (a JSON object: epoch, members, committed step, ...) before each message that makes a
  // change of it visible leaves: an epoch, a job's end (commits: see persistCommitsEvery). It
  // is called on the io
  // thread with the coordinator's lock held, and throws when the write is refused (another
  // leader) or cannot be made; the coordinator then ends its term: it sends nothing more,
  // closes every connection and reports status().deposed. mayWrite, when set, is asked
  // before every message: false ends the term the same way (a lease that may have ended).
  std::function<void(const std::string& stateJson)> persist;
  std::function<bool()> mayWrite;
  // Commits and durable reports are stored at most this often (epochs, a job's end and done
  // at once): a store per step would cost an etcd write (an fsync) per step. A new leader
  // learns later commits from the members that rejoin (docs/ha.md, rule 5); 0 stores every
  // one.
  std::chrono::milliseconds persistCommitsEvery{1000};
  // The state a previous leader persisted: this coordinator takes the job over. The members
  // of its epoch reconnect (hello with rejoin); once all did, or takeoverWait passed, the
  // next epoch starts with those that did (a member whose commit of the last committed step
  // was lost gets it first), resuming after the last committed step.
  std::string takeoverState;
  std::chrono::milliseconds takeoverWait{3000};
};

struct CoordinatorStatus {
  int64_t epoch = -1;
  int64_t committedStep = -1;
  std::vector<int> members;   // of the current epoch
  std::vector<int> dead;      // declared dead (or expelled), in order
  std::vector<int> done;      // finished every step
  std::vector<int> released;  // left the job cleanly (preempted), in order
  bool finished = false;      // every member of the current epoch is done, or the job stopped
  bool stopped = false;       // every member left (preempted) before the last step
  int64_t droppedConnections = 0;
  int64_t ignoredMessages = 0;
  std::map<int, int64_t> pids;       // every worker that said hello -> its process id
  std::vector<int> releasedRunning;  // released, and their process has not ended yet
  bool failed = false;               // the job failed (e.g. no plan fits its workers)
  bool deposed = false;              // HA: this coordinator's term ended; it serves no more
  int connected = 0;                 // workers whose connection is still open
};

class Coordinator {
 public:
  // Starts serving. Throws IoError if it cannot listen.
  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  uint16_t port() const;
  uint16_t storePort() const;
  uint64_t token() const;
  const std::string& host() const;

  CoordinatorStatus status() const;
  // How the job ended (runtime/job_outcome.h): finished, stopped or failed and why; "running"
  // before it has.
  nlohmann::json outcome() const;

  // Blocks until every member of the current epoch is done, or no member is left alive, or
  // the timeout passes. Returns whether the job finished with at least one member done.
  bool waitFinished(std::chrono::milliseconds timeout);

  // The control operations (docs/control_api.md), for a scheduler in this process; the HTTP
  // API serves the same answers. Each returns at once: resize, drain, checkpoint and stop take
  // effect at the next step boundary, and status() says when they did.
  ControlReply controlStatus();
  ControlReply scaling();
  ControlReply resize(int64_t nodes);
  ControlReply drain(const control::DrainRequest& request);
  ControlReply checkpoint();
  ControlReply stop(double deadlineSeconds);
  std::string metrics();
  // The control API's address and port (0 when it is off), and its bearer token.
  const std::string& controlHost() const;
  uint16_t controlPort() const;
  const std::string& controlToken() const;
  const std::string& controlReadToken() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes the job's endpoints and tokens as JSON ({host, port, token, store_port, control_host,
// control_port, control_token}) to path, readable by this user only (it holds the token);
// sinewctl and joiners read it. Throws IoError naming the path.
void writeCoordinatorJson(const Coordinator& coordinator, const std::string& path);

}  // namespace runtime
}  // namespace sinew
