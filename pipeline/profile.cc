#include "sinew/pipeline/profile.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace pipeline {
namespace {

using nlohmann::json;

constexpr int kFormatVersion = 1;
constexpr int kMaxDevicesPerNode = 4096;
constexpr int64_t kMaxTotalNs = int64_t{1} << 46;
constexpr int64_t kMaxTotalBytes = int64_t{1} << 56;
// Milliseconds beyond this cannot be rounded to int64 nanoseconds safely.
constexpr double kMaxMs = 9.0e12;

// `where` is a prefix for messages ("job.", "layers[3]."); a char pointer, so that no
// temporary string makes GCC 13 suspect the returned reference of dangling.
const json& requireField(const json& object, const char* key, const char* where) {
  auto it = object.find(key);
  if (it == object.end()) {
    SINEW_THROW(InvalidArgument, "profile: missing field ", where, key);
  }
  return *it;
}

double readNumber(const json& object, const char* key, const std::string& where) {
  const json& v = requireField(object, key, where.c_str());
  if (!v.is_number()) {
    SINEW_THROW(InvalidArgument, "profile: ", where, key, " must be a number, got ",
                detail::jsonPreview(v));
  }
  double d = v.get<double>();
  if (!std::isfinite(d)) {
    SINEW_THROW(InvalidArgument, "profile: ", where, key, " must be finite, got ",
                detail::jsonPreview(v));
  }
  return d;
}

// A non-negative duration in milliseconds, rounded to the nearest nanosecond.
int64_t readMsAsNs(const json& object, const char* key, const std::string& where) {
  double ms = readNumber(object, key, where);
  if (ms < 0 || ms > kMaxMs) {
    SINEW_THROW(InvalidArgument, "profile: ", where, key, " must be in [0, ", kMaxMs, "] ms, got ",
                ms);
  }
  return std::llround(ms * 1e6);
}

int64_t readInteger(const json& object, const char* key, const std::string& where) {
  const json& v = requireField(object, key, where.c_str());
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      SINEW_THROW(InvalidArgument, "profile: ", where, key,
                  " is too large: ", detail::jsonPreview(v));
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    return v.get<int64_t>();
  }
  if (v.is_number_float()) {
    // Accept integral floats such as 1e9, which JSON writers produce for large byte counts.
    double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18) {
      return static_cast<int64_t>(d);
    }
  }
  SINEW_THROW(InvalidArgument, "profile: ", where, key, " must be an integer, got ",
              detail::jsonPreview(v));
}

int64_t readBytes(const json& object, const char* key, const std::string& where) {
  int64_t b = readInteger(object, key, where);
  if (b < 0) {
    SINEW_THROW(InvalidArgument, "profile: ", where, key, " must be >= 0, got ", b);
  }
  return b;
}

void requireObject(const json& v, const std::string& what) {
  if (!v.is_object()) {
    SINEW_THROW(InvalidArgument, "profile: ", what, " must be a JSON object, got ",
                detail::jsonPreview(v));
  }
}

double nsToMs(int64_t ns) { return static_cast<double>(ns) / 1e6; }

}  // namespace

