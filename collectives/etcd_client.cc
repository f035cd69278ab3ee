#include "sinew/collectives/etcd_client.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace collectives {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace ssl = boost::asio::ssl;
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

// etcd refused the request for want of a valid token: none was sent while authentication is
// on, the token expired or was made invalid (etcd's restart, a simple token's TTL), or the
// auth store changed since it was issued.
bool authError(const json& body) {
  if (!body.is_object()) return false;
  const std::string message = body.value("message", body.value("error", std::string()));
  return message.find("user name is empty") != std::string::npos ||
         message.find("invalid auth token") != std::string::npos ||
         message.find("revision of auth store is old") != std::string::npos;
}

std::string readFirstLine(const std::string& path, const char* what) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) {
    SINEW_THROW(InvalidArgument, what, "='", path, "' cannot be read (or is empty)");
  }
  return line;
}

}  // namespace

EtcdOptions etcdOptionsFromEnvironment(const std::string& endpoints,
                                       const std::string& endpointsName) {
  auto env = [](const char* name) -> std::string {
    const char* v = ::sinew::detail::env(name);
    return v ? v : "";
  };
  EtcdOptions o;
  const std::string list = endpoints.empty() ? env("SINEW_ETCD") : endpoints;
  if (list.empty()) SINEW_THROW(InvalidArgument, "SINEW_ETCD is not set");
  o.endpoints = parseEtcdEndpoints(list, endpoints.empty() ? "SINEW_ETCD" : endpointsName);
  o.user = env("SINEW_ETCD_USER");
  o.password = env("SINEW_ETCD_PASSWORD");
  const std::string passwordFile = env("SINEW_ETCD_PASSWORD_FILE");
  if (!passwordFile.empty()) {
    o.password = readFirstLine(passwordFile, "SINEW_ETCD_PASSWORD_FILE");
  }
  if (!o.user.empty() && o.password.empty()) {
    SINEW_THROW(InvalidArgument, "SINEW_ETCD_USER is set but neither SINEW_ETCD_PASSWORD nor ",
                "SINEW_ETCD_PASSWORD_FILE is");
  }
  if (o.user.empty() && !o.password.empty()) {
    SINEW_THROW(InvalidArgument, "an etcd password is set but SINEW_ETCD_USER is not");
  }
  o.caFile = env("SINEW_ETCD_CA");
  o.certFile = env("SINEW_ETCD_CERT");
  o.keyFile = env("SINEW_ETCD_KEY");
  if (o.certFile.empty() != o.keyFile.empty()) {
    SINEW_THROW(InvalidArgument, "SINEW_ETCD_CERT and SINEW_ETCD_KEY go together (one is set)");
  }
  for (const auto& [name, path] : {std::pair<const char*, std::string>{"SINEW_ETCD_CA", o.caFile},
                                   {"SINEW_ETCD_CERT", o.certFile},
                                   {"SINEW_ETCD_KEY", o.keyFile}}) {
    if (!path.empty() && !std::ifstream(path)) {
      SINEW_THROW(InvalidArgument, name, "='", path, "' cannot be read");
    }
  }
  return o;
}

namespace {

constexpr const char* kSealField = "seal";

// HMAC-SHA256 of key, a NUL and the canonical text, keyed by the token's 8 bytes; hex.
std::string sealOf(const std::string& key, const std::string& canonical, uint64_t token) {
  unsigned char k[8];
  for (int i = 0; i < 8; ++i) k[i] = static_cast<unsigned char>(token >> (8 * i));
  std::string message = key;
  message.push_back('\0');
  message += canonical;
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (!HMAC(EVP_sha256(), k, sizeof(k), reinterpret_cast<const unsigned char*>(message.data()),
            message.size(), mac, &n)) {
    SINEW_THROW(IoError, "HMAC-SHA256 failed (OpenSSL)");
  }
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < n; ++i) {
    out.push_back(hex[mac[i] >> 4]);
    out.push_back(hex[mac[i] & 15]);
  }
  return out;
}

}  // namespace

