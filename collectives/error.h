#pragma once

// Sinew's exception hierarchy. Every public API reports failure by throwing one of these.
// After a communication error (PeerLost, Timeout, Aborted) the caller must assume the
// communicator that raised it is unusable and build a new one (Gloo's rule).
//
// Thread safety: exception objects are immutable after construction.

#include <sstream>
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

class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& what) : Error(what) {}
};

// Stored or received bytes do not match what they claim to be (checksum, framing).
class Corruption : public Error {
 public:
  explicit Corruption(const std::string& what) : Error(what) {}
};

class IoError : public Error {
 public:
  explicit IoError(const std::string& what) : Error(what) {}
};

namespace detail {

inline void streamAll(std::ostringstream&) {}
template <typename T, typename... Rest>
void streamAll(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  streamAll(os, rest...);
}

template <typename E, typename... Args>
[[noreturn]] void throwWithLocation(const char* file, int line, const Args&... args) {
  std::ostringstream os;
  streamAll(os, args...);
  os << " [" << file << ":" << line << "]";
  throw E(os.str());
}

}  // namespace detail
}  // namespace sinew

// Checks an invariant; on failure throws sinew::InvalidArgument whose message is the
// failed condition, the streamed arguments and the file and line (Gloo's GLOO_ENFORCE).
#define SINEW_ENFORCE(cond, ...)                                           \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ::sinew::detail::throwWithLocation<::sinew::InvalidArgument>(        \
          __FILE__, __LINE__, "check failed: " #cond ". ", ##__VA_ARGS__); \
    }                                                                      \
  } while (0)

// Throws the given sinew error type with a streamed message plus file and line.
#define SINEW_THROW(ErrorType, ...) \
  ::sinew::detail::throwWithLocation<ErrorType>(__FILE__, __LINE__, ##__VA_ARGS__)
