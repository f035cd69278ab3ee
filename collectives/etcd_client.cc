#include "sinew/collectives/etcd_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <mutex>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace collectives {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

// etcd's JSON gateway carries keys and values as base64 (RFC 4648, padded).
constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64(const std::string& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(kB64[(v >> s) & 63]);
  }
  if (i + 1 == in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    out.push_back(kB64[(v >> 18) & 63]);
    out.push_back(kB64[(v >> 12) & 63]);
    out += "==";
  } else if (i + 2 == in.size()) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out.push_back(kB64[(v >> 18) & 63]);
    out.push_back(kB64[(v >> 12) & 63]);
    out.push_back(kB64[(v >> 6) & 63]);
    out.push_back('=');
  }
  return out;
}

std::string unbase64(const std::string& in) {
  auto value = [&](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    int v = value(c);
    if (v < 0)
      SINEW_THROW(Corruption, "etcd answered a key or value that is not base64: '", in, "'");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return out;
}

// The end of the range of keys that start with prefix: the prefix with its last byte
// incremented (bytes of 0xff dropped first); "\0" (every key) for an empty or all-0xff prefix.
std::string prefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    auto& c = reinterpret_cast<unsigned char&>(end.back());
    if (c < 0xff) {
      ++c;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

// The gateway writes 64-bit integers as JSON strings, and leaves out fields that are zero.
int64_t num(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    auto v = ::sinew::detail::tryParseInt(it->get<std::string>());
    if (v) return *v;
  }
  SINEW_THROW(Corruption, "etcd answered a non-integer ", field, ": ",
              ::sinew::detail::jsonPreview(*it));
}

EtcdKeyValue parseKv(const json& j) {
  EtcdKeyValue kv;
  kv.key = unbase64(j.value("key", std::string()));
  kv.value = unbase64(j.value("value", std::string()));
  kv.createRevision = num(j, "create_revision");
  kv.modRevision = num(j, "mod_revision");
  kv.version = num(j, "version");
  kv.lease = num(j, "lease");
  return kv;
}

const char* targetName(EtcdCompare::Target t) {
  switch (t) {
    case EtcdCompare::Target::kVersion:
      return "VERSION";
    case EtcdCompare::Target::kCreateRevision:
      return "CREATE";
    case EtcdCompare::Target::kModRevision:
      return "MOD";
    case EtcdCompare::Target::kValue:
      return "VALUE";
    case EtcdCompare::Target::kLease:
      return "LEASE";
  }
  return "VERSION";
}

const char* targetField(EtcdCompare::Target t) {
  switch (t) {
    case EtcdCompare::Target::kVersion:
      return "version";
    case EtcdCompare::Target::kCreateRevision:
      return "create_revision";
    case EtcdCompare::Target::kModRevision:
      return "mod_revision";
    case EtcdCompare::Target::kValue:
      return "value";
    case EtcdCompare::Target::kLease:
      return "lease";
  }
  return "version";
}

const char* opName(EtcdCompare::Op op) {
  switch (op) {
    case EtcdCompare::Op::kEqual:
      return "EQUAL";
    case EtcdCompare::Op::kNotEqual:
      return "NOT_EQUAL";
    case EtcdCompare::Op::kGreater:
      return "GREATER";
    case EtcdCompare::Op::kLess:
      return "LESS";
  }
  return "EQUAL";
}

json opJson(const EtcdOp& op) {
  switch (op.kind) {
    case EtcdOp::Kind::kPut: {
      json p = {{"key", base64(op.key)}, {"value", base64(op.value)}};
      if (op.lease != 0) p["lease"] = std::to_string(op.lease);
      return json{{"request_put", p}};
    }
    case EtcdOp::Kind::kGet:
      return json{{"request_range", {{"key", base64(op.key)}}}};
    case EtcdOp::Kind::kDelete:
      return json{{"request_delete_range", {{"key", base64(op.key)}}}};
  }
  return json::object();
}

// Splits complete top-level JSON objects off the front of `buffer` (the gateway streams one
// object per watch response).
std::vector<json> takeObjects(std::string& buffer) {
  std::vector<json> out;
  size_t start = std::string::npos, consumed = 0;
  int depth = 0;
  bool inString = false, escaped = false;
  for (size_t i = 0; i < buffer.size(); ++i) {
    char c = buffer[i];
    if (inString) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        inString = false;
      }
      continue;
    }
    if (c == '"') {
      inString = true;
    } else if (c == '{') {
      if (depth++ == 0) start = i;
      if (depth > ::sinew::detail::kMaxJsonDepth) {
        SINEW_THROW(Corruption, "etcd's watch stream nests JSON deeper than ",
                    ::sinew::detail::kMaxJsonDepth, " levels");
      }
    } else if (c == '}' && depth > 0 && --depth == 0) {
      if (::sinew::detail::jsonTooDeep(buffer.data() + start, buffer.data() + i + 1)) {
        SINEW_THROW(Corruption, "etcd's watch stream nests JSON deeper than ",
                    ::sinew::detail::kMaxJsonDepth, " levels");
      }
      out.push_back(json::parse(buffer.begin() + start, buffer.begin() + i + 1));
      consumed = i + 1;
    }
  }
  buffer.erase(0, consumed);
  return out;
}

