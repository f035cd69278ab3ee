#include "sinew/checkpoint/persist.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>

#include "sinew/base/crc32c.h"
#include "sinew/base/error.h"
#include "sinew/base/little_endian.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace checkpoint {

using nlohmann::json;

namespace {

constexpr const char* kLatest = "LATEST";
constexpr const char* kLatestLock = "LATEST.lock";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kFormat = "sinew-checkpoint";
constexpr int kFormatVersion = 1;

using ::sinew::detail::jsonField;
using ::sinew::detail::jsonInt;
using ::sinew::detail::jsonString;

constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
// safetensors' own limit on the header (its MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

json tensorJson(const TensorRecord& t) {
  return {{"dtype", t.dtype},
          {"shape", t.shape},
          {"data_offsets", {t.offset, t.offset + t.nbytes}},
          {"crc32c", hex32(t.crc32c)}};
}

// "0x" and 8 hex digits, as hex32 writes them.
uint32_t parseHex32(const json& j, const std::string& what) {
  const std::string s = jsonString<Corruption>(j, what);
  if (s.size() != 10 || s[0] != '0' || s[1] != 'x' ||
      s.find_first_not_of("0123456789abcdefABCDEF", 2) != std::string::npos) {
    SINEW_THROW(Corruption, what, " must be '0x' and 8 hex digits, got '", s.substr(0, 40), "'");
  }
  uint32_t v = 0;
  std::from_chars(s.data() + 2, s.data() + s.size(), v, 16);
  return v;
}

// A file name inside the checkpoint folder: relative, without empty, "." or ".." parts.
std::string parseRelativePath(const json& j, const std::string& what) {
  const std::string s = jsonString<Corruption>(j, what);
  bool ok = !s.empty() && s.size() <= 4096 && s.find('\0') == std::string::npos;
  size_t begin = 0;
  while (ok && begin <= s.size()) {
    size_t slash = s.find('/', begin);
    if (slash == std::string::npos) slash = s.size();
    const std::string part = s.substr(begin, slash - begin);
    ok = !part.empty() && part != "." && part != "..";
    begin = slash + 1;
  }
  if (!ok) {
    SINEW_THROW(Corruption, what, " must be a relative path inside the checkpoint folder, got '",
                s.substr(0, 200), "'");
  }
  return s;
}

// A layer name as ShardLayout::of allows it: non-empty, no '/'.
void checkLayerName(const std::string& layer, const std::string& what) {
  if (layer.empty() || layer.size() > 4096 || layer.find('/') != std::string::npos) {
    SINEW_THROW(Corruption, what, ": layer name '", layer.substr(0, 200),
                "' must be non-empty and contain no '/'");
  }
}

// dtype, shape and data_offsets of one tensor entry (manifest or safetensors header), each
// range-checked, with end - begin == numel * element size. offset/nbytes from data_offsets.
TensorRecord tensorEntryFromJson(const json& j, const std::string& what) {
  TensorRecord t;
  t.dtype = jsonString<Corruption>(jsonField<Corruption>(j, "dtype", what), what + " dtype");
  const json& shape = jsonField<Corruption>(j, "shape", what);
  if (!shape.is_array() || shape.size() > 64) {
    SINEW_THROW(Corruption, what, " shape must be an array of at most 64 dimensions, got ",
                detail::jsonPreview(shape));
  }
  for (const json& d : shape)
    t.shape.push_back(jsonInt<Corruption>(d, what + " shape", 0, kMaxInt64));
  const json& off = jsonField<Corruption>(j, "data_offsets", what);
  if (!off.is_array() || off.size() != 2) {
    SINEW_THROW(Corruption, what, " data_offsets must be [begin, end], got ",
                detail::jsonPreview(off));
  }
  const uint64_t begin = jsonInt<Corruption>(off[0], what + " data_offsets[0]", 0, kMaxInt64);
  const uint64_t end = jsonInt<Corruption>(off[1], what + " data_offsets[1]", 0, kMaxInt64);
  if (end < begin) {
    SINEW_THROW(Corruption, what, " data_offsets [", begin, ", ", end, ") end before they begin");
  }
  const uint64_t bytes = tensorBytes(t.dtype, t.shape, what);
  if (end - begin != bytes) {
    SINEW_THROW(Corruption, what, " data_offsets [", begin, ", ", end, ") hold ", end - begin,
                " bytes but shape ", shapeString(t.shape), " x ", t.dtype, " needs ", bytes);
  }
  t.offset = begin;
  t.nbytes = bytes;
  return t;
}

// Orders tensors by data offset (zero-byte tensors first at equal offsets).
void sortByOffset(std::vector<TensorRecord>& tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorRecord& a, const TensorRecord& b) {
    return std::make_pair(a.offset, a.nbytes) < std::make_pair(b.offset, b.nbytes);
  });
}

