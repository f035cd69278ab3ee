// Fuzzes the control API's request handling (runtime/control_api.h) as the server runs it on
// every request: Beast's HTTP parser with the server's header and body limits, the bearer
// token check, then the routing and the checks of each operation's JSON body, against a
// backend that checks what reaches it.
// Properties: nothing but a sinew::Error or a parse error rejects an input; an operation is
// reached only with a valid token and with arguments in their documented ranges; every answer
// has a known status, and its JSON body (all but /metrics) parses, with "error" when it is not
// 200.

#include <cstddef>
#include <cstdint>
#include <string>

#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "fuzz_check.h"
#include "sinew/base/error.h"
#include "sinew/runtime/control_api.h"

namespace {

namespace control = sinew::runtime::control;
using sinew::runtime::ControlReply;

class CheckingBackend : public control::Backend {
 public:
  ControlReply status() override { return ok(); }
  ControlReply scaling() override { return ok(); }
  ControlReply resize(int64_t nodes) override {
    SINEW_FUZZ_CHECK(nodes >= 1 && nodes <= control::kMaxNodes, "resize to %lld nodes",
                     static_cast<long long>(nodes));
    return ok();
  }
  ControlReply drain(const control::DrainRequest& r) override {
    SINEW_FUZZ_CHECK(r.workers.empty() != r.nodes.empty(), "drain of both or neither");
    SINEW_FUZZ_CHECK(r.workers.size() + r.nodes.size() <= control::kMaxListed, "too many");
    for (int w : r.workers) SINEW_FUZZ_CHECK(w >= 0, "worker %d", w);
    for (const auto& n : r.nodes) SINEW_FUZZ_CHECK(!n.empty() && n.size() <= 255, "node name");
    SINEW_FUZZ_CHECK(r.deadlineSeconds > 0 && r.deadlineSeconds <= control::kMaxDeadlineSeconds,
                     "deadline %g", r.deadlineSeconds);
    return ok();
  }
  ControlReply limits(const nlohmann::json& update) override {
    // What the coordinator does with it: limits that pass are consistent.
    try {
      const control::JobLimits l = control::parseLimits(update, control::JobLimits());
      control::validateLimits(l);
      SINEW_FUZZ_CHECK(l.minNodes == 0 || l.maxNodes == 0 || l.minNodes <= l.maxNodes,
                       "min above max");
      for (int64_t n : l.sizes) SINEW_FUZZ_CHECK(l.refuses(n).empty(), "a listed size refused");
    } catch (const sinew::InvalidArgument&) {
    }
    return ok();
  }
  ControlReply checkpoint() override { return ok(); }
  ControlReply stop(double deadline) override {
    SINEW_FUZZ_CHECK(deadline == 0 || (deadline > 0 && deadline <= control::kMaxDeadlineSeconds),
                     "stop deadline %g", deadline);
    return ok();
  }
  std::string metrics() override { return "sinew_step 0\n"; }

 private:
  static ControlReply ok() { return ControlReply(); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace http = boost::beast::http;
  http::request_parser<http::string_body> parser;
  parser.header_limit(control::kMaxHeaderBytes);
  parser.body_limit(control::kDefaultMaxBodyBytes);
  parser.eager(true);
  boost::system::error_code ec;
  size_t used = 0;
  while (used < size && !parser.is_done()) {
    size_t n = parser.put(boost::asio::buffer(data + used, size - used), ec);
    if (ec == http::error::need_more) break;
    if (ec) return 0;  // The server answers 400 (or 413, 431) and closes.
    if (n == 0) break;
    used += n;
  }
  if (!parser.is_done()) {
    parser.put_eof(ec);
    if (ec || !parser.is_done()) return 0;
  }
  const auto& req = parser.get();
  auto auth = req[http::field::authorization];
  const std::string token = "0123456789abcdef";
  if (!control::authorized(std::string_view(auth.data(), auth.size()), token)) return 0;
  CheckingBackend backend;
  auto method = req.method_string();
  auto target = req.target();
  control::Answer a = control::route(backend, std::string_view(method.data(), method.size()),
                                     std::string_view(target.data(), target.size()), req.body());
  SINEW_FUZZ_CHECK(a.status == 200 || a.status == 400 || a.status == 404 || a.status == 405,
                   "status %d", a.status);
  if (a.eventStream || a.contentType.rfind("text/plain", 0) == 0) return 0;
  auto body = nlohmann::json::parse(a.body, nullptr, /*allow_exceptions=*/false);
  SINEW_FUZZ_CHECK(!body.is_discarded() && body.is_object(), "answer is not a JSON object");
  if (a.status != 200) SINEW_FUZZ_CHECK(body.contains("error"), "error answer without 'error'");
  return 0;
}