void validateProfile(const Profile& profile) {
  const JobSpec& job = profile.job;
  if (job.devices_per_node < 1 || job.devices_per_node > kMaxDevicesPerNode) {
    SINEW_THROW(InvalidArgument, "profile: job.devices_per_node must be in [1, ",
                kMaxDevicesPerNode, "], got ", job.devices_per_node);
  }
  if (job.device_memory_bytes <= 0) {
    SINEW_THROW(InvalidArgument, "profile: job.device_memory_bytes must be > 0, got ",
                job.device_memory_bytes);
  }
  if (!(std::isfinite(job.inter_stage_gbps) && job.inter_stage_gbps > 0)) {
    SINEW_THROW(InvalidArgument, "profile: job.inter_stage_gbps must be a positive number, got ",
                job.inter_stage_gbps);
  }
  if (!(std::isfinite(job.allreduce.bandwidth_gbps) && job.allreduce.bandwidth_gbps > 0)) {
    SINEW_THROW(InvalidArgument,
                "profile: job.allreduce.bandwidth_gbps must be a positive number, got ",
                job.allreduce.bandwidth_gbps);
  }
  if (!(std::isfinite(job.allreduce.latency_us) && job.allreduce.latency_us >= 0 &&
        job.allreduce.latency_us <= 1e9)) {
    SINEW_THROW(InvalidArgument, "profile: job.allreduce.latency_us must be in [0, 1e9], got ",
                job.allreduce.latency_us);
  }
  if (profile.microbatch_size < 0) {
    SINEW_THROW(InvalidArgument, "profile: microbatch_size must be >= 0, got ",
                profile.microbatch_size);
  }
  if (profile.layers.empty()) {
    SINEW_THROW(InvalidArgument, "profile: layers must not be empty");
  }
  if (profile.layers.size() > (size_t{1} << 20)) {
    SINEW_THROW(InvalidArgument, "profile: at most 2^20 layers, got ", profile.layers.size());
  }
  int64_t total_ns = 0;
  int64_t total_bytes = 0;
  for (size_t i = 0; i < profile.layers.size(); ++i) {
    const LayerCost& l = profile.layers[i];
    const std::pair<const char*, int64_t> fields[] = {{"forward_ns", l.forward_ns},
                                                      {"backward_ns", l.backward_ns},
                                                      {"param_bytes", l.param_bytes},
                                                      {"optimizer_bytes", l.optimizer_bytes},
                                                      {"activation_bytes", l.activation_bytes},
                                                      {"output_bytes", l.output_bytes},
                                                      {"workspace_bytes", l.workspace_bytes}};
    for (const auto& f : fields) {
      if (f.second < 0) {
        SINEW_THROW(InvalidArgument, "profile: layers[", i, "].", f.first, " (layer '", l.name,
                    "') must be >= 0, got ", f.second);
      }
    }
    // Each term is below 2^63 and the running sums are checked before they can overflow.
    for (int64_t ns : {l.forward_ns, l.backward_ns}) {
      if (ns > kMaxTotalNs - total_ns) {
        SINEW_THROW(InvalidArgument, "profile: the layers' forward + backward times exceed 2^46 ns",
                    " at layers[", i, "] ('", l.name, "')");
      }
      total_ns += ns;
    }
    for (int64_t b : {l.param_bytes, l.optimizer_bytes, l.activation_bytes, l.output_bytes,
                      l.workspace_bytes}) {
      if (b > kMaxTotalBytes - total_bytes) {
        SINEW_THROW(InvalidArgument, "profile: the layers' byte counts exceed 2^56 at layers[", i,
                    "] ('", l.name, "')");
      }
      total_bytes += b;
    }
  }
}