json layerJson(const LayerLocation& l) {
  json tensors = json::object();
  for (const auto& t : l.tensors) tensors[t.name] = tensorJson(t);
  json j = {
      {"owner", l.owner}, {"file", l.file}, {"digest", hex32(l.digest)}, {"tensors", tensors}};
  if (!l.sameAs.empty()) j["same_as"] = l.sameAs;
  return j;
}

// "<layer>/<tensor>" split at its first '/' (layer names contain none); Corruption naming
// `what` when either part is empty.
std::pair<std::string, std::string> splitTensorKey(const std::string& key,
                                                   const std::string& what) {
  const size_t slash = key.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == key.size()) {
    SINEW_THROW(Corruption, what, " must be '<layer>/<tensor>', got '", key.substr(0, 200), "'");
  }
  return {key.substr(0, slash), key.substr(slash + 1)};
}

// The optional "same_as" of a layer entry: tensor name -> "<layer>/<tensor>".
void sameAsFromJson(const json& j, const std::string& where, LayerLocation& l) {
  auto it = j.find("same_as");
  if (it == j.end()) return;
  if (!it->is_object()) SINEW_THROW(Corruption, where, " same_as must be a JSON object");
  for (auto a = it->begin(); a != it->end(); ++a) {
    const std::string aw = where + " same_as '" + a.key().substr(0, 200) + "'";
    if (a.key().empty()) SINEW_THROW(Corruption, aw, ": tensor name is empty");
    const std::string target = jsonString<Corruption>(a.value(), aw);
    splitTensorKey(target, aw);
    for (const auto& t : l.tensors) {
      if (t.name == a.key()) SINEW_THROW(Corruption, aw, ": the layer also stores that tensor");
    }
    l.sameAs[a.key()] = target;
  }
}

// what: "checkpoint manifest <path> (version s)" or "shard file record ...".
LayerLocation layerFromJson(const std::string& name, const json& j, const std::string& what) {
  checkLayerName(name, what);
  const std::string where = what + ": layer '" + name + "'";
  LayerLocation l;
  l.owner = static_cast<int>(jsonInt<Corruption>(jsonField<Corruption>(j, "owner", where),
                                                 where + " owner", -1, kMaxInt32));
  l.file = parseRelativePath(jsonField<Corruption>(j, "file", where), where + " file");
  l.digest = parseHex32(jsonField<Corruption>(j, "digest", where), where + " digest");
  const json& tensors = jsonField<Corruption>(j, "tensors", where);
  if (!tensors.is_object()) SINEW_THROW(Corruption, where, " tensors must be a JSON object");
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    const std::string tw = where + " tensor '" + it.key().substr(0, 200) + "'";
    if (it.key().empty()) SINEW_THROW(Corruption, tw, ": tensor name is empty");
    TensorRecord t = tensorEntryFromJson(it.value(), tw);
    t.layer = name;
    t.name = it.key();
    t.crc32c = parseHex32(jsonField<Corruption>(it.value(), "crc32c", tw), tw + " crc32c");
    l.tensors.push_back(std::move(t));
  }
  sameAsFromJson(j, where, l);
  // JSON objects come back sorted by name; data order is by offset. A layer's tensors were
  // written back to back.
  sortByOffset(l.tensors);
  for (size_t i = 1; i < l.tensors.size(); ++i) {
    const TensorRecord &a = l.tensors[i - 1], &b = l.tensors[i];
    if (b.offset != a.offset + a.nbytes) {
      SINEW_THROW(Corruption, where, " tensor '", b.name, "' data_offsets [", b.offset, ", ",
                  b.offset + b.nbytes, ") ",
                  b.offset < a.offset + a.nbytes ? "overlap" : "leave a hole after", " tensor '",
                  a.name, "' [", a.offset, ", ", a.offset + a.nbytes, ")");
    }
  }
  return l;
}

