// Crafted bytes against the checkpoint readers (issue 8, "validate every untrusted byte"):
// manifests, safetensors headers, LATEST pointers, shard file records and shard layouts from
// peers whose fields are out of range, inconsistent or overlapping must give Corruption
// naming the field and value, never an out-of-bounds read or a heap overflow. And the
// public CheckpointReader returns the exact bytes an engine wrote.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>

#include "../tool_support.h"
#include "sinew/base/crc32c.h"
#include "sinew/checkpoint/engine.h"
#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/checkpoint_reader.h"
#include "sinew/collectives/hash_store.h"

namespace sinew {
namespace checkpoint {
namespace {

using nlohmann::json;
using sinew::testing::removeTree;
using sinew::testing::tempDir;
using namespace std::chrono_literals;

std::string readAll(const std::string& path) { return posixEnv()->readFile(path); }

void writeAll(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

ShardState makeState(int layers, int64_t width, int64_t seed, const std::string& prefix) {
  ShardState s;
  for (int l = 0; l < layers; ++l) {
    LayerState ls;
    ls.name = prefix + std::to_string(l);
    at::manual_seed(seed * 100 + l);
    ls.tensors.push_back({"weight", at::randn({width, width})});
    ls.tensors.push_back({"bias", at::randn({width}, at::kDouble)});
    ls.tensors.push_back({"step", at::full({}, seed, at::kLong)});
    s.push_back(std::move(ls));
  }
  return s;
}

std::shared_ptr<const HostShard> snap(const ShardState& state, int owner, int64_t step) {
  SnapshotOptions o;
  o.owner = owner;
  SnapshotArena arena(state, o);
  arena.snapshot(step, state);
  arena.waitBeforeUpdate();
  return arena.latest();
}

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  at::Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

// Runs f and expects a Corruption whose message contains every one of `says`.
template <typename E = Corruption>
void expectError(const std::function<void()>& f, const std::vector<std::string>& says,
                 const std::string& label) {
  try {
    f();
    ADD_FAILURE() << label << ": accepted";
  } catch (const E& e) {
    for (const auto& s : says) {
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << label << ": '" << e.what() << "' does not say '" << s << "'";
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << label << ": wrong exception type: " << e.what();
  }
}

// A durable version 120 of one shard (layers.0..2) in a fresh folder.
struct Written {
  std::string dir, manifestPath, shardPath;
  json manifest;
};

Written writeVersion(const std::string& name) {
  Written w;
  w.dir = tempDir(name);
  PersistOptions o;
  o.dir = w.dir;
  CheckpointWriter writer(o);
  writer.flush({snap(makeState(3, 8, 1, "layers."), 0, 120)});
  w.manifestPath = w.dir + "/step-00000120/manifest.json";
  w.shardPath = w.dir + "/step-00000120/shard-w0.safetensors";
  w.manifest = json::parse(readAll(w.manifestPath));
  return w;
}

// Rewrites the manifest of version 120 after `edit` and loads all layers.
void loadWithManifest(const Written& w, const std::function<void(json&)>& edit) {
  json m = w.manifest;
  edit(m);
  writeAll(w.manifestPath, m.dump(1));
  CheckpointReader(w.dir).load(120);
}

// The safetensors file split into its header JSON and data section.
struct Safetensors {
  json header;
  std::string data;
};

Safetensors splitFile(const std::string& bytes) {
  uint64_t hl = 0;
  std::memcpy(&hl, bytes.data(), 8);
  return {json::parse(bytes.substr(8, hl)), bytes.substr(8 + hl)};
}

std::string joinFile(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t hl = header.size();
  std::memcpy(&out[0], &hl, 8);
  return out + header + data;
}

// Rewrites the shard file (and the manifest's recorded size for it) and loads all layers.
void loadWithFile(const Written& w, const std::string& bytes) {
  writeAll(w.shardPath, bytes);
  json m = w.manifest;
  m["files"]["step-00000120/shard-w0.safetensors"]["bytes"] = bytes.size();
  writeAll(w.manifestPath, m.dump(1));
  CheckpointReader(w.dir).load(120);
}

TEST(ManifestValidationTest, DataOffsetsLargerThanTheShapeAreCorruptionNotAHeapOverflow) {
  Written w = writeVersion("overflow");
  // Before the fix, this read 4096 bytes into the 256-byte tensor of shape [8, 8] x F32.
  // Make the manifest and the header agree on the larger range, so that only the check of
  // data_offsets against the shape stands between the read and the heap.
  std::string bytes = readAll(w.shardPath);
  Safetensors st = splitFile(bytes);
  json& weight = w.manifest["layers"]["layers.2"]["tensors"]["weight"];
  const uint64_t begin = weight["data_offsets"][0].get<uint64_t>();
  weight["data_offsets"][1] = begin + 4096;
  expectError([&] { loadWithManifest(w, [](json&) {}); },
              {"manifest", "version 120", "layer 'layers.2'", "tensor 'weight'",
               "data_offsets [" + std::to_string(begin) + ", " + std::to_string(begin + 4096) +
                   ") hold 4096 bytes but shape [8, 8] x F32 needs 256"},
              "manifest data_offsets");
  st.header["layers.2/weight"]["data_offsets"][1] = begin + 4096;
  expectError(
      [&] { loadWithFile(w, joinFile(st.header.dump(), st.data + std::string(4096, 'x'))); },
      {"hold 4096 bytes but shape [8, 8] x F32 needs 256"}, "both data_offsets");
  removeTree(w.dir);
}

TEST(ManifestValidationTest, EveryFieldIsRangeCheckedAndNamed) {
  Written w = writeVersion("fields");
  const std::string f = "step-00000120/shard-w0.safetensors";
  struct Case {
    std::string label;
    std::function<void(json&)> edit;
    std::vector<std::string> says;
  };
  auto tensor = [](json& m) -> json& { return m["layers"]["layers.1"]["tensors"]["bias"]; };
  const std::vector<Case> cases = {
      {"negative dimension",
       [&](json& m) { tensor(m)["shape"] = {-8}; },
       {"tensor 'bias' shape", "got -8"}},
      {"float dimension",
       [&](json& m) { tensor(m)["shape"] = {8.5}; },
       {"tensor 'bias' shape", "got 8.5"}},
      {"huge dimension",
       [&](json& m) { tensor(m)["shape"] = {json(uint64_t{1} << 63)}; },
       {"tensor 'bias' shape", "9223372036854775808"}},
      {"overflowing shape",
       [&](json& m) {
         tensor(m)["shape"] = {int64_t{1} << 40, int64_t{1} << 40};
       },
       {"tensor 'bias'", "overflows 64 bits"}},
      {"unknown dtype",
       [&](json& m) { tensor(m)["dtype"] = "F128"; },
       {"tensor 'bias'", "unknown dtype 'F128'"}},
      {"string dtype type",
       [&](json& m) { tensor(m)["dtype"] = 7; },
       {"tensor 'bias' dtype must be a string"}},
      {"end before begin",
       [&](json& m) {
         tensor(m)["data_offsets"] = {300, 200};
       },
       {"tensor 'bias' data_offsets [300, 200) end before they begin"}},
      {"negative offset",
       [&](json& m) { tensor(m)["data_offsets"][0] = -64; },
       {"tensor 'bias' data_offsets[0]", "got -64"}},
      {"three offsets",
       [&](json& m) { tensor(m)["data_offsets"].push_back(0); },
       {"tensor 'bias' data_offsets must be [begin, end]"}},
      {"bad crc32c",
       [&](json& m) { tensor(m)["crc32c"] = "0x12"; },
       {"tensor 'bias' crc32c must be '0x' and 8 hex digits, got '0x12'"}},
      {"crc32c as number",
       [&](json& m) { tensor(m)["crc32c"] = 12; },
       {"tensor 'bias' crc32c must be a string"}},
      {"float step", [&](json& m) { m["step"] = 120.5; }, {"step must be an integer", "120.5"}},
      {"negative step", [&](json& m) { m["step"] = -3; }, {"step must be an integer", "-3"}},
      {"string step", [&](json& m) { m["step"] = "120"; }, {"step must be an integer", "\"120\""}},
      {"format version", [&](json& m) { m["format_version"] = 2; }, {"format_version", "got 2"}},
      {"file outside the folder",
       [&](json& m) { m["layers"]["layers.0"]["file"] = "../../etc/passwd"; },
       {"layer 'layers.0' file must be a relative path", "'../../etc/passwd'"}},
      {"absolute file",
       [&](json& m) { m["layers"]["layers.0"]["file"] = "/etc/passwd"; },
       {"'/etc/passwd'"}},
      {"file not listed",
       [&](json& m) { m["layers"]["layers.0"]["file"] = "step-00000120/other.safetensors"; },
       {"layer 'layers.0' file 'step-00000120/other.safetensors' is not among"}},
      {"file too small", [&](json& m) { m["files"][f]["bytes"] = 3; }, {"bytes", "got 3"}},
      {"tensor past the file",
       [&](json& m) { m["files"][f]["bytes"] = 100; },
       {"lie past the 100 bytes of file"}},
      {"file crc32c",
       [&](json& m) { m["files"][f]["crc32c"] = "0xnothex1"; },
       {"crc32c must be '0x' and 8 hex digits, got '0xnothex1'"}},
      {"owner",
       [&](json& m) { m["layers"]["layers.0"]["owner"] = 1e12; },
       {"layer 'layers.0' owner must be an integer"}},
      {"hole in a layer",
       [&](json& m) {
         json& t = tensor(m);
         auto b = t["data_offsets"][0].get<uint64_t>() + 8;
         t["data_offsets"] = {b, b + 64};
       },
       {"layer 'layers.1'", "leave a hole"}},
      {"layers overlap",
       [&](json& m) { m["layers"]["layers.1"]["tensors"] = m["layers"]["layers.0"]["tensors"]; },
       {"overlap tensor"}},
      {"layer name with a slash",
       [&](json& m) {
         m["layers"]["a/b"] = m["layers"]["layers.0"];
         m["layers"].erase("layers.0");
       },
       {"layer name 'a/b' must be non-empty and contain no '/'"}},
      {"tensors not an object",
       [&](json& m) { m["layers"]["layers.0"]["tensors"] = json::array(); },
       {"tensors must be a JSON object"}},
      {"missing field", [&](json& m) { tensor(m).erase("shape"); }, {"has no field 'shape'"}},
      {"stored once as a tensor the version lacks",
       [&](json& m) {
         m["layers"]["layers.0"]["same_as"] = {{"extra", "layers.1/nope"}};
       },
       {"layer 'layers.0' tensor 'extra' same_as 'layers.1/nope'",
        "the version stores no such tensor"}},
      {"stored once in a layer the version lacks",
       [&](json& m) {
         m["layers"]["layers.0"]["same_as"] = {{"extra", "gone/bias"}};
       },
       {"same_as 'gone/bias'", "the version stores no such tensor"}},
      {"stored once without a layer",
       [&](json& m) {
         m["layers"]["layers.0"]["same_as"] = {{"extra", "bias"}};
       },
       {"layer 'layers.0' same_as 'extra' must be '<layer>/<tensor>', got 'bias'"}},
      {"stored once and stored",
       [&](json& m) {
         m["layers"]["layers.1"]["same_as"] = {{"bias", "layers.0/bias"}};
       },
       {"layer 'layers.1' same_as 'bias': the layer also stores that tensor"}},
      {"same_as not an object",
       [&](json& m) { m["layers"]["layers.0"]["same_as"] = json::array(); },
       {"layer 'layers.0' same_as must be a JSON object"}},
      {"same_as target not a string",
       [&](json& m) {
         m["layers"]["layers.0"]["same_as"] = {{"extra", 7}};
       },
       {"same_as 'extra' must be a string"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    expectError([&] { loadWithManifest(w, c.edit); }, c.says, c.label);
  }
  // The original still loads.
  writeAll(w.manifestPath, w.manifest.dump(1));
  EXPECT_EQ(CheckpointReader(w.dir).load(120).size(), 3u);
  removeTree(w.dir);
}

TEST(SafetensorsValidationTest, HeaderLengthHolesOverlapsAndDisagreementsAreCorruption) {
  Written w = writeVersion("header");
  const std::string bytes = readAll(w.shardPath);
  const Safetensors st = splitFile(bytes);
  // Header length beyond the file (and beyond 2^63).
  for (uint64_t hl : {uint64_t{1} << 40, ~uint64_t{0}, uint64_t{bytes.size()}}) {
    std::string b = bytes;
    std::memcpy(&b[0], &hl, 8);
    expectError([&] { loadWithFile(w, b); }, {w.shardPath, "header length " + std::to_string(hl)},
                "header length");
  }
  // A file shorter than its length field.
  writeAll(w.shardPath, "abc");
  {
    json m = w.manifest;
    m["files"]["step-00000120/shard-w0.safetensors"]["bytes"] = 3;
    writeAll(w.manifestPath, m.dump(1));
    expectError([&] { CheckpointReader(w.dir).load(120); }, {"bytes", "got 3"}, "short file");
  }
  struct Case {
    std::string label;
    std::function<void(json&)> edit;
    std::string extraData;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"hole at the end", [](json&) {}, "12345678", {"tensors hold", "data section has"}},
      {"overlap",
       [](json& h) {
         h["layers.0/bias"]["data_offsets"] = h["layers.0/weight"]["data_offsets"];
         h["layers.0/bias"]["shape"] = h["layers.0/weight"]["shape"];
         h["layers.0/bias"]["dtype"] = h["layers.0/weight"]["dtype"];
       },
       "",
       {"safetensors header", "overlap"}},
      {"negative shape",
       [](json& h) { h["layers.1/step"]["shape"] = {-1}; },
       "",
       {"tensor 'layers.1/step' shape", "got -1"}},
      {"unknown dtype",
       [](json& h) { h["layers.1/step"]["dtype"] = "I128"; },
       "",
       {"unknown dtype 'I128'"}},
      {"metadata not strings",
       [](json& h) { h["__metadata__"]["format"] = 1; },
       "",
       {"__metadata__ value 'format' must be a string"}},
      {"not an object", [](json& h) { h = json::array(); }, "", {"header must be a JSON object"}},
      {"missing tensor", [](json& h) { h.erase("layers.2/step"); }, "", {"tensors hold"}},
      {"disagrees with the manifest",
       [](json& h) {
         // Swap two equal-sized tensors: the header stays consistent, the manifest disagrees.
         std::swap(h["layers.0/weight"], h["layers.1/weight"]);
       },
       "",
       {"layer layers.0 tensor weight in the safetensors header disagrees with the manifest"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    json h = st.header;
    c.edit(h);
    expectError([&] { loadWithFile(w, joinFile(h.dump(), st.data + c.extraData)); }, c.says,
                c.label);
  }
  // Untouched bytes still load.
  loadWithFile(w, bytes);
  removeTree(w.dir);
}

TEST(LatestValidationTest, PointerFieldsAreChecked) {
  Written w = writeVersion("latest");
  const std::string latest = readAll(w.dir + "/LATEST");
  const json good = json::parse(latest);
  struct Case {
    json value;
    std::vector<std::string> says;
  };
  std::vector<Case> cases;
  json j = good;
  j["step"] = -1;
  cases.push_back({j, {"LATEST step", "got -1"}});
  j = good;
  j["step"] = 1.5;
  cases.push_back({j, {"LATEST step", "got 1.5"}});
  j = good;
  j["manifest"] = "../elsewhere/manifest.json";
  cases.push_back({j, {"manifest must be a relative path", "'../elsewhere/manifest.json'"}});
  j = good;
  j["manifest_crc32c"] = "12345678";
  cases.push_back({j, {"manifest_crc32c must be '0x' and 8 hex digits"}});
  for (const Case& c : cases) {
    writeAll(w.dir + "/LATEST", c.value.dump());
    expectError([&] { CheckpointReader(w.dir).latestStep(); }, c.says, c.value.dump());
  }
  writeAll(w.dir + "/LATEST", latest);
  EXPECT_EQ(CheckpointReader(w.dir).latestStep(), 120);
  // Folders that are not versions are skipped, not parsed into garbage.
  ASSERT_EQ(::mkdir((w.dir + "/step-junk").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((w.dir + "/step-99999999999999999999999").c_str(), 0755), 0);
  EXPECT_EQ(CheckpointReader(w.dir).durableSteps(), std::vector<int64_t>{120});
  removeTree(w.dir);
}

// A manifest, LATEST, a safetensors header, a peer's record or layout nested 200,000 deep (or
// deep inside an otherwise valid document) is Corruption naming the limit, before it is
// parsed: the restore then falls back to the version before, as for any other damage. Before,
// the error message's dump() of the deep manifest recursed 200,000 deep and crashed.
TEST(DeepJsonValidationTest, EveryCheckpointDocumentRefusesDeepNesting) {
  Written w = writeVersion("deep");
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  const std::vector<std::string> says = {"nests JSON deeper than 64 levels"};
  writeAll(w.manifestPath, deep);
  expectError([&] { CheckpointReader(w.dir).load(120); }, says, "manifest");
  expectError(
      [&] {
        loadWithManifest(w, [&](json& m) {
          m["format"] = json::parse(std::string(70, '[') + std::string(70, ']'));
        });
      },
      says, "manifest field");
  writeAll(w.manifestPath, w.manifest.dump(1));
  const std::string latest = readAll(w.dir + "/LATEST");
  writeAll(w.dir + "/LATEST", deep);
  expectError([&] { CheckpointReader(w.dir).latestStep(); }, says, "LATEST");
  writeAll(w.dir + "/LATEST", latest);
  Safetensors st = splitFile(readAll(w.shardPath));
  expectError([&] { loadWithFile(w, joinFile(deep, st.data)); }, says, "safetensors header");
  expectError([&] { ShardFileRecord::fromJson(deep); }, says, "record");
  expectError([&] { ShardLayout::fromJson(deep); }, says, "layout");
  removeTree(w.dir);
}

// Weights and optimizer state are the writer's only: a version's folder is 0700, its files and
// LATEST (and its lock) 0600, whatever the umask lets through. Before, 0755 and 0644.
TEST(CheckpointModeTest, VersionsAreReadableByTheirOwnerOnly) {
  const mode_t old = ::umask(022);
  Written w = writeVersion("modes");
  ::umask(old);
  const auto mode = [](const std::string& path) {
    struct stat st {};
    EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
    return st.st_mode & 0777;
  };
  EXPECT_EQ(mode(w.dir + "/step-00000120"), 0700u);
  EXPECT_EQ(mode(w.manifestPath), 0600u);
  EXPECT_EQ(mode(w.shardPath), 0600u);
  EXPECT_EQ(mode(w.dir + "/LATEST"), 0600u);
  EXPECT_EQ(mode(w.dir + "/LATEST.lock"), 0600u);
  removeTree(w.dir);
}

TEST(ShardFileRecordValidationTest, RecordsFromPeersAreChecked) {
  Written w = writeVersion("record");
  ShardFileRecord r;
  r.owner = 3;
  r.step = 7;
  r.file = "step-00000007/shard-w3.safetensors";
  r.fileBytes = 100;
  r.layers = Manifest::fromJson(readAll(w.manifestPath), w.manifestPath).layers;
  const json good = json::parse(r.toJson());
  EXPECT_EQ(ShardFileRecord::fromJson(good.dump()).layers.size(), 3u);
  json j = good;
  j["owner"] = "3";
  expectError([&] { ShardFileRecord::fromJson(j.dump()); }, {"owner must be an integer"}, "owner");
  j = good;
  j["step"] = 1e30;
  expectError([&] { ShardFileRecord::fromJson(j.dump()); }, {"step must be an integer"}, "step");
  j = good;
  j["file"] = "../x";
  expectError([&] { ShardFileRecord::fromJson(j.dump()); }, {"file must be a relative path"},
              "file");
  j = good;
  j["layers"]["layers.0"]["tensors"]["weight"]["shape"] = {8, 9};
  expectError([&] { ShardFileRecord::fromJson(j.dump()); },
              {"worker 3, version 7", "layer 'layers.0' tensor 'weight'", "shape [8, 9] x F32"},
              "shape");
  expectError([&] { ShardFileRecord::fromJson("{not json"); }, {"does not parse"}, "json");
  removeTree(w.dir);
}

// ---------------------------------------------------------------------------------------
// Shard layouts received from peers.

json layoutJson(const ShardLayout& l) { return json::parse(l.toJson()); }

TEST(ShardLayoutValidationTest, LayoutsFromPeersAreCheckedBeforeAnyByteIsRead) {
  const ShardLayout good = ShardLayout::of(makeState(2, 4, 1, "l."));
  EXPECT_TRUE(ShardLayout::fromJson(good.toJson()).sameShape(good));
  struct Case {
    std::string label;
    std::function<void(json&)> edit;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"nbytes beyond the shape",
       [](json& j) { j["tensors"][0]["nbytes"] = 4096; },
       {"tensor 0 'l.0/weight'", "nbytes 4096 but shape [4, 4] x F32 needs 64"}},
      {"offset with a hole",
       [](json& j) { j["tensors"][1]["offset"] = 72; },
       {"tensor 1 'l.0/bias'", "offset 72, expected 64"}},
      {"overlap", [](json& j) { j["tensors"][1]["offset"] = 0; }, {"offset 0, expected 64"}},
      {"total bytes",
       [](json& j) { j["total_bytes"] = 1 << 30; },
       {"total_bytes 1073741824 but its tensors hold"}},
      {"negative dimension",
       [](json& j) {
         j["tensors"][0]["shape"] = {-4, 4};
       },
       {"shape", "got -4"}},
      {"overflow",
       [](json& j) {
         j["tensors"][0]["shape"] = {int64_t{1} << 62, 8};
       },
       {"overflows 64 bits"}},
      {"unknown dtype", [](json& j) { j["tensors"][0]["dtype"] = "Q8"; }, {"unknown dtype 'Q8'"}},
      {"float offset", [](json& j) { j["tensors"][1]["offset"] = 64.0; }, {"offset", "got 64.0"}},
      {"negative nbytes",
       [](json& j) { j["tensors"][1]["nbytes"] = -32; },
       {"nbytes must be an integer", "got -32"}},
      {"crc32c beyond 32 bits",
       [](json& j) { j["tensors"][1]["crc32c"] = uint64_t{1} << 32; },
       {"crc32c must be an integer in [0, 4294967295]"}},
      {"slash in a layer",
       [](json& j) { j["tensors"][0]["layer"] = "a/b"; },
       {"layer name must be non-empty and contain no '/'"}},
      {"duplicate tensor", [](json& j) { j["tensors"][1]["name"] = "weight"; }, {"appears twice"}},
      {"split layer",
       [](json& j) {
         // l.0's tensors, then l.1's, then l.0's again.
         j["tensors"][5]["layer"] = "l.0";
         j["tensors"][5]["name"] = "extra";
       },
       {"layer l.0 appears again after other layers"}},
      {"not json", [](json& j) { j = "garbage"; }, {"must be a JSON object"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    json j = layoutJson(good);
    c.edit(j);
    expectError([&] { ShardLayout::fromJson(j.dump()); }, c.says, c.label);
  }
  expectError([&] { ShardLayout::fromJson("{\"total_bytes\": 1"); }, {"does not parse"},
              "truncated");
}

TEST(ShardLayoutValidationTest, VerifyAndExtractStayInsideTheShardsMemory) {
  const ShardState state = makeState(2, 4, 1, "l.");
  auto good = snap(state, 0, 1);
  // A shard whose layout claims more than its memory holds (as a peer's layout could have
  // before fromJson checked it): verify reports it, extractLayer refuses, neither reads
  // out of bounds.
  HostShard small(good->layout.totalBytes / 2, false);
  small.owner = 0;
  small.step = 1;
  small.layout = good->layout;
  const std::string bad = small.verify();
  EXPECT_NE(bad.find("exceed the " + std::to_string(small.capacity()) + " bytes"),
            std::string::npos)
      << bad;
  expectError([&] { small.extractLayer("l.1"); }, {"'l.1/weight'", "lie outside the shard's"},
              "extract past the end");
  HostShard wrong(good->layout.totalBytes, false);
  wrong.layout = good->layout;
  wrong.layout.tensors[0].nbytes = 4096;  // Bigger than its [4, 4] x F32 tensor.
  EXPECT_NE(wrong.verify().find("nbytes 4096 but shape [4, 4] x F32 needs 64"), std::string::npos)
      << wrong.verify();
  expectError([&] { wrong.extractLayer("l.0"); }, {"nbytes 4096 but shape [4, 4] x F32 needs 64"},
              "extract overflow");
  EXPECT_EQ(good->verify(), "");
}

// ---------------------------------------------------------------------------------------
// The public reader.

TEST(PublicCheckpointReaderTest, ReadsTheExactTensorsAnEngineWrote) {
  const std::string dir = tempDir("validate-public");
  auto store = std::make_shared<collectives::HashStore>();
  CheckpointEngineOptions a, b;
  a.self = 0;
  b.self = 1;
  a.workers = b.workers = {0, 1};
  a.store = b.store = store;
  a.persist.dir = b.persist.dir = dir;
  a.flushEvery = b.flushEvery = 2;
  a.token = b.token = 0x5157a3d2c0ffee02ull;  // Any job token: the engines only talk to each other.
  a.snapshot.slots = b.snapshot.slots = 4;    // Room for the flushing and committed versions.
  std::vector<ShardState> states = {makeState(3, 6, 1, "a."), makeState(2, 5, 2, "b.")};
  {
    CheckpointEngine e0(states[0], a);
    CheckpointEngine e1(states[1], b);
    for (int64_t step = 0; step <= 4; ++step) {
      for (auto& s : states) s[0].tensors[0].tensor.add_(1);
      e0.waitBeforeUpdate();
      e1.waitBeforeUpdate();
      ASSERT_TRUE(e0.snapshot(step, states[0])) << step;
      ASSERT_TRUE(e1.snapshot(step, states[1])) << step;
      e0.waitCommitted(step, 10s);
    }
    e0.waitDurable(4, 20s);
    e0.waitBeforeUpdate();
    e1.waitBeforeUpdate();
  }
  auto reader = ::sinew::CheckpointReader::open(dir);
  EXPECT_EQ(reader->step(), 4);
  EXPECT_EQ(reader->layers(), (std::vector<std::string>{"a.0", "a.1", "a.2", "b.0", "b.1"}));
  EXPECT_EQ(reader->tensorNames("b.1"), (std::vector<std::string>{"weight", "bias", "step"}));
  for (const auto& state : states) {
    for (const auto& layer : state) {
      auto got = reader->loadLayer(layer.name);
      ASSERT_EQ(got.size(), layer.tensors.size()) << layer.name;
      for (const auto& t : layer.tensors) {
        ASSERT_EQ(got.count(t.name), 1u) << layer.name << "/" << t.name;
        EXPECT_TRUE(sameBytes(got.at(t.name), t.tensor)) << layer.name << "/" << t.name;
      }
    }
  }
  EXPECT_THROW(reader->loadLayer("c.0"), InvalidArgument);
  EXPECT_THROW(reader->tensorNames("c.0"), InvalidArgument);
  // An older durable version by number; a missing one and an empty folder are IoError.
  EXPECT_EQ(::sinew::CheckpointReader::steps(dir), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(::sinew::CheckpointReader::open(dir, 2)->step(), 2);
  EXPECT_THROW(::sinew::CheckpointReader::open(dir, 3), IoError);
  const std::string empty = tempDir("validate-public-empty");
  EXPECT_THROW(::sinew::CheckpointReader::open(empty), IoError);
  // A flipped byte is Corruption naming the file.
  const std::string file = dir + "/step-00000004/shard-w1.safetensors";
  std::string bytes = readAll(file);
  bytes[bytes.size() - 1] ^= 0x40;
  writeAll(file, bytes);
  expectError([&] { reader->loadLayer("b.1"); }, {file, "layer b.1 tensor step", "crc32c"},
              "flipped byte");
  EXPECT_NO_THROW(reader->loadLayer("a.0"));
  removeTree(dir);
  removeTree(empty);
}

}  // namespace
}  // namespace checkpoint
}  // namespace sinew
