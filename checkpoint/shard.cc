#include "sinew/checkpoint/shard.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <set>

#include "sinew/base/crc32c.h"
#include "sinew/base/error.h"
#include "sinew/base/parse.h"

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

namespace {
// Element sizes of the dtypes scalarTypeOf knows, without throwing InvalidArgument.
size_t knownElementSize(const std::string& d) {
  static const std::map<std::string, size_t> kSizes = {
      {"F32", 4}, {"F64", 8}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  auto it = kSizes.find(d);
  return it == kSizes.end() ? 0 : it->second;
}
}  // namespace

std::string shapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

uint64_t tensorBytes(const std::string& d, const std::vector<int64_t>& shape,
                     const std::string& what) {
  const size_t elem = knownElementSize(d);
  if (elem == 0) {
    SINEW_THROW(Corruption, what, ": unknown dtype '", d.substr(0, 32),
                "' (expected F32, F64, F16, BF16, I64, I32, I16, I8, U8 or BOOL)");
  }
  if (shape.size() > 64) {
    SINEW_THROW(Corruption, what, ": shape has ", shape.size(), " dimensions, at most 64");
  }
  std::optional<uint64_t> bytes = elem;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      SINEW_THROW(Corruption, what, ": shape ", shapeString(shape), " has negative dimension ",
                  shape[i]);
    }
    bytes = ::sinew::detail::checkedMul(*bytes, static_cast<uint64_t>(shape[i]));
    if (!bytes) {
      SINEW_THROW(Corruption, what, ": shape ", shapeString(shape), " x ", d,
                  " overflows 64 bits of bytes");
    }
  }
  return *bytes;
}

void validateShardLayout(const ShardLayout& layout, uint64_t bufferBytes, const std::string& what) {
  uint64_t offset = 0;
  std::set<std::string> seenLayers;
  std::set<std::string> seenTensors;  // In the current layer.
  std::string current;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const TensorRecord& t = layout.tensors[i];
    const std::string where = what + ": tensor " + std::to_string(i) + " '" +
                              t.layer.substr(0, 200) + "/" + t.name.substr(0, 200) + "'";
    if (t.layer.empty() || t.layer.find('/') != std::string::npos) {
      SINEW_THROW(Corruption, where, ": layer name must be non-empty and contain no '/'");
    }
    if (t.name.empty()) SINEW_THROW(Corruption, where, ": tensor name is empty");
    if (i == 0 || t.layer != current) {
      if (!seenLayers.insert(t.layer).second) {
        SINEW_THROW(Corruption, where, ": layer ", t.layer,
                    " appears again after other layers (a layer's tensors must be together)");
      }
      current = t.layer;
      seenTensors.clear();
    }
    if (!seenTensors.insert(t.name).second) {
      SINEW_THROW(Corruption, where, ": tensor appears twice in its layer");
    }
    const uint64_t bytes = tensorBytes(t.dtype, t.shape, where);
    if (t.nbytes != bytes) {
      SINEW_THROW(Corruption, where, ": nbytes ", t.nbytes, " but shape ", shapeString(t.shape),
                  " x ", t.dtype, " needs ", bytes);
    }
    if (t.offset != offset) {
      SINEW_THROW(Corruption, where, ": offset ", t.offset, ", expected ", offset,
                  " (tensors lie back to back in order, without holes or overlaps)");
    }
    auto end = ::sinew::detail::checkedAdd(offset, t.nbytes);
    if (!end)
      SINEW_THROW(Corruption, where, ": offset ", offset, " + nbytes ", t.nbytes, " overflows");
    offset = *end;
  }
  if (offset != layout.totalBytes) {
    SINEW_THROW(Corruption, what, ": total_bytes ", layout.totalBytes, " but its tensors hold ",
                offset);
  }
  if (layout.totalBytes > bufferBytes) {
    SINEW_THROW(Corruption, what, ": total_bytes ", layout.totalBytes, " exceed the ", bufferBytes,
                " bytes that hold it");
  }
}

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
      if (nt.name.empty()) {
        SINEW_THROW(InvalidArgument, "layer ", layer.name, " has a nameless tensor");
      }
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