// Entries of a safetensors header, validated against the file's data section of dataBytes:
// every tensor's dtype, shape and data_offsets (as tensorEntryFromJson), and together they
// cover [0, dataBytes) exactly, without holes or overlaps. Keyed "layer/name".
std::map<std::string, TensorRecord> parseSafetensorsHeader(const json& header, uint64_t dataBytes,
                                                           const std::string& what) {
  if (!header.is_object()) SINEW_THROW(Corruption, what, ": header must be a JSON object");
  std::map<std::string, TensorRecord> out;
  std::vector<TensorRecord> order;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object())
        SINEW_THROW(Corruption, what, ": __metadata__ must be an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) {
          SINEW_THROW(Corruption, what, ": __metadata__ value '", m.key().substr(0, 80),
                      "' must be a string, got ", detail::jsonPreview(m.value()));
        }
      }
      continue;
    }
    TensorRecord t =
        tensorEntryFromJson(it.value(), what + ": tensor '" + it.key().substr(0, 200) + "'");
    t.name = it.key();
    order.push_back(t);
    out[it.key()] = std::move(t);
  }
  sortByOffset(order);
  uint64_t at = 0;
  for (const auto& t : order) {
    if (t.offset != at) {
      SINEW_THROW(Corruption, what, ": tensor '", t.name.substr(0, 200), "' data_offsets [",
                  t.offset, ", ", t.offset + t.nbytes, ") ",
                  t.offset < at ? "overlap the tensor before it" : "leave a hole",
                  " (the previous one ends at ", at, ")");
    }
    at = t.offset + t.nbytes;  // Both below 2^63: no overflow.
  }
  if (at != dataBytes) {
    SINEW_THROW(Corruption, what, ": tensors hold ", at, " bytes but the data section has ",
                dataBytes);
  }
  return out;
}

// The safetensors header of the given tensors (offsets already relative to the file's data
// section), padded with spaces to a multiple of 8 bytes as the format recommends.
std::string safetensorsHeader(const std::vector<TensorRecord>& tensors, int64_t step, int owner) {
  json h = json::object();
  h["__metadata__"] = {{"format", "pt"},
                       {"sinew_step", std::to_string(step)},
                       {"sinew_owner", std::to_string(owner)}};
  for (const auto& t : tensors) {
    h[t.layer + "/" + t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.offset, t.offset + t.nbytes}}};
  }
  std::string s = h.dump();
  while (s.size() % 8 != 0) s.push_back(' ');
  return s;
}

// The tensor `name` of `layer` is stored as (PersistOptions::sameAs), or "" when it is stored
// itself: the target of "layer/P" for name P or P.<field>.
std::string storedAs(const std::map<std::string, std::string>& sameAs, const std::string& layer,
                     const std::string& name) {
  const std::string prefix = layer + "/";
  for (auto it = sameAs.lower_bound(prefix); it != sameAs.end(); ++it) {
    if (it->first.compare(0, prefix.size(), prefix) != 0) break;
    const std::string param = it->first.substr(prefix.size());
    if (name == param) return it->second;
    if (name.size() > param.size() && name.compare(0, param.size(), param) == 0 &&
        name[param.size()] == '.') {
      return it->second + name.substr(param.size());
    }
  }
  return "";
}

}  // namespace

std::string versionDirName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string shardFileName(int owner) { return "shard-w" + std::to_string(owner) + ".safetensors"; }

std::string ShardFileRecord::toJson() const {
  json layersJ = json::object();
  for (const auto& kv : layers) layersJ[kv.first] = layerJson(kv.second);
  return json{{"owner", owner},
              {"step", step},
              {"file", file},
              {"bytes", fileBytes},
              {"crc32c", hex32(fileCrc32c)},
              {"layers", layersJ}}
      .dump();
}

ShardFileRecord ShardFileRecord::fromJson(const std::string& text) {
  ShardFileRecord r;
  json j = detail::parseJson<Corruption>(text, "shard file record");
  std::string what = "shard file record";
  r.owner = static_cast<int>(
      jsonInt<Corruption>(jsonField<Corruption>(j, "owner", what), what + " owner", -1, kMaxInt32));
  r.step =
      jsonInt<Corruption>(jsonField<Corruption>(j, "step", what), what + " step", 0, kMaxInt64);
  what += " of worker " + std::to_string(r.owner) + ", version " + std::to_string(r.step);
  const json& file = jsonField<Corruption>(j, "file", what);
  r.file = file.is_string() && file.get<std::string>().empty()
               ? std::string()
               : parseRelativePath(file, what + " file");
  r.fileBytes =
      jsonInt<Corruption>(jsonField<Corruption>(j, "bytes", what), what + " bytes", 0, kMaxInt64);
  r.fileCrc32c = parseHex32(jsonField<Corruption>(j, "crc32c", what), what + " crc32c");
  const json& layers = jsonField<Corruption>(j, "layers", what);
  if (!layers.is_object()) SINEW_THROW(Corruption, what, " layers must be a JSON object");
  for (auto it = layers.begin(); it != layers.end(); ++it) {
    r.layers[it.key()] = layerFromJson(it.key(), it.value(), what);
  }
  return r;
}

