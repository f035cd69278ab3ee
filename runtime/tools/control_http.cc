#include "control_http.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <stdexcept>

namespace sinew {
namespace tools {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using asio::ip::tcp;

std::pair<int, std::string> controlRequest(const ControlTarget& t, http::verb method,
                                           const std::string& path, const std::string& body,
                                           std::chrono::milliseconds timeout,
                                           const std::string& userAgent) {
  asio::io_context io;
  tcp::resolver resolver(io);
  beast::tcp_stream stream(io);
  boost::system::error_code ec;
  auto endpoints = resolver.resolve(t.host, t.port, ec);
  if (!ec) {
    stream.expires_after(timeout);
    stream.connect(endpoints, ec);
  }
  if (ec) {
    throw std::runtime_error("cannot reach the control API at " + t.host + ":" + t.port + ": " +
                             ec.message());
  }
  stream.expires_after(timeout);
  http::request<http::string_body> req(method, path, 11);
  req.set(http::field::host, t.host);
  req.set(http::field::authorization, "Bearer " + t.token);
  req.set(http::field::user_agent, userAgent);
  if (!body.empty()) {
    req.set(http::field::content_type, "application/json");
    req.body() = body;
  }
  req.prepare_payload();
  beast::flat_buffer buffer;
  http::response<http::string_body> res;
  try {
    http::write(stream, req);
    http::read(stream, buffer, res);
  } catch (const std::exception& e) {
    throw std::runtime_error("request " + path + " failed: " + e.what());
  }
  return {static_cast<int>(res.result_int()), res.body()};
}

}  // namespace tools
}  // namespace sinew
