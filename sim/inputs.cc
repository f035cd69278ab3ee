// The simulator's inputs: traces (from a file or a failure rate), throughput tables and
// Sinew's measured costs (sim/simulator.h).

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/sim/cluster.h"
#include "sinew/sim/simulator.h"

namespace sinew {
namespace sim {

using nlohmann::json;

std::vector<TraceEvent> parseTrace(const std::string& text, const std::string& source) {
  std::vector<TraceEvent> events;
  std::set<std::string> present;
  std::istringstream in(text);
  std::string line;
  int64_t lineNo = 0;
  while (std::getline(in, line)) {
    ++lineNo;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    const std::string where = source + " line " + std::to_string(lineNo);
    const size_t a = line.find(',');
    const size_t b = a == std::string::npos ? a : line.find(',', a + 1);
    if (b == std::string::npos || line.find(',', b + 1) != std::string::npos) {
      SINEW_THROW(InvalidArgument, where, ": expected time_ms,add|remove,node, got '",
                  line.substr(0, 200), "'");
    }
    TraceEvent e;
    e.time_ms = detail::parseInt(line.substr(0, a), where + " time_ms", 0,
                                 std::numeric_limits<int64_t>::max() / 2);
    const std::string kind = line.substr(a + 1, b - a - 1);
    if (kind != "add" && kind != "remove") {
      SINEW_THROW(InvalidArgument, where, ": the event must be add or remove, got '",
                  kind.substr(0, 200), "'");
    }
    e.add = kind == "add";
    e.node = line.substr(b + 1);
    if (e.node.empty()) SINEW_THROW(InvalidArgument, where, ": the node name is empty");
    if (!events.empty() && e.time_ms < events.back().time_ms) {
      SINEW_THROW(InvalidArgument, where, ": time ", e.time_ms, " ms is before the previous ",
                  events.back().time_ms, " ms (a trace is sorted by time)");
    }
    if (e.add && !present.insert(e.node).second) {
      SINEW_THROW(InvalidArgument, where, ": node ", e.node.substr(0, 200),
                  " is added but is already there");
    }
    if (!e.add && present.erase(e.node) == 0) {
      SINEW_THROW(InvalidArgument, where, ": node ", e.node.substr(0, 200),
                  " is removed but is not there");
    }
    events.push_back(std::move(e));
  }
  if (events.empty()) SINEW_THROW(InvalidArgument, source, ": the trace has no events");
  return events;
}

std::vector<TraceEvent> loadTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) SINEW_THROW(IoError, "cannot read the trace ", path);
  std::ostringstream text;
  text << in.rdbuf();
  return parseTrace(text.str(), path);
}

namespace {

// splitmix64: a fixed generator, so a seed gives the same trace with any standard library.
struct SplitMix {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Exponential with mean `mean`: -mean * ln(u), u uniform in (0, 1].
  double exponential(double mean) {
    const double u = (static_cast<double>(next() >> 11) + 1.0) / 9007199254740992.0;
    return -mean * std::log(u);
  }
};

}  // namespace

std::vector<TraceEvent> poissonTrace(const PoissonTraceOptions& o) {
  if (o.nodes < 1 || o.nodes > (1 << 20)) {
    SINEW_THROW(InvalidArgument, "poissonTrace: nodes = ", o.nodes, " must be in [1, 2^20]");
  }
  if (!(o.mtbf_s > 0) || !std::isfinite(o.mtbf_s)) {
    SINEW_THROW(InvalidArgument, "poissonTrace: mtbf_s = ", o.mtbf_s, " must be positive");
  }
  if (!(o.return_after_s >= 0) || !std::isfinite(o.return_after_s)) {
    SINEW_THROW(InvalidArgument, "poissonTrace: return_after_s = ", o.return_after_s,
                " must be >= 0");
  }
  if (!(o.duration_s > 0) || o.duration_s > 1e9) {
    SINEW_THROW(InvalidArgument, "poissonTrace: duration_s = ", o.duration_s,
                " must be in (0, 1e9]");
  }
  struct Timed {
    int64_t ms;
    int order;  // removes before adds at one time, then by node
    int node;
    bool add;
  };
  std::vector<Timed> all;
  SplitMix rng{o.seed};
  const int64_t endMs = static_cast<int64_t>(o.duration_s * 1e3);
  for (int n = 0; n < o.nodes; ++n) {
    all.push_back({0, 1, n, true});
    double t = 0;
    while (true) {
      t += o.mtbf_s > 0 ? rng.exponential(o.mtbf_s) : 0;
      const int64_t down = static_cast<int64_t>(t * 1e3);
      if (down >= endMs || down <= 0) break;
      all.push_back({down, 0, n, false});
      if (o.return_after_s <= 0) break;
      t += o.return_after_s;
      const int64_t up = static_cast<int64_t>(t * 1e3);
      if (up >= endMs) break;
      all.push_back({up, 1, n, true});
    }
  }
  std::sort(all.begin(), all.end(), [](const Timed& a, const Timed& b) {
    return std::tie(a.ms, a.order, a.node) < std::tie(b.ms, b.order, b.node);
  });
  std::vector<TraceEvent> events;
  events.reserve(all.size());
  for (const Timed& e : all) {
    events.push_back({e.ms, e.add, "node" + std::to_string(e.node + 1)});
  }
  return events;
}