std::string Manifest::toJson() const {
  json filesJ = json::object();
  for (const auto& kv : files) {
    filesJ[kv.first] = {{"bytes", kv.second.first}, {"crc32c", hex32(kv.second.second)}};
  }
  json layersJ = json::object();
  for (const auto& kv : layers) layersJ[kv.first] = layerJson(kv.second);
  return json{{"format", kFormat},
              {"format_version", kFormatVersion},
              {"step", step},
              {"files", filesJ},
              {"layers", layersJ}}
      .dump(1);
}

Manifest Manifest::fromJson(const std::string& text, const std::string& path) {
  Manifest m;
  json j = detail::parseJson<Corruption>(text, "checkpoint manifest " + path);
  std::string what = "checkpoint manifest " + path;
  const std::string format =
      jsonString<Corruption>(jsonField<Corruption>(j, "format", what), what + " format");
  if (format != kFormat) {
    SINEW_THROW(Corruption, what, ": format '", format.substr(0, 80), "', expected '", kFormat,
                "'");
  }
  jsonInt<Corruption>(jsonField<Corruption>(j, "format_version", what), what + " format_version",
                      kFormatVersion, kFormatVersion);
  m.step =
      jsonInt<Corruption>(jsonField<Corruption>(j, "step", what), what + " step", 0, kMaxInt64);
  what += " (version " + std::to_string(m.step) + ")";
  const json& files = jsonField<Corruption>(j, "files", what);
  if (!files.is_object()) SINEW_THROW(Corruption, what, ": files must be a JSON object");
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string name = parseRelativePath(it.key(), what + " file name");
    const std::string fw = what + ": file '" + name + "'";
    // A safetensors file holds at least its 8-byte header length.
    m.files[name] = {jsonInt<Corruption>(jsonField<Corruption>(it.value(), "bytes", fw),
                                         fw + " bytes", 8, kMaxInt64),
                     parseHex32(jsonField<Corruption>(it.value(), "crc32c", fw), fw + " crc32c")};
  }
  const json& layers = jsonField<Corruption>(j, "layers", what);
  if (!layers.is_object()) SINEW_THROW(Corruption, what, ": layers must be a JSON object");
  for (auto it = layers.begin(); it != layers.end(); ++it) {
    m.layers[it.key()] = layerFromJson(it.key(), it.value(), what);
  }
  // A tensor stored once names a tensor the version stores, of its dtype and shape (the
  // target is never itself stored elsewhere: it is among its layer's `tensors`).
  for (const auto& kv : m.layers) {
    for (const auto& [name, target] : kv.second.sameAs) {
      const std::string aw = what + ": layer '" + kv.first + "' tensor '" + name + "' same_as '" +
                             target.substr(0, 200) + "'";
      // Named, not bound: a lambda may not capture a structured binding in C++17 (clang).
      const std::pair<std::string, std::string> key = splitTensorKey(target, aw);
      const std::string& tensor = key.second;
      auto owner = m.layers.find(key.first);
      const bool found = owner != m.layers.end() &&
                         std::any_of(owner->second.tensors.begin(), owner->second.tensors.end(),
                                     [&](const TensorRecord& t) { return t.name == tensor; });
      if (!found) SINEW_THROW(Corruption, aw, ": the version stores no such tensor");
    }
  }
  // Every layer's file is listed, and the tensors that share a file neither overlap nor lie
  // past its end (holes are fine: incremental versions use a subset of an older file).
  std::map<std::string, std::vector<TensorRecord>> byFile;
  for (const auto& kv : m.layers) {
    auto f = m.files.find(kv.second.file);
    if (f == m.files.end()) {
      SINEW_THROW(Corruption, what, ": layer '", kv.first, "' file '", kv.second.file,
                  "' is not among the manifest's files");
    }
    for (const auto& t : kv.second.tensors) {
      if (t.offset + t.nbytes > f->second.first - 8) {
        SINEW_THROW(Corruption, what, ": layer '", kv.first, "' tensor '", t.name,
                    "' data_offsets [", t.offset, ", ", t.offset + t.nbytes, ") lie past the ",
                    f->second.first, " bytes of file '", f->first, "'");
      }
      byFile[kv.second.file].push_back(t);
    }
  }
  for (auto& kv : byFile) {
    sortByOffset(kv.second);
    for (size_t i = 1; i < kv.second.size(); ++i) {
      const TensorRecord &a = kv.second[i - 1], &b = kv.second[i];
      if (b.offset < a.offset + a.nbytes) {
        SINEW_THROW(Corruption, what, ": in file '", kv.first, "' tensor '", b.layer, "/", b.name,
                    "' data_offsets [", b.offset, ", ", b.offset + b.nbytes, ") overlap tensor '",
                    a.layer, "/", a.name, "' [", a.offset, ", ", a.offset + a.nbytes, ")");
      }
    }
  }
  return m;
}