std::string sealEtcdValue(const std::string& key, const std::string& objectJson, uint64_t token) {
  json j = ::sinew::detail::tryParseJson(objectJson);
  if (!j.is_object()) SINEW_THROW(InvalidArgument, "only a JSON object can be sealed for ", key);
  j.erase(kSealField);
  const std::string seal = sealOf(key, j.dump(), token);
  j[kSealField] = seal;
  return j.dump();
}

namespace {

// openEtcdValue's object itself (without its seal), for readers that go on to look inside.
std::optional<json> openSealedObject(const std::string& key, const std::string& text,
                                     uint64_t token, std::string* why) {
  auto refuse = [&](const std::string& reason) -> std::optional<json> {
    if (why) *why = reason;
    return std::nullopt;
  };
  if (::sinew::detail::jsonTooDeep(text)) return refuse("it nests JSON too deeply");
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return refuse("it is not a JSON object");
  auto it = j.find(kSealField);
  if (it == j.end() || !it->is_string()) return refuse("it has no seal");
  const std::string given = it->get<std::string>();
  j.erase(kSealField);
  const std::string expected = sealOf(key, j.dump(), token);
  if (given.size() != expected.size() ||
      CRYPTO_memcmp(given.data(), expected.data(), expected.size()) != 0) {
    return refuse("its seal is wrong (not written with the job token)");
  }
  return j;
}

}  // namespace

std::optional<std::string> openEtcdValue(const std::string& key, const std::string& text,
                                         uint64_t token, std::string* why) {
  auto opened = openSealedObject(key, text, token, why);
  if (!opened) return std::nullopt;
  return opened->dump();
}

std::optional<std::string> openServingLeader(const EtcdKeyValue& kv, uint64_t token,
                                             std::string* why) {
  auto opened = openSealedObject(kv.key, kv.value, token, why);
  if (!opened) return std::nullopt;
  const json& v = *opened;
  if (!v.contains("port") || !v.at("port").is_number_integer()) {
    if (why) *why = "the leader does not serve yet";
    return std::nullopt;
  }
  if (!v.contains("term") || !v.at("term").is_number_integer() ||
      v.at("term").get<int64_t>() != kv.createRevision) {
    if (why) {
      *why = "it names another term than the key's (" + std::to_string(kv.createRevision) + ")";
    }
    return std::nullopt;
  }
  return v.dump();
}