int ThroughputTable::usedNodes(int n) const {
  auto it = samples_per_s.upper_bound(n);
  if (it == samples_per_s.begin()) return 0;
  return std::prev(it)->first;
}

double ThroughputTable::at(int n) const {
  const int used = usedNodes(n);
  return used > 0 ? samples_per_s.at(used) : 0;
}

namespace {

json parseObject(const std::string& text, const std::string& what) {
  json j = detail::parseJson(text, what);
  if (!j.is_object()) SINEW_THROW(InvalidArgument, what, ": must be a JSON object");
  return j;
}

double positiveNumber(const json& v, const std::string& what, bool zeroAllowed) {
  if (!v.is_number()) {
    SINEW_THROW(InvalidArgument, what, " must be a number, got ", detail::jsonPreview(v));
  }
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < 0 || (x == 0 && !zeroAllowed) || x > 1e15) {
    SINEW_THROW(InvalidArgument, what, " must be ", zeroAllowed ? ">= 0" : "> 0",
                " and finite, got ", x);
  }
  return x;
}

// An object of node count -> samples/s; each entry's error names `what`["<count>"].
std::map<int, double> ratesByNodeCount(const json& object, const std::string& what) {
  std::map<int, double> rates;
  for (auto e = object.begin(); e != object.end(); ++e) {
    const std::string at = what + "[\"" + e.key().substr(0, 40) + "\"]";
    const int64_t n = detail::parseInt(e.key(), at + " node count", 1, 1 << 20);
    rates[static_cast<int>(n)] = positiveNumber(e.value(), at, false);
  }
  return rates;
}

}  // namespace

ThroughputTable parseThroughputTable(const std::string& text, const std::string& source) {
  const json j = parseObject(text, source);
  auto it = j.find("samples_per_s");
  if (it == j.end() || !it->is_object() || it->empty()) {
    SINEW_THROW(InvalidArgument, source,
                ": samples_per_s must be a non-empty object of node count -> samples/s");
  }
  ThroughputTable t;
  t.samples_per_s = ratesByNodeCount(*it, source + " samples_per_s");
  return t;
}

SinewCosts parseSinewCosts(const std::string& text, const std::string& source) {
  const json j = parseObject(text, source);
  SinewCosts c;
  for (auto e = j.begin(); e != j.end(); ++e) {
    const std::string& k = e.key();
    const std::string what = source + " " + k.substr(0, 60);
    auto integer = [&](int64_t min) {
      return detail::jsonInt(e.value(), what, min, int64_t{1} << 40);
    };
    if (k == "detection_s") {
      c.detection_s = positiveNumber(e.value(), what, true);
    } else if (k == "epoch_s") {
      c.epoch_s = positiveNumber(e.value(), what, true);
    } else if (k == "copy_gbps") {
      c.copy_gbps = positiveNumber(e.value(), what, false);
    } else if (k == "ram_restore_s") {
      c.ram_restore_s = positiveNumber(e.value(), what, true);
    } else if (k == "disk_restore_s") {
      c.disk_restore_s = positiveNumber(e.value(), what, true);
    } else if (k == "restart_s") {
      c.restart_s = positiveNumber(e.value(), what, true);
    } else if (k == "peer_every") {
      c.peer_every = integer(0);
    } else if (k == "durable_every") {
      c.durable_every = integer(0);
    } else if (k == "replication") {
      c.replication = static_cast<int>(detail::jsonInt(e.value(), what, 1, 64));
    } else if (k.rfind("_", 0) != 0) {  // "_source" and other notes are for people
      SINEW_THROW(InvalidArgument, source, ": unknown field '", k.substr(0, 60), "'");
    }
  }
  return c;
}

}  // namespace sim
}  // namespace sinew