Profile parseProfileJson(const std::string& text) {
  if (detail::jsonTooDeep(text)) {
    SINEW_THROW(InvalidArgument, "profile: the document nests JSON deeper than ",
                detail::kMaxJsonDepth, " levels");
  }
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number beyond double (1e400).
    SINEW_THROW(InvalidArgument, "profile: malformed JSON: ", e.what());
  }
  requireObject(root, "the document");
  Profile p;
  if (root.contains("version")) {
    int64_t v = readInteger(root, "version", "");
    if (v != kFormatVersion) {
      SINEW_THROW(InvalidArgument, "profile: unsupported version ", v, " (this reader knows ",
                  kFormatVersion, ")");
    }
  }
  if (root.contains("microbatch_size")) {
    p.microbatch_size = readInteger(root, "microbatch_size", "");
  }

  const json& job = requireField(root, "job", "");
  requireObject(job, "job");
  int64_t g = readInteger(job, "devices_per_node", "job.");
  if (g < 1 || g > kMaxDevicesPerNode) {
    SINEW_THROW(InvalidArgument, "profile: job.devices_per_node must be in [1, ",
                kMaxDevicesPerNode, "], got ", g);
  }
  p.job.devices_per_node = static_cast<int>(g);
  p.job.device_memory_bytes = readInteger(job, "device_memory_bytes", "job.");
  p.job.inter_stage_gbps = readNumber(job, "inter_stage_gbps", "job.");
  const json& ar = requireField(job, "allreduce", "job.");
  requireObject(ar, "job.allreduce");
  if (ar.contains("algorithm")) {
    const json& algo = ar["algorithm"];
    if (!algo.is_string() || algo.get<std::string>() != "ring") {
      SINEW_THROW(InvalidArgument, "profile: job.allreduce.algorithm must be \"ring\", got ",
                  detail::jsonPreview(algo));
    }
  }
  p.job.allreduce.bandwidth_gbps = readNumber(ar, "bandwidth_gbps", "job.allreduce.");
  p.job.allreduce.latency_us = readNumber(ar, "latency_us", "job.allreduce.");

  const json& layers = requireField(root, "layers", "");
  if (!layers.is_array()) {
    SINEW_THROW(InvalidArgument, "profile: layers must be a JSON array, got ",
                detail::jsonPreview(layers));
  }
  p.layers.reserve(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const json& l = layers[i];
    std::string where = "layers[" + std::to_string(i) + "].";
    requireObject(l, "layers[" + std::to_string(i) + "]");
    LayerCost c;
    if (l.contains("name")) {
      if (!l["name"].is_string()) {
        SINEW_THROW(InvalidArgument, "profile: ", where, "name must be a string, got ",
                    detail::jsonPreview(l["name"]));
      }
      c.name = l["name"].get<std::string>();
    } else {
      c.name = "layer" + std::to_string(i);
    }
    c.forward_ns = readMsAsNs(l, "forward_ms", where);
    c.backward_ns = readMsAsNs(l, "backward_ms", where);
    c.param_bytes = readBytes(l, "param_bytes", where);
    c.optimizer_bytes = readBytes(l, "optimizer_bytes", where);
    c.activation_bytes = readBytes(l, "activation_bytes", where);
    c.output_bytes = readBytes(l, "output_bytes", where);
    if (l.contains("workspace_bytes")) c.workspace_bytes = readBytes(l, "workspace_bytes", where);
    p.layers.push_back(std::move(c));
  }
  validateProfile(p);
  return p;
}

Profile loadProfile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    SINEW_THROW(IoError, "cannot open profile ", path);
  }
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) {
    SINEW_THROW(IoError, "cannot read profile ", path);
  }
  return parseProfileJson(os.str());
}

std::string profileToJson(const Profile& profile) {
  json root;
  root["version"] = kFormatVersion;
  if (profile.microbatch_size > 0) {
    root["microbatch_size"] = profile.microbatch_size;
  }
  json job;
  job["devices_per_node"] = profile.job.devices_per_node;
  job["device_memory_bytes"] = profile.job.device_memory_bytes;
  job["inter_stage_gbps"] = profile.job.inter_stage_gbps;
  job["allreduce"] = {{"algorithm", "ring"},
                      {"bandwidth_gbps", profile.job.allreduce.bandwidth_gbps},
                      {"latency_us", profile.job.allreduce.latency_us}};
  root["job"] = job;
  json layers = json::array();
  for (const LayerCost& l : profile.layers) {
    layers.push_back({{"name", l.name},
                      {"forward_ms", nsToMs(l.forward_ns)},
                      {"backward_ms", nsToMs(l.backward_ns)},
                      {"param_bytes", l.param_bytes},
                      {"optimizer_bytes", l.optimizer_bytes},
                      {"activation_bytes", l.activation_bytes},
                      {"output_bytes", l.output_bytes},
                      {"workspace_bytes", l.workspace_bytes}});
  }
  root["layers"] = layers;
  return root.dump(2) + "\n";
}

}  // namespace pipeline
}  // namespace sinew