// ---------------------------------------------------------------------------------------
// Writer.

CheckpointWriter::CheckpointWriter(PersistOptions options)
    : options_(std::move(options)), env_(options_.env ? options_.env : posixEnv()) {
  if (options_.dir.empty()) SINEW_THROW(InvalidArgument, "PersistOptions::dir is empty");
  if (options_.keep < 1) {
    SINEW_THROW(InvalidArgument, "PersistOptions::keep = ", options_.keep, " must be >= 1");
  }
  env_->createDir(options_.dir);
}

ShardFileRecord CheckpointWriter::writeShard(const HostShard& shard) {
  SINEW_ENFORCE(shard.complete, "writing an incomplete shard of version ", shard.step);
  ShardFileRecord rec;
  rec.owner = shard.owner;
  rec.step = shard.step;

  // Incremental: layers unchanged since the previous durable version keep their old file.
  std::map<std::string, LayerLocation> previous;
  if (options_.incremental) {
    CheckpointReader reader(options_.dir, env_);
    int64_t last = -1;
    try {
      last = reader.latestStep();
    } catch (const Corruption&) {
      last = -1;  // Write everything.
    }
    if (last >= 0 && last < shard.step) previous = reader.manifest(last).layers;
  }
  std::vector<TensorRecord> written;                  // Offsets relative to the new file.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // (offset in shard, bytes) to write.
  uint64_t fileOffset = 0;
  bool anyNew = false;  // A layer not taken from the previous version.
  for (const auto& layer : shard.layout.layers()) {
    const uint32_t digest = shard.layout.layerDigest(layer);
    auto prev = previous.find(layer);
    if (prev != previous.end() && prev->second.digest == digest &&
        prev->second.owner == shard.owner) {
      rec.layers[layer] = prev->second;
      continue;
    }
    anyNew = true;
    LayerLocation loc;
    loc.owner = shard.owner;
    loc.digest = digest;
    for (const auto& t : shard.layout.tensors) {
      if (t.layer != layer) continue;
      const std::string target = storedAs(options_.sameAs, layer, t.name);
      if (!target.empty()) {
        loc.sameAs[t.name] = target;
        continue;
      }
      TensorRecord r = t;
      r.offset = fileOffset;
      fileOffset += t.nbytes;
      ranges.emplace_back(t.offset, t.nbytes);
      written.push_back(r);
      loc.tensors.push_back(r);
    }
    rec.layers[layer] = std::move(loc);
  }
  if (!anyNew && !shard.layout.tensors.empty()) return rec;  // Nothing changed.

  const std::string vdir = joinPath(options_.dir, versionDirName(shard.step));
  env_->createDir(vdir);
  env_->syncDir(options_.dir);
  const std::string rel = versionDirName(shard.step) + "/" + shardFileName(shard.owner);
  const std::string path = joinPath(options_.dir, rel);
  const std::string tmp = path + ".tmp";
  auto file = env_->newWritableFile(tmp);
  std::string header = safetensorsHeader(written, shard.step, shard.owner);
  uint8_t len[8];
  uint64_t hl = header.size();
  ::sinew::detail::storeLe(len, hl, 8);
  uint32_t crc = ::sinew::detail::crc32c(len, 8);
  crc = ::sinew::detail::crc32cExtend(crc, header.data(), header.size());
  file->append(len, 8);
  file->append(header.data(), header.size());
  uint64_t bytes = 8 + header.size();
  for (const auto& r : ranges) {
    crc = ::sinew::detail::crc32cExtend(crc, shard.data() + r.first, r.second);
    file->append(shard.data() + r.first, r.second);
    bytes += r.second;
  }
  file->sync();
  file->close();
  env_->renameFile(tmp, path);
  env_->syncDir(vdir);
  for (auto& kv : rec.layers) {
    if (kv.second.file.empty()) kv.second.file = rel;
  }
  rec.file = rel;
  rec.fileBytes = bytes;
  rec.fileCrc32c = crc;
  if (options_.onPoint) options_.onPoint("shard-durable");
  return rec;
}

