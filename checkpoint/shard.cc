#include "sinew/checkpoint/shard.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "sinew/checkpoint/detail/crc32c.h"
#include "sinew/collectives/error.h"

namespace sinew {
namespace checkpoint {

using nlohmann::json;

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

std::string safetensorsDtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "F32";
    case at::kDouble:
      return "F64";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    case at::kShort:
      return "I16";
    case at::kChar:
      return "I8";
    case at::kByte:
      return "U8";
    case at::kBool:
      return "BOOL";
    default:
      SINEW_THROW(InvalidArgument, "checkpoint: unsupported dtype ", c10::toString(type));
  }
}

at::ScalarType scalarTypeOf(const std::string& d) {
  static const std::map<std::string, at::ScalarType> kTypes = {
      {"F32", at::kFloat}, {"F64", at::kDouble}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},  {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},   {"BOOL", at::kBool}};
  auto it = kTypes.find(d);
  if (it == kTypes.end()) SINEW_THROW(InvalidArgument, "checkpoint: unknown dtype code ", d);
  return it->second;
}

size_t elementSize(const std::string& d) { return c10::elementSize(scalarTypeOf(d)); }

ShardLayout ShardLayout::of(const ShardState& state) {
  ShardLayout out;
  std::set<std::string> seen;
  for (const auto& layer : state) {
    if (layer.name.empty() || layer.name.find('/') != std::string::npos) {
      SINEW_THROW(InvalidArgument, "layer name '", layer.name,
                  "' must be non-empty and contain no '/'");
    }
    if (!seen.insert(layer.name).second) {
      SINEW_THROW(InvalidArgument, "layer ", layer.name, " appears twice");
    }
    std::set<std::string> names;
    for (const auto& nt : layer.tensors) {
      if (!nt.tensor.defined()) {
        SINEW_THROW(InvalidArgument, "layer ", layer.name, " tensor ", nt.name, " is undefined");
      }
      if (!names.insert(nt.name).second) {
        SINEW_THROW(InvalidArgument, "layer ", layer.name, " has tensor ", nt.name, " twice");
      }
      TensorRecord r;
      r.layer = layer.name;
      r.name = nt.name;
      r.dtype = safetensorsDtype(nt.tensor.scalar_type());
      r.shape = nt.tensor.sizes().vec();
      r.offset = out.totalBytes;
      r.nbytes = static_cast<uint64_t>(nt.tensor.numel()) * nt.tensor.element_size();
      out.totalBytes += r.nbytes;
      out.tensors.push_back(std::move(r));
    }
  }
  return out;
}

bool ShardLayout::sameShape(const ShardLayout& o) const {
  if (totalBytes != o.totalBytes || tensors.size() != o.tensors.size()) return false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto &a = tensors[i], &b = o.tensors[i];
    if (a.layer != b.layer || a.name != b.name || a.dtype != b.dtype || a.shape != b.shape ||
        a.offset != b.offset || a.nbytes != b.nbytes) {
      return false;
    }
  }
  return true;
}

std::vector<std::string> ShardLayout::layers() const {
  std::vector<std::string> out;
  for (const auto& t : tensors) {
    if (out.empty() || out.back() != t.layer) out.push_back(t.layer);
  }
  return out;
}

bool ShardLayout::hasLayer(const std::string& layer) const {
  for (const auto& t : tensors) {
    if (t.layer == layer) return true;
  }
  return false;
}

uint32_t ShardLayout::layerDigest(const std::string& layer) const {
  uint32_t crc = 0;
  for (const auto& t : tensors) {
    if (t.layer != layer) continue;
    std::string key = t.name + "|" + t.dtype + "|";
    for (auto d : t.shape) key += std::to_string(d) + ",";
    crc = detail::crc32cExtend(crc, key.data(), key.size());
    crc = detail::crc32cExtend(crc, &t.crc32c, sizeof(t.crc32c));
  }
  return crc;
}

std::string ShardLayout::toJson() const {
  json tensorsJ = json::array();
  for (const auto& t : tensors) {
    tensorsJ.push_back({{"layer", t.layer},
                        {"name", t.name},
                        {"dtype", t.dtype},
                        {"shape", t.shape},
                        {"offset", t.offset},
                        {"nbytes", t.nbytes},
                        {"crc32c", t.crc32c}});
  }
  return json{{"total_bytes", totalBytes}, {"tensors", tensorsJ}}.dump();
}

ShardLayout ShardLayout::fromJson(const std::string& text) {
  ShardLayout out;
  try {
    json j = json::parse(text);
    out.totalBytes = j.at("total_bytes").get<uint64_t>();
    for (const auto& t : j.at("tensors")) {
      TensorRecord r;
      r.layer = t.at("layer").get<std::string>();
      r.name = t.at("name").get<std::string>();
      r.dtype = t.at("dtype").get<std::string>();
      r.shape = t.at("shape").get<std::vector<int64_t>>();
      r.offset = t.at("offset").get<uint64_t>();
      r.nbytes = t.at("nbytes").get<uint64_t>();
      r.crc32c = t.at("crc32c").get<uint32_t>();
      out.tensors.push_back(std::move(r));
    }
  } catch (const json::exception& e) {
    SINEW_THROW(Corruption, "shard layout does not parse: ", e.what());
  }
  return out;
}

namespace {
void freeAligned(uint8_t* p) { std::free(p); }
void noFree(uint8_t*) {}
}  // namespace

HostShard::HostShard(uint64_t capacity, bool pinned) : buffer_(nullptr, noFree) {
  capacity_ = capacity;
  const uint64_t bytes = std::max<uint64_t>(capacity, 1);
  if (pinned) {
    pinned_ = at::empty({static_cast<int64_t>(bytes)},
                        at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    data_ = pinned_.data_ptr<uint8_t>();
  } else {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, bytes) != 0) {
      SINEW_THROW(IoError, "cannot allocate a checkpoint arena slot of ", bytes, " bytes");
    }
    buffer_ = std::unique_ptr<uint8_t, void (*)(uint8_t*)>(static_cast<uint8_t*>(p), freeAligned);
    data_ = buffer_.get();
  }
  std::memset(data_, 0, bytes);  // Fault every page in now: memory stays flat later.
}

std::string HostShard::verify(const std::vector<std::string>& layers) const {
  for (const auto& t : layout.tensors) {
    if (!layers.empty() && std::find(layers.begin(), layers.end(), t.layer) == layers.end()) {
      continue;
    }
    uint32_t actual = detail::crc32c(data_ + t.offset, t.nbytes);
    if (actual != t.crc32c) {
      return "layer " + t.layer + " tensor " + t.name + " of worker " + std::to_string(owner) +
             "'s shard, version " + std::to_string(step) + ": crc32c " + hex32(actual) +
             " expected " + hex32(t.crc32c);
    }
  }
  return "";
}

RestoredLayer HostShard::extractLayer(const std::string& layer) const {
  RestoredLayer out;
  for (const auto& t : layout.tensors) {
    if (t.layer != layer) continue;
    at::Tensor x = at::empty(t.shape, at::TensorOptions().dtype(scalarTypeOf(t.dtype)));
    if (t.nbytes > 0) std::memcpy(x.data_ptr(), data_ + t.offset, t.nbytes);
    out[t.name] = x;
  }
  return out;
}

}  // namespace checkpoint
}  // namespace sinew