std::string endpointName(const EtcdEndpoint& e) { return e.host + ":" + std::to_string(e.port); }

// Why a gateway answer is not a result: its "error"/"message" and gRPC code.
std::string gatewayError(const json& body) {
  std::string message = body.value("message", body.value("error", std::string()));
  if (message.empty()) message = ::sinew::detail::jsonPreview(body);
  return message + " (code " + std::to_string(body.value("code", 0)) + ")";
}

// Errors of the member, not of the request: try the next member. gRPC codes 14
// (unavailable), 4 (deadline exceeded), and etcd's leader-change and no-leader messages.
bool retryable(int status, const json& body) {
  if (status >= 500 && status != 501) return true;
  const int code = body.is_object() ? body.value("code", 0) : 0;
  if (code == 14 || code == 4) return true;
  const std::string message = body.is_object() ? body.value("error", std::string()) : "";
  return message.find("leader") != std::string::npos ||
         message.find("timed out") != std::string::npos;
}

}  // namespace

std::vector<EtcdEndpoint> parseEtcdEndpoints(const std::string& list, const std::string& what) {
  std::vector<EtcdEndpoint> out;
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t comma = list.find(',', pos);
    std::string entry =
        list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (entry.rfind("http://", 0) == 0) entry = entry.substr(7);
    auto colon = entry.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      SINEW_THROW(InvalidArgument, what, "='", list, "': '", entry, "' is not host:port");
    }
    auto port = ::sinew::detail::tryParseInt(entry.substr(colon + 1));
    if (!port || *port < 1 || *port > 65535) {
      SINEW_THROW(InvalidArgument, what, "='", list, "': '", entry, "' has no port in 1..65535");
    }
    out.push_back({entry.substr(0, colon), static_cast<uint16_t>(*port)});
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

EtcdOp EtcdOp::put(std::string key, std::string value, int64_t lease) {
  EtcdOp op;
  op.kind = Kind::kPut;
  op.key = std::move(key);
  op.value = std::move(value);
  op.lease = lease;
  return op;
}
EtcdOp EtcdOp::get(std::string key) {
  EtcdOp op;
  op.kind = Kind::kGet;
  op.key = std::move(key);
  return op;
}
EtcdOp EtcdOp::del(std::string key) {
  EtcdOp op;
  op.kind = Kind::kDelete;
  op.key = std::move(key);
  return op;
}

class EtcdClient::Impl {
 public:
  explicit Impl(EtcdOptions options) : options_(std::move(options)) {
    if (options_.endpoints.empty()) SINEW_THROW(InvalidArgument, "etcd client without endpoints");
  }