namespace {

// Appends the byte range (offset, bytes) to `ranges`, merged into the last one it continues.
void appendRange(std::vector<std::pair<uint64_t, uint64_t>>* ranges, uint64_t offset,
                 uint64_t bytes) {
  if (!ranges->empty() && ranges->back().first + ranges->back().second == offset) {
    ranges->back().second += bytes;
  } else {
    ranges->emplace_back(offset, bytes);
  }
}

}  // namespace

std::vector<std::pair<uint64_t, uint64_t>> ShardLayout::changedSince(
    const ShardLayout& base) const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorRecord& t = tensors[i];
    if (t.crc32c == base.tensors.at(i).crc32c || t.nbytes == 0) continue;
    appendRange(&out, t.offset, t.nbytes);
  }
  return out;
}

ShardLayout ShardLayout::onlyLayers(const std::vector<std::string>& layers,
                                    std::vector<std::pair<uint64_t, uint64_t>>* ranges) const {
  const std::set<std::string> wanted(layers.begin(), layers.end());
  ShardLayout out;
  ranges->clear();
  for (const TensorRecord& t : tensors) {
    if (wanted.count(t.layer) == 0) continue;
    TensorRecord r = t;
    r.offset = out.totalBytes;
    out.totalBytes += t.nbytes;
    out.tensors.push_back(std::move(r));
    if (t.nbytes != 0) appendRange(ranges, t.offset, t.nbytes);
  }
  return out;
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
    crc = ::sinew::detail::crc32cExtend(crc, key.data(), key.size());
    crc = ::sinew::detail::crc32cExtend(crc, &t.crc32c, sizeof(t.crc32c));
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
  using ::sinew::detail::jsonField;
  using ::sinew::detail::jsonInt;
  using ::sinew::detail::jsonString;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  ShardLayout out;
  json j = detail::parseJson<Corruption>(text, "shard layout");
  const std::string what = "shard layout";
  out.totalBytes = jsonInt<Corruption>(jsonField<Corruption>(j, "total_bytes", what),
                                       what + " total_bytes", 0, kMax);
  const json& tensors = jsonField<Corruption>(j, "tensors", what);
  if (!tensors.is_array()) SINEW_THROW(Corruption, what, ": tensors must be a JSON array");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const json& t = tensors[i];
    const std::string where = what + " tensor " + std::to_string(i);
    TensorRecord r;
    r.layer = jsonString<Corruption>(jsonField<Corruption>(t, "layer", where), where + " layer");
    r.name = jsonString<Corruption>(jsonField<Corruption>(t, "name", where), where + " name");
    r.dtype = jsonString<Corruption>(jsonField<Corruption>(t, "dtype", where), where + " dtype");
    const json& shape = jsonField<Corruption>(t, "shape", where);
    if (!shape.is_array() || shape.size() > 64) {
      SINEW_THROW(Corruption, where, " shape must be an array of at most 64 dimensions, got ",
                  detail::jsonPreview(shape));
    }
    for (const json& d : shape)
      r.shape.push_back(jsonInt<Corruption>(d, where + " shape", 0, kMax));
    r.offset =
        jsonInt<Corruption>(jsonField<Corruption>(t, "offset", where), where + " offset", 0, kMax);
    r.nbytes =
        jsonInt<Corruption>(jsonField<Corruption>(t, "nbytes", where), where + " nbytes", 0, kMax);
    r.crc32c = static_cast<uint32_t>(jsonInt<Corruption>(jsonField<Corruption>(t, "crc32c", where),
                                                         where + " crc32c", 0, 0xffffffffLL));
    out.tensors.push_back(std::move(r));
  }
  validateShardLayout(out, out.totalBytes, what);
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

