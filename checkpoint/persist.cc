#include "sinew/checkpoint/persist.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>

#include "sinew/checkpoint/detail/crc32c.h"
#include "sinew/collectives/error.h"

namespace sinew {
namespace checkpoint {

using nlohmann::json;

namespace {

constexpr const char* kLatest = "LATEST";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kFormat = "sinew-checkpoint";
constexpr int kFormatVersion = 1;

json tensorJson(const TensorRecord& t) {
  return {{"dtype", t.dtype},
          {"shape", t.shape},
          {"data_offsets", {t.offset, t.offset + t.nbytes}},
          {"crc32c", hex32(t.crc32c)}};
}

uint32_t parseHex32(const json& j) {
  return static_cast<uint32_t>(std::stoul(j.get<std::string>(), nullptr, 16));
}

TensorRecord tensorFromJson(const std::string& layer, const std::string& name, const json& j) {
  TensorRecord t;
  t.layer = layer;
  t.name = name;
  t.dtype = j.at("dtype").get<std::string>();
  t.shape = j.at("shape").get<std::vector<int64_t>>();
  auto off = j.at("data_offsets").get<std::vector<uint64_t>>();
  if (off.size() != 2 || off[1] < off[0]) SINEW_THROW(Corruption, "bad data_offsets");
  t.offset = off[0];
  t.nbytes = off[1] - off[0];
  t.crc32c = parseHex32(j.at("crc32c"));
  return t;
}

json layerJson(const LayerLocation& l) {
  json tensors = json::object();
  for (const auto& t : l.tensors) tensors[t.name] = tensorJson(t);
  return {{"owner", l.owner}, {"file", l.file}, {"digest", hex32(l.digest)}, {"tensors", tensors}};
}

LayerLocation layerFromJson(const std::string& name, const json& j) {
  LayerLocation l;
  l.owner = j.at("owner").get<int>();
  l.file = j.at("file").get<std::string>();
  l.digest = parseHex32(j.at("digest"));
  for (auto it = j.at("tensors").begin(); it != j.at("tensors").end(); ++it) {
    l.tensors.push_back(tensorFromJson(name, it.key(), it.value()));
  }
  // JSON objects come back sorted by name; data order is by offset.
  std::sort(l.tensors.begin(), l.tensors.end(),
            [](const TensorRecord& a, const TensorRecord& b) { return a.offset < b.offset; });
  return l;
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
  try {
    json j = json::parse(text);
    r.owner = j.at("owner").get<int>();
    r.step = j.at("step").get<int64_t>();
    r.file = j.at("file").get<std::string>();
    r.fileBytes = j.at("bytes").get<uint64_t>();
    r.fileCrc32c = parseHex32(j.at("crc32c"));
    for (auto it = j.at("layers").begin(); it != j.at("layers").end(); ++it) {
      r.layers[it.key()] = layerFromJson(it.key(), it.value());
    }
  } catch (const std::exception& e) {
    SINEW_THROW(Corruption, "shard file record does not parse: ", e.what());
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
  try {
    json j = json::parse(text);
    if (j.at("format").get<std::string>() != kFormat ||
        j.at("format_version").get<int>() != kFormatVersion) {
      SINEW_THROW(Corruption, "unknown format or format_version");
    }
    m.step = j.at("step").get<int64_t>();
    for (auto it = j.at("files").begin(); it != j.at("files").end(); ++it) {
      m.files[it.key()] = {it.value().at("bytes").get<uint64_t>(),
                           parseHex32(it.value().at("crc32c"))};
    }
    for (auto it = j.at("layers").begin(); it != j.at("layers").end(); ++it) {
      m.layers[it.key()] = layerFromJson(it.key(), it.value());
    }
  } catch (const std::exception& e) {
    SINEW_THROW(Corruption, "checkpoint manifest ", path, " does not parse: ", e.what());
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
  for (const auto& layer : shard.layout.layers()) {
    const uint32_t digest = shard.layout.layerDigest(layer);
    auto prev = previous.find(layer);
    if (prev != previous.end() && prev->second.digest == digest &&
        prev->second.owner == shard.owner) {
      rec.layers[layer] = prev->second;
      continue;
    }
    LayerLocation loc;
    loc.owner = shard.owner;
    loc.digest = digest;
    for (const auto& t : shard.layout.tensors) {
      if (t.layer != layer) continue;
      TensorRecord r = t;
      r.offset = fileOffset;
      fileOffset += t.nbytes;
      ranges.emplace_back(t.offset, t.nbytes);
      written.push_back(r);
      loc.tensors.push_back(r);
    }
    rec.layers[layer] = std::move(loc);
  }
  if (written.empty() && !shard.layout.tensors.empty()) return rec;  // Nothing changed.

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
  std::memcpy(len, &hl, 8);  // Little-endian hosts.
  uint32_t crc = detail::crc32c(len, 8);
  crc = detail::crc32cExtend(crc, header.data(), header.size());
  file->append(len, 8);
  file->append(header.data(), header.size());
  uint64_t bytes = 8 + header.size();
  for (const auto& r : ranges) {
    crc = detail::crc32cExtend(crc, shard.data() + r.first, r.second);
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
  env_->createDir(vdir);
  env_->writeFileDurably(joinPath(vdir, kManifest), m.toJson());
  if (options_.onPoint) options_.onPoint("manifest-durable");
  const std::string manifestText = env_->readFile(joinPath(vdir, kManifest));
  json latest = {
      {"step", step},
      {"manifest", versionDirName(step) + "/" + kManifest},
      {"manifest_crc32c", hex32(detail::crc32c(manifestText.data(), manifestText.size()))}};
  env_->writeFileDurably(joinPath(options_.dir, kLatest), latest.dump() + "\n");
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
    int64_t s = std::stoll(name.substr(5));
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
  int64_t step;
  std::string manifestPath;
  uint32_t expected;
  try {
    json j = json::parse(text);
    step = j.at("step").get<int64_t>();
    manifestPath = joinPath(dir_, j.at("manifest").get<std::string>());
    expected = parseHex32(j.at("manifest_crc32c"));
  } catch (const std::exception& e) {
    SINEW_THROW(Corruption, "checkpoint pointer ", path, " does not parse: ", e.what());
  }
  const std::string manifestText = env_->readFile(manifestPath);
  uint32_t actual = detail::crc32c(manifestText.data(), manifestText.size());
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
    if (env_->fileExists(joinPath(joinPath(dir_, name), kManifest))) {
      out.push_back(std::stoll(name.substr(5)));
    }
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
    json header;
  };
  std::map<std::string, OpenFile> open;
  std::map<std::string, RestoredLayer> out;
  for (const auto& layer : wanted) {
    auto it = m.layers.find(layer);
    if (it == m.layers.end()) {
      SINEW_THROW(InvalidArgument, "checkpoint version ", step, " has no layer ", layer);
    }
    const LayerLocation& loc = it->second;
    const std::string path = joinPath(dir_, loc.file);
    auto& of = open[loc.file];
    if (!of.file) {
      of.file = env_->newRandomAccessFile(path);
      const auto expect = m.files.at(loc.file);
      if (of.file->size() != expect.first) {
        SINEW_THROW(Corruption, "checkpoint file ", path, " (layer ", layer, "): ", of.file->size(),
                    " bytes, manifest says ", expect.first, " (truncated or overwritten)");
      }
      uint64_t hl = 0;
      if (of.file->size() >= 8) of.file->read(0, 8, &hl);
      if (hl > of.file->size() - 8) {
        SINEW_THROW(Corruption, "checkpoint file ", path, " (layer ", layer, "): header length ",
                    hl, " exceeds the file");
      }
      std::string header(hl, '\0');
      if (hl > 0) of.file->read(8, hl, &header[0]);
      try {
        of.header = json::parse(header);
      } catch (const json::exception& e) {
        SINEW_THROW(Corruption, "checkpoint file ", path, " (layer ", layer,
                    "): safetensors header does not parse: ", e.what());
      }
      of.dataStart = 8 + hl;
    }
    RestoredLayer restored;
    for (const auto& t : loc.tensors) {
      const std::string key = layer + "/" + t.name;
      auto h = of.header.find(key);
      bool agrees = h != of.header.end();
      try {
        agrees = agrees &&
                 tensorFromJson(layer, t.name,
                                {{"dtype", h->at("dtype")},
                                 {"shape", h->at("shape")},
                                 {"data_offsets", h->at("data_offsets")},
                                 {"crc32c", hex32(t.crc32c)}})
                         .offset == t.offset &&
                 h->at("dtype").get<std::string>() == t.dtype &&
                 h->at("shape").get<std::vector<int64_t>>() == t.shape;
      } catch (const std::exception&) {
        agrees = false;
      }
      if (!agrees) {
        SINEW_THROW(Corruption, "checkpoint file ", path, ": layer ", layer, " tensor ", t.name,
                    " in the safetensors header disagrees with the manifest");
      }
      if (of.dataStart + t.offset + t.nbytes > of.file->size()) {
        SINEW_THROW(Corruption, "checkpoint file ", path, ": layer ", layer, " tensor ", t.name,
                    " lies past the end of the file");
      }
      at::Tensor x = at::empty(t.shape, at::TensorOptions().dtype(scalarTypeOf(t.dtype)));
      if (t.nbytes > 0) of.file->read(of.dataStart + t.offset, t.nbytes, x.data_ptr());
      uint32_t actual = detail::crc32c(x.data_ptr(), t.nbytes);
      if (actual != t.crc32c) {
        SINEW_THROW(Corruption, "checkpoint file ", path, ": layer ", layer, " tensor ", t.name,
                    " of version ", step, ": crc32c ", hex32(actual), " expected ",
                    hex32(t.crc32c));
      }
      restored[t.name] = x;
    }
    out[layer] = std::move(restored);
  }
  return out;
}

}  // namespace checkpoint
}  // namespace sinew
