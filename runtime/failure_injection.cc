#include "sinew/runtime/failure_injection.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/runtime/coordinator_client.h"

namespace sinew {
namespace runtime {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, sep)) out.push_back(cur);
  return out;
}

// Limits that keep every conversion below (to int, time_t, microseconds) exact.
constexpr int64_t kMaxWorker = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxStep = int64_t{1} << 53;
constexpr double kMaxSeconds = 1e6;         // stop, mute: about 11 days.
constexpr double kMaxMilliseconds = 3.6e6;  // slow: an hour per step.

// A whole number in [0, max] (worker, step).
int64_t parseCount(const std::string& fault, const std::string& key, const std::string& v,
                   int64_t max) {
  auto n = ::sinew::detail::tryParseInt(v);
  if (!n && !::sinew::detail::tryParseFinite(v)) {
    SINEW_THROW(InvalidArgument, "fault '", fault, "': ", key, "='", v,
                "' is not a non-negative number");
  }
  if (!n || *n < 0 || *n > max) {
    SINEW_THROW(InvalidArgument, "fault '", fault, "': ", key, "='", v,
                "' must be a whole number in [0, ", max, "]");
  }
  return *n;
}

// A finite duration in [0, max] (secs, ms): nan, inf and negatives are rejected, since a
// stop of nan seconds would never be woken.
double parseDuration(const std::string& fault, const std::string& key, const std::string& v,
                     double max) {
  auto d = ::sinew::detail::tryParseFinite(v);
  if (!d) {
    SINEW_THROW(InvalidArgument, "fault '", fault, "': ", key, "='", v,
                "' is not a non-negative number (finite, decimal)");
  }
  if (!(*d >= 0 && *d <= max)) {
    SINEW_THROW(InvalidArgument, "fault '", fault, "': ", key, "='", v, "' must be in [0, ", max,
                "]");
  }
  return *d;
}

Phase parsePhase(const std::string& fault, const std::string& v) {
  for (Phase p :
       {Phase::kForward, Phase::kBackward, Phase::kReduce, Phase::kAfterReduce, Phase::kOptimizer,
        Phase::kSnapshot, Phase::kReplication, Phase::kRecovery, Phase::kReconfiguration,
        Phase::kCopy, Phase::kRelease, Phase::kFlush, Phase::kDone}) {
    if (v == phaseName(p)) return p;
  }
  SINEW_THROW(InvalidArgument, "fault '", fault, "': unknown phase '", v,
              "' (expected forward, backward, reduce, after-reduce, optimizer, snapshot, "
              "replication, recovery, reconfiguration, copy, release, flush or done)");
}

}  // namespace

const char* phaseName(Phase p) {
  switch (p) {
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kReduce:
      return "reduce";
    case Phase::kAfterReduce:
      return "after-reduce";
    case Phase::kOptimizer:
      return "optimizer";
    case Phase::kSnapshot:
      return "snapshot";
    case Phase::kReplication:
      return "replication";
    case Phase::kRecovery:
      return "recovery";
    case Phase::kReconfiguration:
      return "reconfiguration";
    case Phase::kCopy:
      return "copy";
    case Phase::kRelease:
      return "release";
    case Phase::kFlush:
      return "flush";
    case Phase::kDone:
      return "done";
  }
  return "?";
}