namespace {

// Writes LATEST naming version `step` (whose manifest must exist), durably.
void writeLatest(Env* env, const std::string& dir, int64_t step) {
  const std::string manifestText =
      env->readFile(joinPath(joinPath(dir, versionDirName(step)), kManifest));
  json latest = {{"step", step},
                 {"manifest", versionDirName(step) + "/" + kManifest},
                 {"manifest_crc32c",
                  hex32(::sinew::detail::crc32c(manifestText.data(), manifestText.size()))}};
  env->writeFileDurably(joinPath(dir, kLatest), latest.dump() + "\n");
}

}  // namespace

void repointLatest(const std::string& dir, Env* env, int64_t step) {
  if (env == nullptr) env = posixEnv();
  auto lock = env->lockFile(joinPath(dir, kLatestLock));
  writeLatest(env, dir, step);
}

void CheckpointWriter::commitVersion(int64_t step, const std::vector<ShardFileRecord>& shards) {
  Manifest m;
  m.step = step;
  // Files of older versions (incremental) are listed in the newest durable manifest,
  // which is the one writeShard compared against.
  CheckpointReader reader(options_.dir, env_);
  std::unique_ptr<Manifest> previous;
  for (const auto& s : shards) {
    SINEW_ENFORCE(s.step == step, "shard record of worker ", s.owner, " is for version ", s.step,
                  ", not ", step);
    if (!s.file.empty()) m.files[s.file] = {s.fileBytes, s.fileCrc32c};
  }
  for (const auto& s : shards) {
    for (const auto& kv : s.layers) {
      SINEW_ENFORCE(m.layers.count(kv.first) == 0, "layer ", kv.first, " of version ", step,
                    " is in two shards");
      m.layers[kv.first] = kv.second;
      const std::string& f = kv.second.file;
      if (m.files.count(f) != 0) continue;
      if (!previous) {
        const int64_t last = reader.latestStep();
        SINEW_ENFORCE(last >= 0, "layer ", kv.first, " points at ", f,
                      " but no earlier version is durable");
        previous = std::make_unique<Manifest>(reader.manifest(last));
      }
      auto it = previous->files.find(f);
      SINEW_ENFORCE(it != previous->files.end(), "layer ", kv.first, " points at ", f,
                    ", which version ", previous->step, " does not list");
      m.files[f] = it->second;
    }
  }
  const std::string vdir = joinPath(options_.dir, versionDirName(step));
  // What every reader will check (e.g. that each same_as names a tensor the version stores):
  // a manifest that fails it is never written, so LATEST never names one.
  const std::string manifestJson = m.toJson();
  Manifest::fromJson(manifestJson, joinPath(vdir, kManifest));
  env_->createDir(vdir);
  env_->writeFileDurably(joinPath(vdir, kManifest), manifestJson);
  if (options_.onPoint) options_.onPoint("manifest-durable");
  // LATEST never moves backwards (docs/failure_semantics.md, rule 8): under a lock shared by
  // every writer of the folder, a version older than the one LATEST names is left unnamed. Only
  // a stale writer (paused or preempted past its epoch) can get here with one: every later
  // version of the job is newer (a restore from an older version than LATEST's, because
  // LATEST's is damaged, first names the restored one: repointLatest). A damaged LATEST is
  // replaced.
  auto lock = env_->lockFile(joinPath(options_.dir, kLatestLock));
  int64_t current = -1;
  try {
    current = reader.latestStep();
  } catch (const Error&) {
    current = -1;
  }
  if (current > step) {
    std::ostringstream what;
    what << "checkpoint " << options_.dir << ": version " << step << " is older than version "
         << current
         << " that LATEST names; a stale writer (paused or preempted) does not move LATEST "
            "backwards";
    throw StaleVersion(step, current, what.str());
  }
  writeLatest(env_, options_.dir, step);
  if (options_.onPoint) options_.onPoint("latest-durable");
  collectGarbage();
}

void CheckpointWriter::flush(const std::vector<std::shared_ptr<const HostShard>>& shards) {
  SINEW_ENFORCE(!shards.empty(), "flush of no shards");
  std::vector<ShardFileRecord> records;
  for (const auto& s : shards) records.push_back(writeShard(*s));
  commitVersion(shards.front()->step, records);
}