std::vector<EtcdEndpoint> parseEtcdEndpoints(const std::string& list, const std::string& what) {
  std::vector<EtcdEndpoint> out;
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t comma = list.find(',', pos);
    std::string entry =
        list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    bool tls = false;
    if (entry.rfind("http://", 0) == 0) {
      entry = entry.substr(7);
    } else if (entry.rfind("https://", 0) == 0) {
      entry = entry.substr(8);
      tls = true;
    }
    auto colon = entry.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      SINEW_THROW(InvalidArgument, what, "='", list, "': '", entry, "' is not host:port");
    }
    auto port = ::sinew::detail::tryParseInt(entry.substr(colon + 1));
    if (!port || *port < 1 || *port > 65535) {
      SINEW_THROW(InvalidArgument, what, "='", list, "': '", entry, "' has no port in 1..65535");
    }
    out.push_back({entry.substr(0, colon), static_cast<uint16_t>(*port), tls});
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
  // A connection to one member: plain TCP, or TLS over it.
  struct MemberConnection {
    std::unique_ptr<beast::tcp_stream> plain;
    std::unique_ptr<beast::ssl_stream<beast::tcp_stream>> tls;

    bool open() const { return plain || tls; }
    beast::tcp_stream& lowest() { return tls ? beast::get_lowest_layer(*tls) : *plain; }
    template <class F>
    auto visit(F&& f) {
      return tls ? f(*tls) : f(*plain);
    }
    // Closes without a TLS close_notify (which would wait for the peer).
    void close() {
      if (!open()) return;
      beast::error_code ignored;
      lowest().socket().shutdown(tcp::socket::shutdown_both, ignored);
      lowest().close();
      plain.reset();
      tls.reset();
    }
  };

  explicit Impl(EtcdOptions options) : options_(std::move(options)) {
    if (options_.endpoints.empty()) SINEW_THROW(InvalidArgument, "etcd client without endpoints");
    user_ = options_.user;
    password_ = options_.password;
    const bool anyTls = std::any_of(options_.endpoints.begin(), options_.endpoints.end(),
                                    [](const EtcdEndpoint& e) { return e.tls; });
    if (anyTls) tls_ = makeTlsContext();
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
    bool reauthenticated = false;
    std::string tlsError;
    for (int attempt = 0;; ++attempt) {
      const auto& ep = options_.endpoints[current_ % options_.endpoints.size()];
      const auto attemptDeadline = std::min(deadline, Clock::now() + options_.attemptTimeout);
      int status = 0;
      std::string text;
      beast::error_code ec = ensureToken(ep, attemptDeadline, &lastError);
      if (!ec) ec = exchange(ep, path, payload, token_, attemptDeadline, &status, &text);
      if (!ec) {
        json answer = ::sinew::detail::tryParseJson(text);
        if (status == 200 && answer.is_object()) return answer;
        if (authError(answer)) {
          if (user_.empty()) {
            SINEW_THROW(IoError, "etcd at ", endpointName(ep), " refused ", path,
                        " without authentication (", gatewayError(answer),
                        "): give a user and password (SINEW_ETCD_USER, SINEW_ETCD_PASSWORD)");
          }
          if (!reauthenticated) {
            // The token expired or authentication was turned on since: authenticate again
            // and retry on the same member.
            reauthenticated = true;
            token_.clear();
            authDisabled_ = false;
            continue;
          }
        }
        if (!retryable(status, answer)) {
          SINEW_THROW(IoError, "etcd at ", endpointName(ep), " refused ", path, ": HTTP ", status,
                      ": ", answer.is_object() ? gatewayError(answer) : text.substr(0, 200));
        }
        lastError = "HTTP " + std::to_string(status) + ": " +
                    (answer.is_object() ? gatewayError(answer) : text.substr(0, 200));
      } else if (ec != asio::error::no_permission) {  // (ensureToken said why)
        lastError = describe(ec);
        // A TLS failure says what is wrong with the set-up; a later timeout would hide it.
        if (ec.category() == asio::error::get_ssl_category()) {
          tlsError = endpointName(ep) + ": " + lastError;
        }
      }
      connection_.close();
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
                " ms (last: ", lastError, ")",
                tlsError.empty() || tlsError == lastError ? "" : "; before: " + tlsError);
  }

  // The token a watch sends (authenticating through request()'s member if needed).
  std::string watchToken() {
    std::lock_guard<std::mutex> lock(mu_);
    if (user_.empty() || !token_.empty() || authDisabled_) return token_;
    const auto deadline = Clock::now() + options_.timeout;
    std::string lastError;
    for (size_t tried = 0; tried < options_.endpoints.size() && Clock::now() < deadline; ++tried) {
      const auto& ep = options_.endpoints[current_ % options_.endpoints.size()];
      if (!ensureToken(ep, std::min(deadline, Clock::now() + options_.attemptTimeout),
                       &lastError)) {
        return token_;
      }
      connection_.close();
      ++current_;
    }
    SINEW_THROW(Timeout, "etcd: no member authenticated user '", user_, "' (last: ", lastError,
                ")");
  }

  void forgetToken(const std::string& token) {
    std::lock_guard<std::mutex> lock(mu_);
    if (token_ == token) token_.clear();
    authDisabled_ = false;
  }

  std::vector<EtcdWatchEvent> watch(const std::string& key, bool prefix, int64_t fromRevision,
                                    std::chrono::milliseconds timeout, Cancellation* cancel) {
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
    bool reauthenticated = false;
    for (size_t tried = 0; tried < options_.endpoints.size();) {
      const auto& ep = options_.endpoints[member % options_.endpoints.size()];
      const std::string token = watchToken();
      asio::io_context io;
      MemberConnection conn;
      bool established = false;
      std::vector<EtcdWatchEvent> events;
      // cancel() ends what this attempt waits for (the connect, the request or a read) on
      // io's next turn; the wait then returns no events.
      Cancellation::Registration registration(cancel, [&io, &conn] {
        asio::post(io, [&conn] {
          if (conn.open()) conn.lowest().cancel();
        });
      });
      auto cancelled = [cancel] { return cancel && cancel->cancelled(); };
      if (cancelled()) return events;
      // Connect and send within one attempt's time; then wait for events until the deadline.
      beast::error_code ec =
          connect(io, ep, std::min(deadline, Clock::now() + options_.attemptTimeout), conn);
      if (!ec) {
        auto req = makeRequest(ep, "/v3/watch", payload, token);
        conn.visit([&](auto& s) {
          http::async_write(s, req, [&](beast::error_code e, size_t) { ec = e; });
        });
        io.run();
        io.restart();
      }
      if (cancelled()) return events;
      if (!ec) {
        // Read until events arrive or the deadline passes. A member that accepted the watch
        // but stays silent (stopped) costs this call its time; the caller reads again, and
        // reads move on to the next member.
        beast::flat_buffer buffer;
        http::response_parser<http::string_body> parser;
        parser.body_limit(64u << 20);
        std::string pending;
        size_t used = 0;
        conn.lowest().expires_at(deadline);
        while (events.empty() && !ec) {
          conn.visit([&](auto& s) {
            http::async_read_some(s, buffer, parser, [&](beast::error_code e, size_t) { ec = e; });
          });
          io.run();
          io.restart();
          if (cancelled()) return events;
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
              if (authError(msg.at("error")) && !user_.empty() && !reauthenticated) {
                reauthenticated = true;
                forgetToken(token);
                ec = asio::error::no_permission;
                lastError = gatewayError(msg.at("error"));
                break;
              }
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
      conn.close();
      if (ec == asio::error::no_permission) continue;  // the same member, with a new token
      if (ec) lastError = describe(ec);
      if (established) return events;  // The watch ran to its deadline.
      if (Clock::now() >= deadline) break;
      lastError = endpointName(ep) + ": " + lastError;
      std::lock_guard<std::mutex> lock(mu_);
      if (current_ == member) ++current_;
      ++tried;
      ++member;
    }
    SINEW_THROW(Timeout, "etcd: no member accepted a watch of '", key, "' (last: ", lastError, ")");
  }

  // Switches to root's credentials when the client has none of its own.
  void useRootIfNoUser(const std::string& rootPassword) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!user_.empty()) return;
    user_ = "root";
    password_ = rootPassword;
    token_.clear();
    authDisabled_ = false;
  }

  EtcdOptions options_;

 private:
  std::unique_ptr<ssl::context> makeTlsContext() {
    auto ctx = std::make_unique<ssl::context>(ssl::context::tls_client);
    ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                     ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
    ctx->set_verify_mode(ssl::verify_peer);
    try {
      if (options_.caFile.empty()) {
        ctx->set_default_verify_paths();
      } else {
        ctx->load_verify_file(options_.caFile);
      }
      if (!options_.certFile.empty()) {
        ctx->use_certificate_chain_file(options_.certFile);
        ctx->use_private_key_file(options_.keyFile, ssl::context::pem);
      }
    } catch (const boost::system::system_error& e) {
      SINEW_THROW(InvalidArgument, "etcd TLS: cannot load the CA '", options_.caFile,
                  "' or the client certificate '", options_.certFile, "' and key '",
                  options_.keyFile, "': ", e.code().message());
    }
    return ctx;
  }

  // An error's words; for TLS, OpenSSL's reason (e.g. "certificate verify failed").
  static std::string describe(const beast::error_code& ec) {
    if (ec.category() == asio::error::get_ssl_category()) return "TLS: " + ec.message();
    return ec.message();
  }

  http::request<http::string_body> makeRequest(const EtcdEndpoint& ep, const std::string& path,
                                               const std::string& payload,
                                               const std::string& token) {
    http::request<http::string_body> req(http::verb::post, path, 11);
    req.set(http::field::host, ep.host);
    req.set(http::field::content_type, "application/json");
    if (!token.empty()) req.set(http::field::authorization, token);
    req.keep_alive(true);
    req.body() = payload;
    req.prepare_payload();
    return req;
  }

  // Connects to ep by the deadline, with a TLS handshake for an https endpoint that checks
  // the member's certificate against the CAs and the endpoint's host.
  beast::error_code connect(asio::io_context& io, const EtcdEndpoint& ep,
                            Clock::time_point deadline, MemberConnection& conn) {
    beast::error_code ec;
    auto stream = std::make_unique<beast::tcp_stream>(io);
    stream->expires_at(deadline);
    tcp::resolver resolver(io);
    auto results = resolver.resolve(ep.host, std::to_string(ep.port), ec);
    if (ec) return ec;
    stream->async_connect(results, [&](beast::error_code e, const tcp::endpoint&) { ec = e; });
    io.run();
    io.restart();
    if (ec) return ec;
    stream->socket().set_option(tcp::no_delay(true), ec);
    if (!ep.tls) {
      conn.plain = std::move(stream);
      return {};
    }
    conn.tls = std::make_unique<beast::ssl_stream<beast::tcp_stream>>(std::move(*stream), *tls_);
    SSL* handle = conn.tls->native_handle();
    boost::system::error_code ipError;
    asio::ip::make_address(ep.host, ipError);
    if (!ipError) {
      X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(handle), ep.host.c_str());
    } else {
      SSL_set_tlsext_host_name(handle, ep.host.c_str());
      SSL_set1_host(handle, ep.host.c_str());
    }
    conn.tls->async_handshake(ssl::stream_base::client, [&](beast::error_code e) { ec = e; });
    io.run();
    io.restart();
    return ec;
  }

  // A token for this client, authenticating on ep when it has credentials but no token.
  // etcd without authentication enabled is used without one. Sets *why on a failure.
  beast::error_code ensureToken(const EtcdEndpoint& ep, Clock::time_point deadline,
                                std::string* why) {
    if (user_.empty() || !token_.empty() || authDisabled_) return {};
    int status = 0;
    std::string text;
    const std::string payload = json{{"name", user_}, {"password", password_}}.dump();
    beast::error_code ec =
        exchange(ep, "/v3/auth/authenticate", payload, "", deadline, &status, &text);
    if (ec) {
      *why = describe(ec);
      return ec;
    }
    json answer = ::sinew::detail::tryParseJson(text);
    if (status == 200 && answer.is_object() && answer.contains("token") &&
        answer.at("token").is_string()) {
      token_ = answer.at("token").get<std::string>();
      return {};
    }
    const std::string message = answer.is_object() ? gatewayError(answer) : text.substr(0, 200);
    if (message.find("authentication is not enabled") != std::string::npos) {
      authDisabled_ = true;
      return {};
    }
    if (!retryable(status, answer)) {
      SINEW_THROW(IoError, "etcd at ", endpointName(ep), " refused to authenticate user '", user_,
                  "': ", message);
    }
    *why = "authenticating: HTTP " + std::to_string(status) + ": " + message;
    return asio::error::no_permission;
  }

  // One HTTP exchange on the keep-alive connection (connecting first if needed).
  beast::error_code exchange(const EtcdEndpoint& ep, const std::string& path,
                             const std::string& payload, const std::string& token,
                             Clock::time_point deadline, int* status, std::string* text) {
    beast::error_code ec;
    if (connection_.open() && connectedTo_ != endpointName(ep)) connection_.close();
    if (!connection_.open()) {
      ec = connect(io_, ep, deadline, connection_);
      if (ec) {
        connection_.close();
        return ec;
      }
      connectedTo_ = endpointName(ep);
    }
    connection_.lowest().expires_at(deadline);
    auto req = makeRequest(ep, path, payload, token);
    connection_.visit(
        [&](auto& s) { http::async_write(s, req, [&](beast::error_code e, size_t) { ec = e; }); });
    io_.run();
    io_.restart();
    if (ec) return ec;
    http::response_parser<http::string_body> parser;
    parser.body_limit(64u << 20);
    connection_.visit([&](auto& s) {
      http::async_read(s, buffer_, parser, [&](beast::error_code e, size_t) { ec = e; });
    });
    io_.run();
    io_.restart();
    if (ec) return ec;
    *status = parser.get().result_int();
    *text = std::move(parser.get().body());
    if (!parser.get().keep_alive()) connection_.close();
    return ec;
  }

  std::mutex mu_;
  // Guarded by mu_.
  asio::io_context io_;
  std::unique_ptr<ssl::context> tls_;  // for https endpoints
  MemberConnection connection_;
  beast::flat_buffer buffer_;
  std::string connectedTo_;
  size_t current_ = 0;  // the member requests go to first
  std::string user_, password_;
  std::string token_;          // etcd's token for user_ ("" before authenticating)
  bool authDisabled_ = false;  // etcd said its authentication is not enabled
};

