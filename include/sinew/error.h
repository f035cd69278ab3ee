#pragma once

// Sinew's exception hierarchy: every public API reports failure by throwing one of these, and
// every one derives from sinew::Error. After a communication error (PeerLost, Timeout,
// Aborted) the caller must assume the communicator that raised it is unusable and build a new
// one (Gloo's rule).
//
// Thread safety: exception objects are immutable after construction.

#include <cstdint>
#include <stdexcept>
#include <string>

namespace sinew {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A member of a communicator (or a worker of the job) died or closed its connections.
class PeerLost : public Error {
 public:
  PeerLost(int worker, const std::string& what) : Error(what), worker_(worker) {}
  // The worker id of the lost peer (the member's id, not its rank in the communicator).
  int worker() const { return worker_; }

 private:
  int worker_;
};

// A blocking operation reached its deadline.
class Timeout : public Error {
 public:
  explicit Timeout(const std::string& what) : Error(what) {}
};

// The operation was cancelled by abort() (from any thread).
class Aborted : public Error {
 public:
  explicit Aborted(const std::string& what) : Error(what) {}
};

// A caller passed a bad argument or option; the message names it and its value.
class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& what) : Error(what) {}
};

// Stored or received bytes do not match what they claim to be (checksum, framing).
class Corruption : public Error {
 public:
  explicit Corruption(const std::string& what) : Error(what) {}
};

// A file or socket operation failed (the message names the path or address).
class IoError : public Error {
 public:
  explicit IoError(const std::string& what) : Error(what) {}
};

// A broken invariant: a bug in Sinew, not in the caller. The message names the failed
// condition and its source file and line.
class InternalError : public Error {
 public:
  explicit InternalError(const std::string& what) : Error(what) {}
};

// The coordinator declared this worker dead (it was silent too long, its node failed, or it
// joined a finished job); it must leave the job. Also thrown when the coordinator is gone.
class Expelled : public Error {
 public:
  explicit Expelled(const std::string& what) : Error(what) {}
};

// The coordinator released this worker after it asked to leave (preemption): it applied
// every committed step up to the release and must now exit cleanly.
class Released : public Error {
 public:
  explicit Released(const std::string& what) : Error(what) {}
};

// A checkpoint version that was written but not named durable because a newer one already is:
// LATEST never moves backwards (docs/failure_semantics.md, rule 8). Only a late writer (paused
// or preempted past its epoch) meets it; the refusal is correct and loses nothing committed.
class StaleVersion : public Error {
 public:
  StaleVersion(int64_t step, int64_t newer, const std::string& what)
      : Error(what), step_(step), newer_(newer) {}
  int64_t step() const { return step_; }    // the version that was refused
  int64_t newer() const { return newer_; }  // the version LATEST names

 private:
  int64_t step_;
  int64_t newer_;
};

}  // namespace sinew