void CheckpointWriter::collectGarbage() {
  // Runs only after LATEST names a durable version: nothing deleted here is needed by it.
  CheckpointReader reader(options_.dir, env_);
  std::vector<int64_t> steps = reader.durableSteps();
  const int64_t latest = reader.latestStep();
  std::set<int64_t> kept;
  for (int64_t s : steps) {
    if (static_cast<int>(kept.size()) >= options_.keep) break;
    if (s <= latest) kept.insert(s);
  }
  std::set<std::string> referenced;
  for (int64_t s : kept) {
    for (const auto& kv : reader.manifest(s).files) referenced.insert(kv.first);
  }
  for (const auto& name : env_->listDir(options_.dir)) {
    if (name.rfind("step-", 0) != 0) continue;
    const auto parsed = ::sinew::detail::tryParseInt(name.substr(5));
    if (!parsed || *parsed < 0) continue;  // Not a version folder: not ours to delete.
    const int64_t s = *parsed;
    if (kept.count(s) != 0 || s > latest) continue;  // Newer folders may be in progress.
    const std::string vdir = joinPath(options_.dir, name);
    env_->removeFile(joinPath(vdir, kManifest));
    bool empty = true;
    for (const auto& f : env_->listDir(vdir)) {
      if (referenced.count(name + "/" + f) != 0) {
        empty = false;
      } else {
        env_->removeFile(joinPath(vdir, f));
      }
    }
    if (empty) env_->removeDir(vdir);
  }
  env_->syncDir(options_.dir);
}

// ---------------------------------------------------------------------------------------
// Reader.

CheckpointReader::CheckpointReader(std::string dir, Env* env)
    : dir_(std::move(dir)), env_(env ? env : posixEnv()) {}

int64_t CheckpointReader::latestStep() const {
  const std::string path = joinPath(dir_, kLatest);
  if (!env_->fileExists(path)) return -1;
  const std::string text = env_->readFile(path);
  json j = detail::parseJson<Corruption>(text, "checkpoint pointer " + path);
  const std::string what = "checkpoint pointer " + path;
  const int64_t step =
      jsonInt<Corruption>(jsonField<Corruption>(j, "step", what), what + " step", 0, kMaxInt64);
  const std::string manifestPath = joinPath(
      dir_, parseRelativePath(jsonField<Corruption>(j, "manifest", what), what + " manifest"));
  const uint32_t expected =
      parseHex32(jsonField<Corruption>(j, "manifest_crc32c", what), what + " manifest_crc32c");
  const std::string manifestText = env_->readFile(manifestPath);
  uint32_t actual = ::sinew::detail::crc32c(manifestText.data(), manifestText.size());
  if (actual != expected) {
    SINEW_THROW(Corruption, "checkpoint manifest ", manifestPath, ": crc32c ", hex32(actual),
                " expected ", hex32(expected), " (from ", path, ")");
  }
  return step;
}

std::vector<int64_t> CheckpointReader::durableSteps() const {
  std::vector<int64_t> out;
  if (!env_->fileExists(dir_)) return out;
  for (const auto& name : env_->listDir(dir_)) {
    if (name.rfind("step-", 0) != 0 || name.find('.') != std::string::npos) continue;
    const auto step = ::sinew::detail::tryParseInt(name.substr(5));
    if (!step || *step < 0) continue;  // Not a version folder.
    if (env_->fileExists(joinPath(joinPath(dir_, name), kManifest))) out.push_back(*step);
  }
  std::sort(out.rbegin(), out.rend());
  return out;
}

Manifest CheckpointReader::manifest(int64_t step) const {
  const std::string path = joinPath(joinPath(dir_, versionDirName(step)), kManifest);
  Manifest m = Manifest::fromJson(env_->readFile(path), path);
  if (m.step != step) {
    SINEW_THROW(Corruption, "checkpoint manifest ", path, " is for version ", m.step);
  }
  return m;
}