FailureInjector FailureInjector::parse(const std::string& spec) {
  FailureInjector inj;
  for (const std::string& text : split(spec, ';')) {
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    auto parts = split(text, ':');
    Fault f;
    const std::string& kind = parts[0];
    if (kind == "kill") {
      f.kind = Fault::Kind::kKill;
    } else if (kind == "stop") {
      f.kind = Fault::Kind::kStop;
    } else if (kind == "mute") {
      f.kind = Fault::Kind::kMute;
    } else if (kind == "slow") {
      f.kind = Fault::Kind::kSlow;
    } else if (kind == "failwrite") {
      f.kind = Fault::Kind::kFailWrite;
      f.phase = Phase::kFlush;
    } else if (kind == "corrupt") {
      f.kind = Fault::Kind::kCorrupt;
      f.phase = Phase::kFlush;
    } else {
      SINEW_THROW(InvalidArgument, "fault '", text, "': unknown kind '", kind,
                  "' (expected kill, stop, mute, slow, failwrite or corrupt)");
    }
    bool haveWorker = false;
    for (size_t i = 1; i < parts.size(); ++i) {
      auto eq = parts[i].find('=');
      if (eq == std::string::npos) {
        SINEW_THROW(InvalidArgument, "fault '", text, "': '", parts[i], "' is not key=value");
      }
      std::string key = parts[i].substr(0, eq), v = parts[i].substr(eq + 1);
      if (key == "worker") {
        f.worker = v == "*" ? -1 : static_cast<int>(parseCount(text, key, v, kMaxWorker));
        haveWorker = true;
      } else if (key == "step") {
        f.step = parseCount(text, key, v, kMaxStep);
      } else if (key == "phase") {
        f.phase = parsePhase(text, v);
      } else if (key == "secs") {
        f.seconds = parseDuration(text, key, v, kMaxSeconds);
      } else if (key == "ms") {
        f.milliseconds = parseDuration(text, key, v, kMaxMilliseconds);
      } else if (key == "us_per_sample" && f.kind == Fault::Kind::kSlow) {
        f.microsPerSample = parseDuration(text, key, v, kMaxMilliseconds);
      } else if (key == "comm_ms" && f.kind == Fault::Kind::kSlow) {
        f.commMilliseconds = parseDuration(text, key, v, kMaxMilliseconds);
      } else {
        SINEW_THROW(InvalidArgument, "fault '", text, "': unknown key '", key,
                    "' (expected worker, step, phase, secs, ms or, for slow, us_per_sample or "
                    "comm_ms)");
      }
    }
    if (!haveWorker) SINEW_THROW(InvalidArgument, "fault '", text, "': needs worker=<id or *>");
    if (f.step < 0 && f.kind != Fault::Kind::kSlow) {
      SINEW_THROW(InvalidArgument, "fault '", text, "': needs step=<n>");
    }
    if ((f.kind == Fault::Kind::kStop || f.kind == Fault::Kind::kMute) && f.seconds <= 0) {
      SINEW_THROW(InvalidArgument, "fault '", text, "': needs secs=<seconds> > 0");
    }
    if (f.kind == Fault::Kind::kFailWrite && f.phase != Phase::kFlush) {
      SINEW_THROW(InvalidArgument, "fault '", text, "': failwrite fires only in phase flush");
    }
    if (f.kind == Fault::Kind::kCorrupt && f.phase != Phase::kFlush && f.phase != Phase::kCopy) {
      SINEW_THROW(InvalidArgument, "fault '", text, "': corrupt fires only in phase flush or copy");
    }
    if ((f.phase == Phase::kFlush || f.phase == Phase::kReplication) &&
        f.kind == Fault::Kind::kMute) {
      SINEW_THROW(InvalidArgument, "fault '", text, "': mute cannot fire in phase ",
                  phaseName(f.phase), " (its thread does not talk to the coordinator)");
    }
    if (f.kind == Fault::Kind::kSlow &&
        (f.milliseconds > 0) + (f.microsPerSample > 0) + (f.commMilliseconds > 0) != 1) {
      SINEW_THROW(InvalidArgument, "fault '", text,
                  "': needs one of ms=<milliseconds>, us_per_sample=<microseconds> and "
                  "comm_ms=<milliseconds>, > 0");
    }
    inj.faults_.push_back(f);
  }
  return inj;
}

FailureInjector FailureInjector::fromEnvironment() {
  const char* spec = std::getenv("SINEW_INJECT");
  return spec ? parse(spec) : FailureInjector();
}

