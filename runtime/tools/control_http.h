#pragma once

// One HTTP request to a job's control API (docs/control_api.md), for its command-line clients
// (sinewctl, sinew-sched): Boost.Beast over one connection, with a deadline. Thread safety:
// each call is independent.

#include <boost/beast/http/verb.hpp>

#include <chrono>
#include <string>
#include <utility>

namespace sinew {
namespace tools {

struct ControlTarget {
  std::string host;
  std::string port;
  std::string token;
};

// Sends `method path` with `body` (JSON, if not empty) and the bearer token; returns the status
// and the body. Throws std::runtime_error naming the address or the path when the API cannot
// be reached or the exchange fails (within `timeout`).
std::pair<int, std::string> controlRequest(const ControlTarget& t, boost::beast::http::verb method,
                                           const std::string& path, const std::string& body,
                                           std::chrono::milliseconds timeout,
                                           const std::string& userAgent);

}  // namespace tools
}  // namespace sinew
