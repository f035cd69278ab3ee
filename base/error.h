#pragma once

// Internal: the error family (public, sinew/error.h) plus the macros Sinew's own code throws
// them with. Users include "sinew/error.h"; these macros are not part of the public API.

#include <exception>
#include <sstream>
#include <string>

#include "sinew/error.h"

namespace sinew {
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

// The message of a caught exception, for logs (the exception itself is carried on).
inline std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace detail
}  // namespace sinew

// Checks an invariant (Gloo's GLOO_ENFORCE); on failure throws sinew::InternalError whose
// message is the failed condition, the streamed arguments and the file and line. A failure is
// a bug in Sinew: a caller's bad argument is reported with SINEW_THROW(InvalidArgument, ...)
// naming the argument and its value.
#define SINEW_ENFORCE(cond, ...)                                           \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ::sinew::detail::throwWithLocation<::sinew::InternalError>(          \
          __FILE__, __LINE__, "check failed: " #cond ". ", ##__VA_ARGS__); \
    }                                                                      \
  } while (0)

// Throws the given sinew error type with a streamed message plus file and line.
#define SINEW_THROW(ErrorType, ...) \
  ::sinew::detail::throwWithLocation<ErrorType>(__FILE__, __LINE__, ##__VA_ARGS__)
