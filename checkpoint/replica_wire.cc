// The replica service's message payloads (checkpoint/detail/replica_wire.h,
// docs/checkpoint_format.md "Replication protocol").
#include "sinew/checkpoint/detail/replica_wire.h"

#include <nlohmann/json.hpp>

#include <algorithm>

#include "sinew/base/error.h"
#include "sinew/base/little_endian.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace checkpoint {

namespace replica_wire {

using sinew::detail::appendLe;
using sinew::detail::loadLe;
using sinew::detail::storeLe;
namespace transport = collectives::transport;

const char* requestName(uint8_t type) {
  switch (static_cast<Type>(type)) {
    case Type::kBegin:
      return "begin";
    case Type::kChunk:
      return "chunk";
    case Type::kEnd:
      return "end";
    case Type::kList:
      return "list";
    case Type::kGet:
      return "get";
    case Type::kBeginDelta:
      return "begin delta";
    case Type::kGetLayers:
      return "get layers";
    default:
      return nullptr;
  }
}

const char* answerName(uint8_t type) {
  switch (static_cast<Type>(type)) {
    case Type::kAck:
      return "ack";
    case Type::kListReply:
      return "list reply";
    case Type::kGetReply:
      return "get reply";
    case Type::kData:
      return "data";
    case Type::kError:
      return "error";
    default:
      return nullptr;
  }
}

std::vector<uint8_t> encodeShardId(int owner, int64_t step) {
  std::vector<uint8_t> b;
  appendLe(b, static_cast<uint32_t>(owner), 4);
  appendLe(b, static_cast<uint64_t>(step), 8);
  return b;
}

void decodeShardId(const std::vector<uint8_t>& payload, size_t size, int* owner, int64_t* step,
                   const char* what) {
  if (payload.size() < size || size != 12) {
    SINEW_THROW(Corruption, "replica ", what, " message: ", payload.size(),
                " bytes cannot hold an owner (i32) and a step (i64)");
  }
  *owner = static_cast<int32_t>(static_cast<uint32_t>(loadLe(payload.data(), 4)));
  *step = static_cast<int64_t>(loadLe(payload.data() + 4, 8));
  if (*owner < 0) SINEW_THROW(Corruption, "replica ", what, " message: owner ", *owner, " < 0");
  if (*step < 0) SINEW_THROW(Corruption, "replica ", what, " message: step ", *step, " < 0");
}

BeginRequest decodeBegin(const std::vector<uint8_t>& payload, uint64_t maxShardBytes) {
  BeginRequest r;
  decodeShardId(payload, std::min<size_t>(payload.size(), 12), &r.owner, &r.step, "begin");
  r.layout = ShardLayout::fromJson(std::string(payload.begin() + 12, payload.end()));
  if (r.layout.totalBytes > maxShardBytes) {
    SINEW_THROW(Corruption, "replica begin message: shard of ", r.layout.totalBytes,
                " bytes is over the limit of ", maxShardBytes);
  }
  return r;
}

std::vector<uint8_t> encodeBeginDelta(int owner, int64_t step, int64_t base,
                                      const ShardLayout& layout) {
  std::vector<uint8_t> b = encodeShardId(owner, step);
  b.resize(20);
  storeLe(b.data() + 12, static_cast<uint64_t>(base), 8);
  const std::string json = layout.toJson();
  b.insert(b.end(), json.begin(), json.end());
  return b;
}

BeginRequest decodeBeginDelta(const std::vector<uint8_t>& payload, uint64_t maxShardBytes,
                              int64_t* base) {
  if (payload.size() < 20) {
    SINEW_THROW(Corruption, "replica begin delta message: ", payload.size(),
                " bytes cannot hold an owner, a step and a base step");
  }
  // The begin message without the base step: its owner and step, then the rest.
  std::vector<uint8_t> rest(payload.size() - 8);
  std::copy_n(payload.begin(), 12, rest.begin());
  std::copy(payload.begin() + 20, payload.end(), rest.begin() + 12);
  BeginRequest r = decodeBegin(rest, maxShardBytes);
  *base = static_cast<int64_t>(loadLe(payload.data() + 12, 8));
  if (*base < 0 || *base >= r.step) {
    SINEW_THROW(Corruption, "replica begin delta message: base step ", *base,
                " is not in [0, step ", r.step, ")");
  }
  return r;
}

transport::FrameRules serviceRules(uint64_t token, uint32_t maxChunk) {
  transport::FrameRules r;
  r.service = transport::Service::kReplica;
  r.token = token;
  r.typeName = &requestName;
  r.maxPayloadBytes = std::max<uint32_t>(maxChunk, 16u << 20);
  r.maxPayloadOf = [](uint8_t type) -> uint32_t {
    switch (static_cast<Type>(type)) {
      case Type::kChunk:
        return UINT32_MAX;  // bounded by maxPayloadBytes
      case Type::kBegin:
      case Type::kBeginDelta:
      case Type::kGetLayers:
        return 16u << 20;  // a layout's JSON, or the layers' names
      case Type::kEnd:
      case Type::kList:
        return 0;
      default:
        return 12;  // get: owner and step
    }
  };
  return r;
}

transport::FrameRules clientRules(uint64_t token) {
  transport::FrameRules r;
  r.service = transport::Service::kReplica;
  r.token = token;
  r.typeName = &answerName;
  r.maxPayloadBytes = 256u << 20;
  return r;
}

std::vector<uint8_t> encodeGetLayers(int owner, int64_t step,
                                     const std::vector<std::string>& layers) {
  std::vector<uint8_t> b = encodeShardId(owner, step);
  const std::string json = nlohmann::json(layers).dump();
  b.insert(b.end(), json.begin(), json.end());
  return b;
}

std::vector<std::string> decodeGetLayers(const std::vector<uint8_t>& payload, int* owner,
                                         int64_t* step) {
  using nlohmann::json;
  decodeShardId(payload, std::min<size_t>(payload.size(), 12), owner, step, "get layers");
  const char* text = reinterpret_cast<const char*>(payload.data()) + 12;
  const char* end = reinterpret_cast<const char*>(payload.data()) + payload.size();
  if (::sinew::detail::jsonTooDeep(text, end)) {
    SINEW_THROW(Corruption, "replica get layers message nests JSON deeper than ",
                ::sinew::detail::kMaxJsonDepth, " levels");
  }
  json j = json::parse(text, end, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_array()) {
    SINEW_THROW(Corruption, "replica get layers message: its layers are not a JSON array");
  }
  if (j.empty() || j.size() > kMaxGetLayers) {
    SINEW_THROW(Corruption, "replica get layers message names ", j.size(),
                " layers; it must name 1 to ", kMaxGetLayers);
  }
  std::vector<std::string> layers;
  for (const auto& e : j) {
    if (!e.is_string() || e.get<std::string>().empty()) {
      SINEW_THROW(Corruption, "replica get layers message: layer ", ::sinew::detail::jsonPreview(e),
                  " is not a non-empty string");
    }
    layers.push_back(e.get<std::string>());
  }
  return layers;
}

std::vector<uint8_t> encodeList(const std::vector<ShardEntry>& shards) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& s : shards) {
    j.push_back({{"owner", s.owner}, {"step", s.step}, {"layout", s.layout.toJson()}});
  }
  const std::string text = j.dump();
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::vector<ShardEntry> decodeList(const std::vector<uint8_t>& payload, const std::string& from) {
  using nlohmann::json;
  const char* text = reinterpret_cast<const char*>(payload.data());
  if (::sinew::detail::jsonTooDeep(text, text + payload.size())) {
    SINEW_THROW(Corruption, "replica list from ", from, " nests JSON deeper than ",
                ::sinew::detail::kMaxJsonDepth, " levels");
  }
  json j = json::parse(payload.begin(), payload.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) SINEW_THROW(Corruption, "replica list from ", from, " does not parse");
  if (!j.is_array()) SINEW_THROW(Corruption, "replica list from ", from, " is not a JSON array");
  std::vector<ShardEntry> out;
  for (const auto& e : j) {
    const auto field = [&](const char* name) -> const json& {
      if (!e.is_object() || !e.contains(name)) {
        SINEW_THROW(Corruption, "replica list from ", from, ": entry ",
                    ::sinew::detail::jsonPreview(e), " has no field '", name, "'");
      }
      return e.at(name);
    };
    const json& owner = field("owner");
    const json& step = field("step");
    const json& layout = field("layout");
    if (!owner.is_number_integer() || owner.get<int64_t>() < 0 ||
        owner.get<int64_t>() > INT32_MAX) {
      SINEW_THROW(Corruption, "replica list from ", from, ": owner ",
                  ::sinew::detail::jsonPreview(owner), " is not an integer in [0, 2^31)");
    }
    if (!step.is_number_integer() || step.get<int64_t>() < 0) {
      SINEW_THROW(Corruption, "replica list from ", from, ": step ",
                  ::sinew::detail::jsonPreview(step), " is not an integer >= 0");
    }
    if (!layout.is_string()) {
      SINEW_THROW(Corruption, "replica list from ", from, ": layout of worker ",
                  owner.get<int64_t>(), "'s shard is not a string");
    }
    ShardEntry s;
    s.owner = static_cast<int>(owner.get<int64_t>());
    s.step = step.get<int64_t>();
    s.layout = ShardLayout::fromJson(layout.get<std::string>());
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace replica_wire

}  // namespace checkpoint
}  // namespace sinew
