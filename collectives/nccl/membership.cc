#include "sinew/collectives/nccl/membership.h"

#include <algorithm>
#include <optional>
#include <sstream>

#include "sinew/base/parse.h"

namespace sinew {
namespace collectives {
namespace nccl_membership {
namespace {

struct Announcement {
  int64_t epoch = -1;
  std::string members;  // as announced
  bool healthy = false;
};

std::optional<Announcement> parse(const std::string& a) {
  std::istringstream is(a);
  Announcement out;
  std::string epoch, healthy, rest;
  if (!(is >> epoch >> out.members >> healthy) || (is >> rest)) return std::nullopt;
  const auto e = ::sinew::detail::tryParseInt(epoch);
  if (!e || (healthy != "0" && healthy != "1")) return std::nullopt;
  out.epoch = *e;
  out.healthy = healthy == "1";
  return out;
}

std::optional<std::vector<int>> parseMembers(const std::string& list) {
  std::vector<int> out;
  std::istringstream ls(list);
  for (std::string w; std::getline(ls, w, ',');) {
    const auto v = ::sinew::detail::tryParseInt(w);
    if (!v) return std::nullopt;
    out.push_back(static_cast<int>(*v));
  }
  return out;
}

}  // namespace

const char* setUpName(SetUp s) {
  switch (s) {
    case SetUp::kInit:
      return "init";
    case SetUp::kShrink:
      return "shrink";
    case SetUp::kShrinkAbort:
      return "shrink (abort)";
    case SetUp::kGrow:
      return "grow";
  }
  return "?";
}

std::string announce(bool holds, int64_t epoch, const std::vector<int>& members, bool healthy) {
  if (!holds) return "none";
  std::ostringstream os;
  os << epoch << " ";
  for (size_t i = 0; i < members.size(); ++i) os << (i ? "," : "") << members[i];
  os << " " << (healthy ? 1 : 0);
  return os.str();
}

SetUp decide(const std::vector<std::string>& said, const std::vector<int>& now, int64_t epoch,
             bool canShrink, bool canGrow) {
  std::optional<Announcement> common;
  int holders = 0;
  bool allHealthy = true;
  for (const std::string& a : said) {
    if (a == "none") continue;
    const std::optional<Announcement> p = parse(a);
    if (!p) return SetUp::kInit;
    if (common && (p->epoch != common->epoch || p->members != common->members)) {
      return SetUp::kInit;
    }
    common = p;
    ++holders;
    allHealthy = allHealthy && p->healthy;
  }
  if (holders == 0 || common->epoch >= epoch) return SetUp::kInit;
  const std::optional<std::vector<int>> old = parseMembers(common->members);
  if (!old) return SetUp::kInit;
  if (canShrink && holders == static_cast<int>(said.size()) && now.size() < old->size()) {
    size_t i = 0;
    for (int w : *old) {
      if (i < now.size() && now[i] == w) ++i;
    }
    if (i == now.size()) return allHealthy ? SetUp::kShrink : SetUp::kShrinkAbort;
  }
  if (canGrow && allHealthy && holders == static_cast<int>(old->size()) &&
      now.size() > old->size() && std::equal(old->begin(), old->end(), now.begin())) {
    for (size_t r = old->size(); r < now.size() && r < said.size(); ++r) {
      if (said[r] != "none") return SetUp::kInit;
    }
    return SetUp::kGrow;
  }
  return SetUp::kInit;
}

}  // namespace nccl_membership
}  // namespace collectives
}  // namespace sinew