namespace {

std::string mismatch(const HostShard& shard, const TensorRecord& t, uint32_t actual) {
  return "layer " + t.layer + " tensor " + t.name + " of worker " + std::to_string(shard.owner) +
         "'s shard, version " + std::to_string(shard.step) + ": crc32c " + hex32(actual) +
         " expected " + hex32(t.crc32c);
}

}  // namespace

IncrementalVerify::IncrementalVerify(const HostShard& shard)
    : shard_(shard), crc_(shard.layout.tensors.size(), 0), done_(shard.layout.tensors.size(), 0) {
  const auto& tensors = shard.layout.tensors;
  byOffset_.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) byOffset_[i] = i;
  std::stable_sort(byOffset_.begin(), byOffset_.end(),
                   [&](size_t a, size_t b) { return tensors[a].offset < tensors[b].offset; });
}

void IncrementalVerify::advance(uint64_t receivedUpTo) {
  received_ = std::max(received_, receivedUpTo);
  const auto& tensors = shard_.layout.tensors;
  for (size_t k = first_; k < byOffset_.size(); ++k) {
    const size_t i = byOffset_[k];
    const TensorRecord& t = tensors[i];
    if (t.offset >= received_) break;  // This one and every later one start further on.
    const uint64_t end = std::min(t.offset + t.nbytes, received_);
    const uint64_t from = t.offset + done_[i];
    if (end > from) {
      crc_[i] = ::sinew::detail::crc32cExtend(crc_[i], shard_.data() + from, end - from);
      done_[i] = end - t.offset;
    }
    if (k == first_ && done_[i] == t.nbytes) first_++;
  }
}

std::string IncrementalVerify::result() const {
  SINEW_ENFORCE(received_ >= shard_.layout.totalBytes, "IncrementalVerify::result after ",
                received_, " of ", shard_.layout.totalBytes, " bytes");
  for (size_t i = 0; i < shard_.layout.tensors.size(); ++i) {
    const TensorRecord& t = shard_.layout.tensors[i];
    if (crc_[i] != t.crc32c) return mismatch(shard_, t, crc_[i]);
  }
  return "";
}

std::string HostShard::verify(const std::vector<std::string>& layers) const {
  try {
    validateShardLayout(
        layout, capacity_,
        "worker " + std::to_string(owner) + "'s shard, version " + std::to_string(step));
  } catch (const Corruption& e) {
    return e.what();
  }
  for (const auto& t : layout.tensors) {
    if (!layers.empty() && std::find(layers.begin(), layers.end(), t.layer) == layers.end()) {
      continue;
    }
    uint32_t actual = ::sinew::detail::crc32c(data_ + t.offset, t.nbytes);
    if (actual != t.crc32c) return mismatch(*this, t, actual);
  }
  return "";
}

RestoredLayer HostShard::extractLayer(const std::string& layer) const {
  RestoredLayer out;
  for (const auto& t : layout.tensors) {
    if (t.layer != layer) continue;
    const std::string where = "worker " + std::to_string(owner) + "'s shard, version " +
                              std::to_string(step) + ": tensor '" + t.layer + "/" + t.name + "'";
    const uint64_t bytes = tensorBytes(t.dtype, t.shape, where);
    if (t.nbytes != bytes) {
      SINEW_THROW(Corruption, where, ": nbytes ", t.nbytes, " but shape ", shapeString(t.shape),
                  " x ", t.dtype, " needs ", bytes);
    }
    if (t.offset > capacity_ || t.nbytes > capacity_ - t.offset) {
      SINEW_THROW(Corruption, where, ": bytes [", t.offset, ", ", t.offset, " + ", t.nbytes,
                  ") lie outside the shard's ", capacity_, " bytes");
    }
    at::Tensor x = at::empty(t.shape, at::TensorOptions().dtype(scalarTypeOf(t.dtype)));
    if (t.nbytes > 0) std::memcpy(x.data_ptr(), data_ + t.offset, t.nbytes);
    out[t.name] = x;
  }
  return out;
}

}  // namespace checkpoint
}  // namespace sinew