  // POSTs `body` to `path` on the current member, moving on to the next on a member's
  // failure, until the request's deadline. Returns the answer's JSON. Throws Timeout when no
  // member answered, IoError when etcd refused the request itself.
  json request(const std::string& path, const json& body) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto deadline = Clock::now() + options_.timeout;
    const std::string payload = body.dump();
    std::string lastError = "no attempt";
    auto backoff = std::chrono::milliseconds(10);
    for (int attempt = 0;; ++attempt) {
      const auto& ep = options_.endpoints[current_ % options_.endpoints.size()];
      const auto attemptDeadline = std::min(deadline, Clock::now() + options_.attemptTimeout);
      int status = 0;
      std::string text;
      beast::error_code ec = exchange(ep, path, payload, attemptDeadline, &status, &text);
      if (!ec) {
        json answer = ::sinew::detail::jsonTooDeep(text)
                          ? json()
                          : json::parse(text, nullptr, /*allow_exceptions=*/false);
        if (status == 200 && answer.is_object()) return answer;
        if (!retryable(status, answer)) {
          SINEW_THROW(IoError, "etcd at ", endpointName(ep), " refused ", path, ": HTTP ", status,
                      ": ", answer.is_object() ? gatewayError(answer) : text.substr(0, 200));
        }
        lastError = "HTTP " + std::to_string(status) + ": " +
                    (answer.is_object() ? gatewayError(answer) : text.substr(0, 200));
      } else {
        lastError = ec.message();
      }
      closeStream();
      lastError = endpointName(ep) + ": " + lastError;
      ++current_;  // Next member.
      if (Clock::now() >= deadline) break;
      // After a round over every member, wait a little (a member may be electing a leader).
      if ((attempt + 1) % options_.endpoints.size() == 0) {
        std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
        backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
      }
    }
    SINEW_THROW(Timeout, "etcd: no member answered ", path, " within ", options_.timeout.count(),
                " ms (last: ", lastError, ")");
  }

  std::vector<EtcdWatchEvent> watch(const std::string& key, bool prefix, int64_t fromRevision,
                                    std::chrono::milliseconds timeout) {
    json create = {{"key", base64(key)}, {"start_revision", std::to_string(fromRevision)}};
    if (prefix) create["range_end"] = base64(prefixEnd(key));
    const std::string payload = json{{"create_request", create}}.dump();
    const auto deadline = Clock::now() + timeout;
    std::string lastError = "no attempt";
    size_t member;
    {
      std::lock_guard<std::mutex> lock(mu_);
      member = current_;
    }
    for (size_t tried = 0; tried < options_.endpoints.size(); ++tried, ++member) {
      const auto& ep = options_.endpoints[member % options_.endpoints.size()];
      asio::io_context io;
      beast::tcp_stream stream(io);
      beast::error_code ec;
      bool established = false;
      std::vector<EtcdWatchEvent> events;
      // Connect and send within one attempt's time; then wait for events until the deadline.
      stream.expires_at(std::min(deadline, Clock::now() + options_.attemptTimeout));
      tcp::resolver resolver(io);
      auto results = resolver.resolve(ep.host, std::to_string(ep.port), ec);
      if (!ec) {
        stream.async_connect(results, [&](beast::error_code e, const tcp::endpoint&) { ec = e; });
        io.run();
        io.restart();
      }
      if (!ec) {
        http::request<http::string_body> req(http::verb::post, "/v3/watch", 11);
        req.set(http::field::host, ep.host);
        req.set(http::field::content_type, "application/json");
        req.body() = payload;
        req.prepare_payload();
        http::async_write(stream, req, [&](beast::error_code e, size_t) { ec = e; });
        io.run();
        io.restart();
      }
      if (!ec) {
        // Read until events arrive or the deadline passes. A member that accepted the watch
        // but stays silent (stopped) costs this call its time; the caller reads again, and
        // reads move on to the next member.
        beast::flat_buffer buffer;
        http::response_parser<http::string_body> parser;
        parser.body_limit(64u << 20);
        std::string pending;
        size_t used = 0;
        stream.expires_at(deadline);
        while (events.empty() && !ec) {
          http::async_read_some(stream, buffer, parser,
                                [&](beast::error_code e, size_t) { ec = e; });
          io.run();
          io.restart();
          if (ec == beast::error::timeout) return events;  // No change before the deadline.
          if (parser.is_header_done() && parser.get().result_int() != 200) {
            lastError = "HTTP " + std::to_string(parser.get().result_int());
            ec = asio::error::connection_refused;
            break;
          }
          auto& body = parser.get().body();
          pending.append(body, used, std::string::npos);
          used = body.size();
          for (const json& msg : takeObjects(pending)) {
            if (msg.contains("error")) {
              SINEW_THROW(IoError, "etcd at ", endpointName(ep), " ended the watch of '", key,
                          "': ", gatewayError(msg.at("error")));
            }
            const json& result = msg.contains("result") ? msg.at("result") : msg;
            if (result.value("canceled", false)) {
              SINEW_THROW(IoError, "etcd at ", endpointName(ep), " canceled the watch of '", key,
                          "' from revision ", fromRevision, ": ",
                          result.value("cancel_reason", std::string("no reason given")),
                          " (compacted at ", num(result, "compact_revision"), ")");
            }
            established = true;
            if (result.contains("events")) {
              for (const json& e : result.at("events")) {
                EtcdWatchEvent ev;
                ev.deleted = e.value("type", std::string("PUT")) == "DELETE";
                if (e.contains("kv")) ev.kv = parseKv(e.at("kv"));
                events.push_back(std::move(ev));
              }
            }
          }
        }
        if (!events.empty()) return events;
      }
      if (ec) lastError = ec.message();
      if (established) return events;  // The watch ran to its deadline.
      if (Clock::now() >= deadline) break;
      lastError = endpointName(ep) + ": " + lastError;
      std::lock_guard<std::mutex> lock(mu_);
      if (current_ == member) ++current_;
    }
    SINEW_THROW(Timeout, "etcd: no member accepted a watch of '", key, "' (last: ", lastError, ")");
  }

  EtcdOptions options_;

 private:
  void closeStream() {
    if (stream_) {
      beast::error_code ignored;
      stream_->socket().shutdown(tcp::socket::shutdown_both, ignored);
      stream_->close();
      stream_.reset();
    }
  }

  // One HTTP exchange on the keep-alive connection (connecting first if needed).
  beast::error_code exchange(const EtcdEndpoint& ep, const std::string& path,
                             const std::string& payload, Clock::time_point deadline, int* status,
                             std::string* text) {
    beast::error_code ec;
    if (stream_ && connectedTo_ != endpointName(ep)) closeStream();
    if (!stream_) {
      stream_ = std::make_unique<beast::tcp_stream>(io_);
      stream_->expires_at(deadline);
      tcp::resolver resolver(io_);
      auto results = resolver.resolve(ep.host, std::to_string(ep.port), ec);
      if (ec) return ec;
      stream_->async_connect(results, [&](beast::error_code e, const tcp::endpoint&) { ec = e; });
      io_.run();
      io_.restart();
      if (ec) return ec;
      stream_->socket().set_option(tcp::no_delay(true), ec);
      connectedTo_ = endpointName(ep);
    }
    stream_->expires_at(deadline);
    http::request<http::string_body> req(http::verb::post, path, 11);
    req.set(http::field::host, ep.host);
    req.set(http::field::content_type, "application/json");
    req.keep_alive(true);
    req.body() = payload;
    req.prepare_payload();
    http::async_write(*stream_, req, [&](beast::error_code e, size_t) { ec = e; });
    io_.run();
    io_.restart();
    if (ec) return ec;
    http::response_parser<http::string_body> parser;
    parser.body_limit(64u << 20);
    http::async_read(*stream_, buffer_, parser, [&](beast::error_code e, size_t) { ec = e; });
    io_.run();
    io_.restart();
    if (ec) return ec;
    *status = parser.get().result_int();
    *text = std::move(parser.get().body());
    if (!parser.get().keep_alive()) closeStream();
    return ec;
  }

  std::mutex mu_;
  // Guarded by mu_.
  asio::io_context io_;
  std::unique_ptr<beast::tcp_stream> stream_;
  beast::flat_buffer buffer_;
  std::string connectedTo_;
  size_t current_ = 0;  // the member requests go to first
};