void FailureInjector::fireSlow(int worker, int64_t step, Phase phase, CoordinatorClient* client) {
  for (Fault& f : faults_) {
    // The immutable fields first; `fired` under the lock.
    if (f.phase != phase || (f.worker >= 0 && f.worker != worker)) continue;
    if (f.kind == Fault::Kind::kCorrupt) continue;                  // afterFlush runs it.
    if (f.microsPerSample > 0 || f.commMilliseconds > 0) continue;  // emulate* run them.
    bool everyStep = f.kind == Fault::Kind::kSlow && f.step < 0;
    const bool atOrAfter = phase == Phase::kSnapshot || phase == Phase::kReplication ||
                           phase == Phase::kRecovery || phase == Phase::kReconfiguration ||
                           phase == Phase::kCopy || phase == Phase::kRelease ||
                           phase == Phase::kDone;
    bool due = everyStep || (atOrAfter ? step >= f.step : step == f.step);
    if (!due) continue;
    if (!everyStep) {
      std::lock_guard<std::mutex> lock(*firedMu_);
      if (f.fired) continue;
      f.fired = true;
    }
    switch (f.kind) {
      case Fault::Kind::kKill:
        std::fprintf(stderr, "sinew inject: worker %d SIGKILLs itself at step %lld phase %s\n",
                     worker, static_cast<long long>(step), phaseName(phase));
        std::fflush(nullptr);
        ::raise(SIGKILL);
        break;
      case Fault::Kind::kStop: {
        std::fprintf(stderr, "sinew inject: worker %d SIGSTOPs itself for %.1f s at step %lld\n",
                     worker, f.seconds, static_cast<long long>(step));
        std::fflush(nullptr);
        pid_t self = ::getpid();
        pid_t waker = ::fork();
        if (waker == 0) {
          // Only async-signal-safe calls in the child of a threaded process.
          struct timespec ts;
          ts.tv_sec = static_cast<time_t>(f.seconds);
          ts.tv_nsec = static_cast<long>((f.seconds - ts.tv_sec) * 1e9);
          while (nanosleep(&ts, &ts) != 0) {
          }
          ::kill(self, SIGCONT);
          _exit(0);
        }
        ::raise(SIGSTOP);
        if (waker > 0) ::waitpid(waker, nullptr, 0);
        break;
      }
      case Fault::Kind::kMute:
        std::fprintf(stderr, "sinew inject: worker %d mutes heartbeats for %.1f s at step %lld\n",
                     worker, f.seconds, static_cast<long long>(step));
        if (client) {
          client->muteHeartbeats(std::chrono::milliseconds(static_cast<int64_t>(f.seconds * 1e3)));
        }
        break;
      case Fault::Kind::kFailWrite:
        std::fprintf(stderr, "sinew inject: worker %d fails its write of checkpoint %lld\n", worker,
                     static_cast<long long>(step));
        SINEW_THROW(IoError, "injected write failure (failwrite:worker=", worker, ":step=", step,
                    ")");
      case Fault::Kind::kCorrupt:
        break;  // Not here: afterFlush.
      case Fault::Kind::kSlow:
        std::this_thread::sleep_for(
            std::chrono::microseconds(static_cast<int64_t>(f.milliseconds * 1e3)));
        break;
    }
  }
}

void FailureInjector::emulateCommunication(int worker, int64_t step) {
  double ms = 0;
  for (const Fault& f : faults_) {
    if (f.kind != Fault::Kind::kSlow || f.commMilliseconds <= 0) continue;
    if ((f.worker >= 0 && f.worker != worker) || (f.step >= 0 && f.step != step)) continue;
    ms += f.commMilliseconds;
  }
  if (ms > 0)
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(ms * 1e3)));
}

void FailureInjector::emulateCompute(int worker, int64_t step, int64_t samples) {
  double micros = 0;
  for (const Fault& f : faults_) {
    if (f.kind != Fault::Kind::kSlow || f.microsPerSample <= 0) continue;
    if ((f.worker >= 0 && f.worker != worker) || (f.step >= 0 && f.step != step)) continue;
    micros += f.microsPerSample * static_cast<double>(samples);
  }
  if (micros > 0)
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(micros)));
}

int FailureInjector::corruptDue(int worker, int64_t step, const std::string& dir) {
  int damaged = 0;
  for (Fault& f : faults_) {
    if (f.kind != Fault::Kind::kCorrupt || f.phase != Phase::kFlush || f.fired || f.step != step ||
        (f.worker >= 0 && f.worker != worker)) {
      continue;
    }
    f.fired = true;
    char name[32];
    std::snprintf(name, sizeof(name), "step-%08lld", static_cast<long long>(step));
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir + "/" + name, ec)) {
      if (e.path().filename().string().rfind("shard-", 0) != 0) continue;
      const auto size = std::filesystem::file_size(e.path(), ec);
      if (ec || size < 8) continue;
      std::fstream file(e.path(), std::ios::in | std::ios::out | std::ios::binary);
      file.seekp(static_cast<std::streamoff>(size - std::min<uintmax_t>(size, 64)));
      file.write(kDamageBytes, sizeof kDamageBytes);
      damaged += file.good() ? 1 : 0;
    }
    std::fprintf(stderr, "sinew inject: worker %d corrupted %d file(s) of checkpoint %lld in %s\n",
                 worker, damaged, static_cast<long long>(step), dir.c_str());
  }
  return damaged;
}

bool FailureInjector::copyCorruptionDue(int worker, int64_t step) {
  for (Fault& f : faults_) {
    if (f.kind != Fault::Kind::kCorrupt || f.phase != Phase::kCopy || step < f.step ||
        (f.worker >= 0 && f.worker != worker)) {
      continue;
    }
    std::lock_guard<std::mutex> lock(*firedMu_);
    if (f.fired) continue;
    f.fired = true;
    std::fprintf(stderr, "sinew inject: worker %d damages the layer copy it sends at step %lld\n",
                 worker, static_cast<long long>(step));
    return true;
  }
  return false;
}

}  // namespace runtime
}  // namespace sinew