std::map<std::string, RestoredLayer> CheckpointReader::load(
    int64_t step, const std::vector<std::string>& layers) const {
  const Manifest m = manifest(step);
  std::vector<std::string> wanted = layers;
  if (wanted.empty()) {
    for (const auto& kv : m.layers) wanted.push_back(kv.first);
  }
  struct OpenFile {
    std::unique_ptr<RandomAccessFile> file;
    uint64_t dataStart = 0;
    std::map<std::string, TensorRecord> header;  // Validated against the file's size.
  };
  std::map<std::string, OpenFile> open;
  // Opens (once) the file of `layer` at `loc` and checks its size and header.
  auto openFile = [&](const std::string& layer, const LayerLocation& loc) -> OpenFile& {
    const std::string path = joinPath(dir_, loc.file);
    auto& of = open[loc.file];
    if (of.file) return of;
    of.file = env_->newRandomAccessFile(path);
    const auto expect = m.files.at(loc.file);  // Manifest::fromJson checked it is listed.
    const uint64_t size = of.file->size();
    if (size != expect.first) {
      SINEW_THROW(Corruption, "checkpoint file ", path, " (layer ", layer, "): ", size,
                  " bytes, manifest says ", expect.first, " (truncated or overwritten)");
    }
    uint8_t len[8];
    of.file->read(0, 8, len);  // size >= 8: the manifest's bytes are.
    const uint64_t hl = ::sinew::detail::loadLe(len, 8);
    if (hl > size - 8 || hl > kMaxHeaderBytes) {
      SINEW_THROW(Corruption, "checkpoint file ", path, " (layer ", layer, "): header length ", hl,
                  " exceeds the file's ", size, " bytes or the ", kMaxHeaderBytes, "-byte limit");
    }
    std::string header(hl, '\0');
    if (hl > 0) of.file->read(8, hl, &header[0]);
    json parsed = detail::parseJson<Corruption>(
        header, "checkpoint file " + path + " (layer " + layer + "): safetensors header");
    of.dataStart = 8 + hl;
    of.header = parseSafetensorsHeader(parsed, size - of.dataStart,
                                       "checkpoint file " + path + " safetensors header");
    return of;
  };
  // Reads tensor t of `layer` (at `loc`) and checks it against the header and its crc32c.
  auto readTensor = [&](const std::string& layer, const LayerLocation& loc, const TensorRecord& t) {
    OpenFile& of = openFile(layer, loc);
    const std::string path = joinPath(dir_, loc.file);
    auto h = of.header.find(layer + "/" + t.name);
    if (h == of.header.end() || h->second.offset != t.offset || h->second.nbytes != t.nbytes ||
        h->second.dtype != t.dtype || h->second.shape != t.shape) {
      SINEW_THROW(Corruption, "checkpoint file ", path, ": layer ", layer, " tensor ", t.name,
                  " in the safetensors header disagrees with the manifest");
    }
    // Both checked above: the header covers exactly the data section, and t.nbytes is
    // numel * element size of t.shape.
    if (of.dataStart + t.offset + t.nbytes > of.file->size()) {
      SINEW_THROW(Corruption, "checkpoint file ", path, ": layer ", layer, " tensor ", t.name,
                  " lies past the end of the file");
    }
    at::Tensor x = at::empty(t.shape, at::TensorOptions().dtype(scalarTypeOf(t.dtype)));
    if (static_cast<uint64_t>(x.nbytes()) != t.nbytes) {
      SINEW_THROW(Corruption, "checkpoint file ", path, ": layer ", layer, " tensor ", t.name, ": ",
                  t.nbytes, " bytes but shape ", shapeString(t.shape), " x ", t.dtype, " needs ",
                  x.nbytes());
    }
    if (t.nbytes > 0) of.file->read(of.dataStart + t.offset, t.nbytes, x.data_ptr());
    uint32_t actual = ::sinew::detail::crc32c(x.data_ptr(), t.nbytes);
    if (actual != t.crc32c) {
      SINEW_THROW(Corruption, "checkpoint file ", path, ": layer ", layer, " tensor ", t.name,
                  " of version ", step, ": crc32c ", hex32(actual), " expected ", hex32(t.crc32c));
    }
    return x;
  };
  std::map<std::string, RestoredLayer> out;
  for (const auto& layer : wanted) {
    auto it = m.layers.find(layer);
    if (it == m.layers.end()) {
      SINEW_THROW(InvalidArgument, "checkpoint version ", step, " has no layer ", layer);
    }
    const LayerLocation& loc = it->second;
    RestoredLayer restored;
    for (const auto& t : loc.tensors) restored[t.name] = readTensor(layer, loc, t);
    // Tensors stored once: Manifest::fromJson checked that each target is stored.
    for (const auto& [name, target] : loc.sameAs) {
      const auto [ownerLayer, ownerTensor] = splitTensorKey(target, "same_as");
      const LayerLocation& ownerLoc = m.layers.at(ownerLayer);
      for (const auto& t : ownerLoc.tensors) {
        if (t.name == ownerTensor) restored[name] = readTensor(ownerLayer, ownerLoc, t);
      }
    }
    out[layer] = std::move(restored);
  }
  return out;
}

}  // namespace checkpoint
}  // namespace sinew
