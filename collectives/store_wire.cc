// The TCP store's message payloads (collectives/detail/store_wire.h, docs/store_protocol.md).
#include "sinew/collectives/detail/store_wire.h"

#include "sinew/base/error.h"
#include "sinew/base/little_endian.h"
#include "sinew/store.h"

namespace sinew {
namespace collectives {

namespace store_wire {
namespace {

void putU32(Bytes& b, uint32_t v) { detail::appendLe(b, v, 4); }
void putI64(Bytes& b, int64_t v) { detail::appendLe(b, static_cast<uint64_t>(v), 8); }
void putBytes(Bytes& b, const uint8_t* data, size_t n) {
  putU32(b, static_cast<uint32_t>(n));
  b.insert(b.end(), data, data + n);
}
void putBytes(Bytes& b, const Bytes& v) { putBytes(b, v.data(), v.size()); }
void putString(Bytes& b, const std::string& s) {
  putBytes(b, reinterpret_cast<const uint8_t*>(s.data()), s.size());
}
void putKeys(Bytes& b, const std::vector<std::string>& keys) {
  putU32(b, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) putString(b, k);
}

// Reads payload fields; any overrun throws Corruption naming the field.
class Reader {
 public:
  Reader(const Bytes& b, const char* what) : b_(b), what_(what) {}
  Bytes bytes(const char* field) {
    uint32_t n = u32(field);
    need(n, field);
    Bytes out(b_.begin() + pos_, b_.begin() + pos_ + n);
    pos_ += n;
    return out;
  }
  std::string string(const char* field) { return toString(bytes(field)); }
  int64_t i64(const char* field) {
    need(8, field);
    uint64_t v = detail::loadLe(b_.data() + pos_, 8);
    pos_ += 8;
    return static_cast<int64_t>(v);
  }
  uint32_t u32(const char* field) {
    need(4, field);
    uint32_t v = static_cast<uint32_t>(detail::loadLe(b_.data() + pos_, 4));
    pos_ += 4;
    return v;
  }
  std::vector<std::string> keys() {
    uint32_t n = u32("key count");
    // Each key takes at least its 4-byte length: a count the payload cannot hold is refused
    // before anything is reserved.
    if (n > (b_.size() - pos_) / 4) {
      SINEW_THROW(Corruption, what_, ": key count ", n, " does not fit in the ", b_.size() - pos_,
                  " bytes left");
    }
    std::vector<std::string> out;
    out.reserve(n);
    for (uint32_t i = 0; i < n; ++i) out.push_back(string("key"));
    return out;
  }
  void end() {
    if (pos_ != b_.size()) {
      SINEW_THROW(Corruption, what_, ": ", b_.size() - pos_,
                  " unexpected trailing bytes after the payload");
    }
  }

 private:
  void need(size_t n, const char* field) {
    if (b_.size() - pos_ < n) {
      SINEW_THROW(Corruption, what_, ": payload ends inside field '", field, "' (needs ", n,
                  " bytes, ", b_.size() - pos_, " left)");
    }
  }
  const Bytes& b_;
  const char* what_;
  size_t pos_ = 0;
};

}  // namespace

const char* requestName(uint8_t type) {
  switch (static_cast<Op>(type)) {
    case Op::kSet:
      return "set";
    case Op::kGet:
      return "get";
    case Op::kAdd:
      return "add";
    case Op::kCompareSet:
      return "compareSet";
    case Op::kWait:
      return "wait";
    case Op::kCheck:
      return "check";
    case Op::kDelete:
      return "delete";
  }
  return nullptr;
}

const char* answerName(uint8_t type) {
  switch (static_cast<Answer>(type)) {
    case Answer::kOk:
      return "ok";
    case Answer::kTimeout:
      return "timeout";
    case Answer::kInvalid:
      return "invalid";
  }
  return nullptr;
}

Bytes encodeRequest(const Request& r) {
  Bytes p;
  switch (r.op) {
    case Op::kSet:
      putString(p, r.key);
      putBytes(p, r.value);
      break;
    case Op::kGet:
      putI64(p, r.timeoutMs);
      putString(p, r.key);
      break;
    case Op::kAdd:
      putString(p, r.key);
      putI64(p, r.delta);
      break;
    case Op::kCompareSet:
      putString(p, r.key);
      putBytes(p, r.expected);
      putBytes(p, r.desired);
      break;
    case Op::kWait:
      putI64(p, r.timeoutMs);
      putKeys(p, r.keys);
      break;
    case Op::kCheck:
      putKeys(p, r.keys);
      break;
    case Op::kDelete:
      putString(p, r.key);
      break;
  }
  return p;
}

Request decodeRequest(uint8_t type, const Bytes& payload) {
  const char* name = requestName(type);
  if (name == nullptr) SINEW_THROW(Corruption, "store request: unknown type ", int(type));
  const std::string what = std::string("store ") + name + " request";
  Reader r(payload, what.c_str());
  Request q;
  q.op = static_cast<Op>(type);
  switch (q.op) {
    case Op::kSet:
      q.key = r.string("key");
      q.value = r.bytes("value");
      break;
    case Op::kGet:
      q.timeoutMs = r.i64("timeout_ms");
      q.key = r.string("key");
      break;
    case Op::kAdd:
      q.key = r.string("key");
      q.delta = r.i64("delta");
      break;
    case Op::kCompareSet:
      q.key = r.string("key");
      q.expected = r.bytes("expected");
      q.desired = r.bytes("desired");
      break;
    case Op::kWait:
      q.timeoutMs = r.i64("timeout_ms");
      q.keys = r.keys();
      break;
    case Op::kCheck:
      q.keys = r.keys();
      break;
    case Op::kDelete:
      q.key = r.string("key");
      break;
  }
  r.end();
  if (q.timeoutMs < 0) {
    SINEW_THROW(Corruption, what, ": field 'timeout_ms' is negative (", q.timeoutMs, ")");
  }
  return q;
}

Bytes encodeBytes(const Bytes& v) {
  Bytes out;
  putBytes(out, v);
  return out;
}
Bytes encodeI64(int64_t v) {
  Bytes out;
  putI64(out, v);
  return out;
}
Bytes encodeString(const std::string& s) {
  Bytes out;
  putString(out, s);
  return out;
}
Bytes decodeBytes(const Bytes& payload, const char* what) {
  Reader r(payload, what);
  Bytes v = r.bytes("value");
  r.end();
  return v;
}
int64_t decodeI64(const Bytes& payload, const char* what) {
  Reader r(payload, what);
  int64_t v = r.i64("value");
  r.end();
  return v;
}
std::string decodeString(const Bytes& payload, const char* what) {
  Reader r(payload, what);
  std::string v = r.string("message");
  r.end();
  return v;
}

transport::FrameRules requestRules(uint64_t token, uint32_t maxBytes) {
  transport::FrameRules r;
  r.service = transport::Service::kStore;
  r.token = token;
  r.typeName = &requestName;
  r.maxPayloadBytes = maxBytes;
  return r;
}

transport::FrameRules answerRules(uint64_t token) {
  transport::FrameRules r;
  r.service = transport::Service::kStore;
  r.token = token;
  r.typeName = &answerName;
  r.maxPayloadBytes = 1u << 30;  // A value as large as the server accepts, and then some.
  return r;
}

}  // namespace store_wire

}  // namespace collectives
}  // namespace sinew