EtcdClient::EtcdClient(EtcdOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
EtcdClient::~EtcdClient() = default;
const EtcdOptions& EtcdClient::options() const { return impl_->options_; }

std::optional<EtcdKeyValue> EtcdClient::get(const std::string& key, int64_t* revision) {
  json r = impl_->request("/v3/kv/range", json{{"key", base64(key)}});
  if (revision) *revision = num(r.value("header", json::object()), "revision");
  if (!r.contains("kvs") || r.at("kvs").empty()) return std::nullopt;
  return parseKv(r.at("kvs").at(0));
}

std::vector<EtcdKeyValue> EtcdClient::getPrefix(const std::string& prefix, int64_t* revision) {
  json r = impl_->request("/v3/kv/range",
                          json{{"key", base64(prefix)}, {"range_end", base64(prefixEnd(prefix))}});
  if (revision) *revision = num(r.value("header", json::object()), "revision");
  std::vector<EtcdKeyValue> out;
  if (r.contains("kvs")) {
    for (const json& kv : r.at("kvs")) out.push_back(parseKv(kv));
  }
  return out;
}

int64_t EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  json body = {{"key", base64(key)}, {"value", base64(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  json r = impl_->request("/v3/kv/put", body);
  return num(r.value("header", json::object()), "revision");
}

int64_t EtcdClient::deleteKey(const std::string& key) {
  return num(impl_->request("/v3/kv/deleterange", json{{"key", base64(key)}}), "deleted");
}

int64_t EtcdClient::deletePrefix(const std::string& prefix) {
  return num(impl_->request("/v3/kv/deleterange", json{{"key", base64(prefix)},
                                                       {"range_end", base64(prefixEnd(prefix))}}),
             "deleted");
}

EtcdTxnResult EtcdClient::txn(const std::vector<EtcdCompare>& compares,
                              const std::vector<EtcdOp>& success,
                              const std::vector<EtcdOp>& failure) {
  json body = {{"compare", json::array()}, {"success", json::array()}, {"failure", json::array()}};
  for (const auto& c : compares) {
    json cj = {{"key", base64(c.key)}, {"target", targetName(c.target)}, {"result", opName(c.op)}};
    if (c.target == EtcdCompare::Target::kValue) {
      cj["value"] = base64(c.value);
    } else {
      cj[targetField(c.target)] = std::to_string(c.number);
    }
    body["compare"].push_back(cj);
  }
  for (const auto& op : success) body["success"].push_back(opJson(op));
  for (const auto& op : failure) body["failure"].push_back(opJson(op));
  json r = impl_->request("/v3/kv/txn", body);
  EtcdTxnResult out;
  out.succeeded = r.value("succeeded", false);
  out.revision = num(r.value("header", json::object()), "revision");
  if (r.contains("responses")) {
    for (const json& resp : r.at("responses")) {
      if (!resp.contains("response_range")) continue;
      const json& range = resp.at("response_range");
      if (range.contains("kvs") && !range.at("kvs").empty()) {
        out.gets.push_back(parseKv(range.at("kvs").at(0)));
      } else {
        out.gets.push_back(std::nullopt);
      }
    }
  }
  return out;
}

int64_t EtcdClient::grantLease(int64_t ttlSeconds, int64_t* grantedTtl) {
  json r = impl_->request("/v3/lease/grant", json{{"TTL", std::to_string(ttlSeconds)}});
  if (r.contains("error") && !r.at("error").get<std::string>().empty()) {
    SINEW_THROW(IoError, "etcd refused a lease of ", ttlSeconds,
                " s: ", ::sinew::detail::jsonPreview(r.at("error")));
  }
  if (grantedTtl) *grantedTtl = num(r, "TTL");
  return num(r, "ID");
}

int64_t EtcdClient::keepAlive(int64_t lease) {
  // The gateway answers {"result": {"ID", "TTL"}}; a lease that is gone has no TTL (0).
  json r = impl_->request("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}});
  const json& result = r.contains("result") ? r.at("result") : r;
  return num(result, "TTL");
}

void EtcdClient::revokeLease(int64_t lease) {
  try {
    impl_->request("/v3/lease/revoke", json{{"ID", std::to_string(lease)}});
  } catch (const IoError& e) {
    // "requested lease not found": already expired, which is what revoking wants.
    if (std::string(e.what()).find("not found") == std::string::npos) throw;
  }
}

std::vector<EtcdWatchEvent> EtcdClient::watch(const std::string& key, bool prefix,
                                              int64_t fromRevision,
                                              std::chrono::milliseconds timeout) {
  return impl_->watch(key, prefix, fromRevision, timeout);
}

}  // namespace collectives
}  // namespace sinew