namespace sinew {
namespace sim {

namespace {

ClusterJob parseClusterJob(const json& e, const std::string& where) {
  if (!e.is_object()) SINEW_THROW(InvalidArgument, where, " must be an object");
  ClusterJob c;
  bool maxGiven = false;
  for (auto f = e.begin(); f != e.end(); ++f) {
    const std::string& k = f.key();
    const std::string what = where + " " + k.substr(0, 60);
    const json& v = f.value();
    if (k == "name") {
      if (!v.is_string() || v.get<std::string>().empty()) {
        SINEW_THROW(InvalidArgument, what, " must be a non-empty string");
      }
      c.name = v.get<std::string>().substr(0, 200);
    } else if (k == "arrival_s") {
      c.arrival_s = positiveNumber(v, what, true);
    } else if (k == "steps") {
      c.steps = detail::jsonInt(v, what, 1, int64_t{1} << 40);
    } else if (k == "global_batch") {
      c.global_batch = detail::jsonInt(v, what, 1, int64_t{1} << 40);
    } else if (k == "min_nodes") {
      c.min_nodes = static_cast<int>(detail::jsonInt(v, what, 1, 1 << 20));
    } else if (k == "max_nodes") {
      c.max_nodes = static_cast<int>(detail::jsonInt(v, what, 1, 1 << 20));
      maxGiven = true;
    } else if (k == "compute_s_per_sample") {
      c.compute_s_per_sample = positiveNumber(v, what, true);
    } else if (k == "fixed_s") {
      c.fixed_s = positiveNumber(v, what, true);
    } else if (k == "samples_per_s") {
      if (!v.is_object()) {
        SINEW_THROW(InvalidArgument, what, " must be an object of node count -> samples/s");
      }
      c.samples_per_s = ratesByNodeCount(v, what);
    } else if (k.rfind("_", 0) != 0) {
      SINEW_THROW(InvalidArgument, where, ": unknown field '", k.substr(0, 60), "'");
    }
  }
  if (c.name.empty()) SINEW_THROW(InvalidArgument, where, ": needs a name");
  if (!maxGiven) c.max_nodes = c.min_nodes;  // as sinew-sched's max_workers
  return c;
}

}  // namespace

ClusterInput parseClusterInput(const std::string& text, const std::string& source) {
  const json j = parseObject(text, source);
  ClusterInput in;
  for (auto e = j.begin(); e != j.end(); ++e) {
    const std::string& k = e.key();
    if (k == "jobs") {
      if (!e.value().is_array() || e.value().empty()) {
        SINEW_THROW(InvalidArgument, source, ": jobs must be a non-empty array");
      }
      for (const json& job : e.value()) {
        in.jobs.push_back(parseClusterJob(job, source + " job " + std::to_string(in.jobs.size())));
      }
    } else if (k == "costs") {
      if (!e.value().is_object()) SINEW_THROW(InvalidArgument, source, ": costs must be an object");
      for (auto c = e.value().begin(); c != e.value().end(); ++c) {
        const std::string what = source + " costs " + c.key().substr(0, 60);
        if (c.key() == "grow_pause_s") {
          in.costs.grow_pause_s = positiveNumber(c.value(), what, true);
        } else if (c.key() == "shrink_pause_s") {
          in.costs.shrink_pause_s = positiveNumber(c.value(), what, true);
        } else if (c.key() == "start_s") {
          in.costs.start_s = positiveNumber(c.value(), what, true);
        } else if (c.key().rfind("_", 0) != 0) {
          SINEW_THROW(InvalidArgument, source, ": unknown field 'costs.", c.key().substr(0, 60),
                      "'");
        }
      }
    } else if (k.rfind("_", 0) != 0) {
      SINEW_THROW(InvalidArgument, source, ": unknown field '", k.substr(0, 60), "'");
    }
  }
  if (in.jobs.empty()) SINEW_THROW(InvalidArgument, source, ": needs jobs");
  return in;
}

}  // namespace sim
}  // namespace sinew