EtcdClient::EtcdClient(EtcdOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
EtcdClient::~EtcdClient() = default;
const EtcdOptions& EtcdClient::options() const { return impl_->options_; }

namespace {

// The one key a range answer holds, nullopt when none.
std::optional<EtcdKeyValue> firstKv(const json& r) {
  if (!r.contains("kvs") || r.at("kvs").empty()) return std::nullopt;
  return parseKv(r.at("kvs").at(0));
}

}  // namespace

std::optional<EtcdKeyValue> EtcdClient::get(const std::string& key, int64_t* revision) {
  json r = impl_->request("/v3/kv/range", json{{"key", base64(key)}});
  if (revision) *revision = num(r.value("header", json::object()), "revision");
  return firstKv(r);
}

std::optional<EtcdKeyValue> EtcdClient::getAt(const std::string& key, int64_t revision) {
  return firstKv(impl_->request(
      "/v3/kv/range", json{{"key", base64(key)}, {"revision", std::to_string(revision)}}));
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

void EtcdClient::enableAuth(const std::string& rootPassword) {
  if (rootPassword.empty()) SINEW_THROW(InvalidArgument, "etcd's root password is empty");
  try {
    impl_->request("/v3/auth/user/add", json{{"name", "root"}, {"password", rootPassword}});
  } catch (const IoError& e) {
    if (std::string(e.what()).find("already exists") != std::string::npos) {
      SINEW_THROW(IoError, "etcd has a root user already (someone set up its authentication ",
                  "before this job); refusing to use it: ", e.what());
    }
    throw;
  }
  try {
    impl_->request("/v3/auth/role/add", json{{"name", "root"}});
  } catch (const IoError& e) {
    if (std::string(e.what()).find("already exists") == std::string::npos) throw;
  }
  impl_->request("/v3/auth/user/grant", json{{"user", "root"}, {"role", "root"}});
  impl_->useRootIfNoUser(rootPassword);
  impl_->request("/v3/auth/enable", json::object());
}

std::vector<EtcdWatchEvent> EtcdClient::watch(const std::string& key, bool prefix,
                                              int64_t fromRevision,
                                              std::chrono::milliseconds timeout,
                                              Cancellation* cancel) {
  return impl_->watch(key, prefix, fromRevision, timeout, cancel);
}

}  // namespace collectives
}  // namespace sinew
