#include "sinew/pipeline/template_planner.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "sinew/base/error.h"

// The algorithm and its proof of exactness are in docs/planner.md; the comments here refer to
// its sections. Notation: L layers, G devices per node, d a stage width, S stages (uniform
// templates: (n - 1) * G / d < S <= n * G / d), W the devices of a mixed template, t(i, j) the
// compute ticks of stage [i, j), c(i, j) its fill ticks, M the microbatches.

namespace sinew {
namespace pipeline {
namespace {

constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
// Bound on (L + 1) * (S_max + 1) table entries for one width (16 bytes each).
constexpr int64_t kMaxTableEntries = int64_t{1} << 27;
// Bound on the mixed-width table (8 bytes per entry): 2^23 entries, 64 MiB.
constexpr int64_t kMaxMixedEntries = int64_t{1} << 23;

// A split of the layers into stages: ends[s] is the end layer (exclusive) of stage s.
struct Split {
  bool feasible = false;
  int64_t fill = kInf;        // sum of fill ticks
  int64_t bottleneck = kInf;  // max of compute ticks
  std::vector<int> ends;
};

// Everything the planner does for one stage width d (docs/planner.md, "Algorithm").
class WidthPlanner {
 public:
  WidthPlanner(const CostModel& model, int w, int max_stages)
      : model_(model), w_(w), L_(model.numLayers()), K_(max_stages) {
    fill_prefix_.resize(L_ + 1);
    for (int l = 0; l <= L_; ++l) {
      fill_prefix_[l] = model_.computeTicks(0, l, w_) + model_.allreduceTicks(0, l, w_);
    }
    deque_index_.resize(L_ + 2);
    deque_value_.resize(L_ + 2);
  }

  int maxStages() const { return K_; }

  // Step 1: for every S in [1, K], the least bottleneck T*(S) of a feasible S-stage split, the
  // fill of one split achieving it, and the least fill g_inf(S) of any feasible split.
  void computeBounds() {
    computeBottlenecks();
    computeUnboundedFills();
  }
  int64_t leastBottleneck(int S) const { return least_bottleneck_[S]; }
  int64_t bottleneckSplitFill(int S) const { return bottleneck_split_fill_[S]; }
  int64_t leastFill(int S) const { return least_fill_[S]; }

  // Step 2: the least-fill split into S stages whose compute ticks are all <= T
  // (T = kInf: unbounded), breaking ties towards shorter early stages.
  Split leastFillSplit(int64_t T, int S);

 private:
  int64_t t(int i, int j) const { return model_.computeTicks(i, j, w_); }
  bool fits(int i, int j, int64_t k) const { return model_.fits(i, j, w_, k); }
  // c(i, j) = h_base(j) - fill_prefix_[i], h_base(j) = fill_prefix_[j] + boundary(j).
  int64_t hBase(int j) const { return fill_prefix_[j] + model_.boundaryTicks(j); }

  void computeBottlenecks();
  void computeUnboundedFills();

  // One row of the windowed min-plus recurrence (docs/planner.md, "Least fill under a bound"):
  // for i from i_hi down to i_lo,
  //   f(i, k) = min over j in (i, J(i)] of hBase(j) + prev(j) - fill_prefix_[i],
  // where prev(j) is finite only for j in [j_lo, j_hi] and J(i) is the largest j <= min(jT[i],
  // j_hi) such that stage [i, j) fits at position k. J(i) is non-increasing as i decreases, and
  // stages enter the window from the left, so a monotone deque gives O(1) amortised per i.
  template <typename Prev, typename Store>
  void windowRow(int k, const std::vector<int>& jT, int i_lo, int i_hi, int j_lo, int j_hi,
                 const Prev& prev, const Store& store);

  const CostModel& model_;
  const int w_;
  const int L_;
  const int K_;
  std::vector<int64_t> fill_prefix_;
  std::vector<int64_t> least_bottleneck_;
  std::vector<int64_t> bottleneck_split_fill_;
  std::vector<int64_t> least_fill_;
  // Scratch, reused across calls.
  std::vector<int> deque_index_;
  std::vector<int64_t> deque_value_;
  std::vector<int> jT_, iT_, lo_suf_, lo_pre_, row_lo_, row_hi_;
  std::vector<int64_t> row_offset_;
  std::vector<int64_t> band_f_;
  std::vector<int> band_arg_;
};

template <typename Prev, typename Store>
void WidthPlanner::windowRow(int k, const std::vector<int>& jT, int i_lo, int i_hi, int j_lo,
                             int j_hi, const Prev& prev, const Store& store) {
  if (i_lo > i_hi) return;
  // J for i = i_hi: binary search for the last fitting end (fits is monotone in j).
  int cap = std::min(jT[i_hi], j_hi);
  int lo = i_hi, hi = cap;  // answer in [i_hi, cap]; i_hi means "none"
  while (lo < hi) {
    int mid = lo + (hi - lo + 1) / 2;
    if (fits(i_hi, mid, k)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  int J = lo;
  // Deque over positions [head, tail): indices increase and values strictly decrease from head
  // to tail, so the minimum is at tail - 1. Pushes go to the head.
  int head = L_ + 1, tail = L_ + 1;
  auto push = [&](int j) {
    if (j < j_lo || j > j_hi) return;
    int64_t p = prev(j);
    if (p >= kInf) return;
    int64_t v = hBase(j) + p;
    while (head < tail && deque_value_[head] >= v) ++head;
    --head;
    deque_index_[head] = j;
    deque_value_[head] = v;
  };
  for (int j = J; j > i_hi; --j) push(j);
  for (int i = i_hi;;) {
    while (head < tail && deque_index_[tail - 1] > J) --tail;
    if (head < tail) {
      store(i, deque_value_[tail - 1] - fill_prefix_[i], deque_index_[tail - 1]);
    } else {
      store(i, kInf, -1);
    }
    if (i == i_lo) break;
    --i;
    push(i + 1);
    while (J > i && (J > jT[i] || !fits(i, J, k))) --J;
  }
}

void WidthPlanner::computeBottlenecks() {
  // b(i, k): least bottleneck of a feasible split of [i, L) into k stages, the first at
  // position k (docs/planner.md, "Least bottleneck"). Rows k = 0..K, columns i = 0..L.
  const int64_t cols = L_ + 1;
  std::vector<int64_t> b(static_cast<size_t>((K_ + 1) * cols), kInf);
  std::vector<int32_t> arg(static_cast<size_t>((K_ + 1) * cols), -1);
  b[L_] = 0;  // b(L, 0)
  for (int k = 1; k <= K_; ++k) {
    int64_t* row = &b[k * cols];
    int32_t* row_arg = &arg[k * cols];
    const int64_t* prev = &b[(k - 1) * cols];
    for (int i = L_ - k; i >= 0; --i) {
      if (k == 1) {
        if (fits(i, L_, 1)) {
          row[i] = t(i, L_);
          row_arg[i] = L_;
        }
        continue;
      }
      int64_t best = kInf;
      int best_j = -1;
      for (int j = i + 1; j <= L_ - (k - 1); ++j) {
        if (!fits(i, j, k)) break;
        int64_t tij = t(i, j);
        if (tij >= best) break;  // t(i, j) grows with j: no later j can be strictly better
        int64_t pj = prev[j];
        if (pj >= kInf) continue;
        int64_t v = std::max(tij, pj);
        if (v < best) {
          best = v;
          best_j = j;
        }
      }
      row[i] = best;
      row_arg[i] = best_j;
    }
  }
  least_bottleneck_.assign(K_ + 1, kInf);
  bottleneck_split_fill_.assign(K_ + 1, kInf);
  for (int S = 1; S <= K_; ++S) {
    least_bottleneck_[S] = b[S * cols];
    if (least_bottleneck_[S] >= kInf) continue;
    int64_t fill = 0;
    int i = 0;
    for (int k = S; k >= 1; --k) {
      int j = arg[k * cols + i];
      fill += fill_prefix_[j] - fill_prefix_[i] + model_.boundaryTicks(j);
      i = j;
    }
    bottleneck_split_fill_[S] = fill;
  }
}

void WidthPlanner::computeUnboundedFills() {
  // g_inf(S) = f(0, S) of the least-fill recurrence without a bottleneck bound, for all S at
  // once: row k covers i in [0, L - k].
  std::vector<int> jT(L_ + 1, L_);
  std::vector<int64_t> prev(L_ + 1, kInf), cur(L_ + 1, kInf);
  prev[L_] = 0;
  least_fill_.assign(K_ + 1, kInf);
  for (int k = 1; k <= K_; ++k) {
    std::fill(cur.begin(), cur.end(), kInf);
    windowRow(
        k, jT, 0, L_ - k, k - 1 == 0 ? L_ : 1, k - 1 == 0 ? L_ : L_ - (k - 1),
        [&](int j) { return prev[j]; }, [&](int i, int64_t v, int) { cur[i] = v; });
    least_fill_[k] = cur[0];
    std::swap(prev, cur);
  }
}

Split WidthPlanner::leastFillSplit(int64_t T, int S) {
  Split result;
  if (S < 1 || S > L_) return result;
  // jT[i]: last end j with t(i, j) <= T; iT[i]: first start with t(iT, i) <= T.
  jT_.assign(L_ + 1, L_);
  iT_.assign(L_ + 1, 0);
  if (T < kInf) {
    int j = 0;
    for (int i = 0; i < L_; ++i) {
      j = std::max(j, i);
      while (j < L_ && t(i, j + 1) <= T) ++j;
      if (j == i) return result;  // layer i alone exceeds T
      jT_[i] = j;
    }
    int s = 0;
    for (int i = 1; i <= L_; ++i) {
      while (t(s, i) > T) ++s;
      iT_[i] = s;
    }
  }
  // Fewest stages covering [i, L) and [0, i) with compute <= T (memory ignored): bounds that
  // confine the DP to a band of (i, k) states (docs/planner.md, "Band").
  lo_suf_.assign(L_ + 1, 0);
  for (int i = L_ - 1; i >= 0; --i) lo_suf_[i] = 1 + lo_suf_[jT_[i]];
  lo_pre_.assign(L_ + 1, 0);
  for (int i = 1; i <= L_; ++i) lo_pre_[i] = 1 + lo_pre_[iT_[i]];
  if (lo_suf_[0] > S) return result;
  // Row k holds i in [row_lo_[k], row_hi_[k]]: kl(i) = max(lo_suf(i), S - i) <= k <=
  // kh(i) = min(L - i, S - lo_pre(i)); both bounds are non-increasing in i, so each row is an
  // interval.
  row_lo_.assign(S + 1, L_ + 1);
  row_hi_.assign(S + 1, -1);
  for (int i = 0; i <= L_; ++i) {
    int kl = std::max(lo_suf_[i], S - i);
    int kh = std::min(L_ - i, S - lo_pre_[i]);
    if (i == L_) kl = kh = 0;
    for (int k = std::max(kl, 0); k <= kh; ++k) {
      row_lo_[k] = std::min(row_lo_[k], i);
      row_hi_[k] = std::max(row_hi_[k], i);
    }
  }
  if (row_hi_[S] < 0 || row_lo_[S] != 0) return result;
  row_offset_.assign(S + 2, 0);
  for (int k = 0; k <= S; ++k) {
    int64_t n = row_hi_[k] >= row_lo_[k] ? row_hi_[k] - row_lo_[k] + 1 : 0;
    row_offset_[k + 1] = row_offset_[k] + n;
  }
  band_f_.assign(row_offset_[S + 1], kInf);
  band_arg_.assign(row_offset_[S + 1], -1);
  // Row 0 is the single state i = L.
  band_f_[row_offset_[0] + (L_ - row_lo_[0])] = 0;
  for (int k = 1; k <= S; ++k) {
    const int plo = row_lo_[k - 1], phi = row_hi_[k - 1];
    const int64_t poff = row_offset_[k - 1], off = row_offset_[k];
    const int lo = row_lo_[k];
    int j_hi = std::min(phi, L_ - (k - 1));
    windowRow(
        k, jT_, row_lo_[k], row_hi_[k], plo, j_hi, [&](int j) { return band_f_[poff + (j - plo)]; },
        [&](int i, int64_t v, int j) {
          band_f_[off + (i - lo)] = v;
          band_arg_[off + (i - lo)] = j;
        });
  }
  int64_t total = band_f_[row_offset_[S]];
  if (total >= kInf) return result;
  result.feasible = true;
  result.fill = total;
  result.bottleneck = 0;
  int i = 0;
  for (int k = S; k >= 1; --k) {
    int j = band_arg_[row_offset_[k] + (i - row_lo_[k])];
    result.ends.push_back(j);
    result.bottleneck = std::max(result.bottleneck, t(i, j));
    i = j;
  }
  return result;
}

// The mixed-width search (docs/planner.md, "Mixed widths"): stages of any widths of the chain C
// (CostModel::chainWidths), S stages of total width W on n nodes iff W <= n * G and S >= n.
// V(k, i, W) = least fill of a split of [i, L) into k stages (the first at position k) of total
// width W, every stage's compute <= the bound T and every stage fitting at its position:
//   V(0, L, 0) = 0,  V(k, i, W) = min over c in C, j in (i, J] of fill(i, j, c) + V(k-1, j, W-c).
// One table serves every node count: the best template on n nodes under T is the least
// V(S, 0, W) over S >= n and W <= n * G.
class MixedPlanner {
 public:
  MixedPlanner(const CostModel& model, std::vector<int> chain, int max_stages, int max_devices)
      : model_(model),
        chain_(std::move(chain)),
        L_(model.numLayers()),
        K_(max_stages),
        Wmax_(max_devices),
        cols_(max_devices + 1) {
    state_base_.assign(K_ + 2, 0);
    for (int k = 1; k <= K_; ++k) state_base_[k + 1] = state_base_[k] + (L_ - k + 1);
    const size_t states = state_base_[K_ + 1];
    v_.assign(states * cols_, kInf);
    lo_.assign(states, cols_);
    hi_.assign(states, -1);
    prefix_.assign(static_cast<size_t>(K_ + 1) * cols_, kInf);
    prefix_arg_.assign(static_cast<size_t>(K_ + 1) * cols_, -1);
  }

  // Entries of the table for L layers, K stages and W devices (the caller bounds memory).
  static int64_t tableEntries(int L, int K, int W) {
    int64_t states = 0;
    for (int k = 1; k <= K; ++k) states += L - k + 1;
    return states * (W + 1);
  }

  // Fills the table for the compute bound T (kInf: unbounded): least fill.
  void run(int64_t T) { fillTable</*kBottleneck=*/false>(T); }
  // Fills the table with the least bottleneck (max of stage compute) instead of the least
  // fill, under no bound; pick() then gives the least bottleneck on n nodes.
  void runBottleneck() { fillTable</*kBottleneck=*/true>(kInf); }

 private:
  template <bool kBottleneck>
  void fillTable(int64_t T) {
    const int C = static_cast<int>(chain_.size());
    for (int k = 1; k <= K_; ++k) {
      for (int i = 0; i <= L_ - k; ++i) {
        const size_t st = state(k, i);
        int64_t* v = &v_[st * cols_];
        for (int x = lo_[st]; x <= hi_[st]; ++x) v[x] = kInf;
        int lo = cols_, hi = -1;
        for (int c = 0; c < C; ++c) {
          const int w = chain_[c];
          const int d = model_.widths()[w];
          if (k == 1) {
            if (d > Wmax_ || model_.computeTicks(i, L_, w) > T || !model_.fits(i, L_, w, 1)) {
              continue;
            }
            int64_t val = kBottleneck ? model_.computeTicks(i, L_, w) : model_.fillTicks(i, L_, w);
            if (val < v[d]) {
              v[d] = val;
              lo = std::min(lo, d);
              hi = std::max(hi, d);
            }
            continue;
          }
          for (int j = i + 1; j <= L_ - (k - 1); ++j) {
            if (model_.computeTicks(i, j, w) > T || !model_.fits(i, j, w, k)) break;
            const size_t ps = state(k - 1, j);
            const int plo = lo_[ps];
            const int phi = std::min(hi_[ps], Wmax_ - d);
            if (plo > phi) continue;
            const int64_t* pv = &v_[ps * cols_];
            int64_t* vd = v + d;
            if (kBottleneck) {
              const int64_t t = model_.computeTicks(i, j, w);
              for (int x = plo; x <= phi; ++x) vd[x] = std::min(vd[x], std::max(t, pv[x]));
            } else {
              // Unreached entries hold kInf, and kInf + cost is never below an entry (<= kInf).
              const int64_t cost = model_.fillTicks(i, j, w);
              for (int x = plo; x <= phi; ++x) vd[x] = std::min(vd[x], cost + pv[x]);
            }
            lo = std::min(lo, plo + d);
            hi = std::max(hi, phi + d);
          }
        }
        lo_[st] = lo;
        hi_[st] = hi;
      }
    }
    // For pick(): per stage count S, the least value over at most W devices and where.
    for (int S = 1; S <= std::min(K_, L_); ++S) {
      const size_t st = state(S, 0);
      const int64_t* v = &v_[st * cols_];
      int64_t* pm = &prefix_[static_cast<size_t>(S) * cols_];
      int* pa = &prefix_arg_[static_cast<size_t>(S) * cols_];
      int64_t least = kInf;
      int where = -1;
      for (size_t x = 0; x < cols_; ++x) {
        if (v[x] < least) {
          least = v[x];
          where = static_cast<int>(x);
        }
        pm[x] = least;
        pa[x] = where;
      }
    }
  }

 public:
  struct Pick {
    int64_t fill = kInf;
    int S = 0;
    int W = 0;
  };
  // The least-fill split on n nodes of the last run: fewest stages, then fewest devices, on
  // ties.
  Pick pick(int n) const {
    Pick p;
    const int cap = static_cast<int>(
        std::min<int64_t>(static_cast<int64_t>(n) * model_.devicesPerNode(), Wmax_));
    for (int S = n; S <= std::min(K_, L_); ++S) {
      const size_t at = static_cast<size_t>(S) * cols_ + cap;
      if (prefix_[at] < p.fill) {
        p.fill = prefix_[at];
        p.S = S;
        p.W = prefix_arg_[at];
      }
    }
    return p;
  }

  // The split behind a pick of the last run: stage ends, width indices and its bottleneck.
  // Each stage is the first (width in chain order, then end) whose fill plus the rest's least
  // fill gives the state's value, found again from the table instead of stored.
  Split split(const Pick& p, int64_t T, std::vector<int>* widths) const {
    Split s;
    s.feasible = true;
    s.fill = p.fill;
    s.bottleneck = 0;
    widths->clear();
    int i = 0, x = p.W;
    for (int k = p.S; k >= 1; --k) {
      const int64_t target = v_[state(k, i) * cols_ + x];
      int found_j = -1, found_w = -1;
      for (size_t c = 0; c < chain_.size() && found_j < 0; ++c) {
        const int w = chain_[c];
        const int d = model_.widths()[w];
        if (d > x) continue;
        for (int j = i + 1; j <= L_ - (k - 1); ++j) {
          if (model_.computeTicks(i, j, w) > T || !model_.fits(i, j, w, k)) break;
          if (k == 1 && j != L_) continue;
          const int64_t rest = k == 1 ? (x == d ? 0 : kInf) : v_[state(k - 1, j) * cols_ + x - d];
          if (rest < kInf && model_.fillTicks(i, j, w) + rest == target) {
            found_j = j;
            found_w = w;
            break;
          }
        }
      }
      SINEW_ENFORCE(found_j >= 0, "mixed planner: no split found again at k=", k, " i=", i,
                    " W=", x);
      s.ends.push_back(found_j);
      widths->push_back(found_w);
      s.bottleneck = std::max(s.bottleneck, model_.computeTicks(i, found_j, found_w));
      x -= model_.widths()[found_w];
      i = found_j;
    }
    return s;
  }

 private:
  size_t state(int k, int i) const { return state_base_[k] + i; }

  const CostModel& model_;
  const std::vector<int> chain_;
  const int L_;
  const int K_;
  const int Wmax_;
  const size_t cols_;
  std::vector<size_t> state_base_;  // states of row k: i in [0, L - k]
  std::vector<int64_t> v_;
  std::vector<int> lo_, hi_;     // finite entries of a state lie in W in [lo, hi]
  std::vector<int64_t> prefix_;  // [S][W]: least V(S, 0, W') over W' <= W
  std::vector<int> prefix_arg_;  // the least such W'
};

int64_t mulSat(int64_t a, int64_t b) {
  __int128 p = static_cast<__int128>(a) * b;
  return p >= kInf ? kInf : static_cast<int64_t>(p);
}

// The chain of widths for mixed templates, as indices into model.widths(), largest first: from
// 1, each the smallest divisor of G that is a multiple of the one before (1, 2, 4, 8 for G = 8;
// 1, 2, 6 for G = 6). Chain widths pack like bin sizes that divide each other: a multiset of
// total W fills ceil(W / G) nodes.
std::vector<int> chainWidths(const CostModel& model) {
  const int G = model.devicesPerNode();
  std::vector<int> chain;
  for (int d = 1; d <= G;) {
    chain.insert(chain.begin(), model.widthIndex(d));
    int next = d + 1;
    while (next <= G && (G % next != 0 || next % d != 0)) ++next;
    d = next;
  }
  return chain;
}

// A template from a split and its stages' widths (indices into model.widths()), placed on n
// nodes: stages go to nodes in order while they fit; if that needs more than n nodes they are
// packed largest first (first fit; chain widths fill every node but the last), and while fewer
// than n nodes hold stages, the last-placed stage of the node holding the most moves to an
// empty node. REQUIRES: S >= n and the widths sum to at most n * G.
PipelineTemplate buildTemplate(const CostModel& model, int n, int64_t M, const Split& split,
                               const std::vector<int>& widths) {
  const int G = model.devicesPerNode();
  const int S = static_cast<int>(split.ends.size());
  PipelineTemplate tpl;
  tpl.nodes = n;
  tpl.microbatches = M;
  tpl.fill_ticks = split.fill;
  tpl.bottleneck_ticks = split.bottleneck;
  tpl.stage_devices = model.widths()[widths[0]];
  int first = 0;
  for (int st = 0; st < S; ++st) {
    const int w = widths[st];
    StageAssignment a;
    a.first_layer = first;
    a.end_layer = split.ends[st];
    a.devices = model.widths()[w];
    a.compute_ticks = model.computeTicks(first, a.end_layer, w);
    a.fill_ticks = model.fillTicks(first, a.end_layer, w);
    a.memory_bytes = model.memoryBytes(first, a.end_layer, w, S - st);
    if (a.devices != tpl.stage_devices) tpl.stage_devices = 0;
    tpl.stages.push_back(a);
    first = a.end_layer;
  }
  // Placement: in order first.
  std::vector<int> used;  // devices taken on each node
  for (StageAssignment& a : tpl.stages) {
    if (used.empty() || used.back() + a.devices > G) used.push_back(0);
    a.node = static_cast<int>(used.size()) - 1;
    a.first_device = used.back();
    used.back() += a.devices;
  }
  if (static_cast<int>(used.size()) > n) {
    std::vector<int> order(S);
    for (int st = 0; st < S; ++st) order[st] = st;
    std::stable_sort(order.begin(), order.end(),
                     [&](int x, int y) { return tpl.stages[x].devices > tpl.stages[y].devices; });
    used.clear();
    for (int st : order) {
      StageAssignment& a = tpl.stages[st];
      size_t node = 0;
      while (node < used.size() && used[node] + a.devices > G) ++node;
      if (node == used.size()) used.push_back(0);
      a.node = static_cast<int>(node);
      a.first_device = used[node];
      used[node] += a.devices;
    }
  }
  SINEW_ENFORCE(static_cast<int>(used.size()) <= n, "template for n=", n, " needs ", used.size(),
                " nodes");
  while (static_cast<int>(used.size()) < n) {
    std::vector<int> held(used.size(), 0);
    for (const StageAssignment& a : tpl.stages) held[a.node]++;
    const int from = static_cast<int>(std::max_element(held.begin(), held.end()) - held.begin());
    SINEW_ENFORCE(held[from] >= 2, "template for n=", n, " has fewer stages than nodes");
    StageAssignment* last = nullptr;
    for (StageAssignment& a : tpl.stages) {
      if (a.node == from && (last == nullptr || a.first_device > last->first_device)) last = &a;
    }
    last->node = static_cast<int>(used.size());
    last->first_device = 0;
    used.push_back(last->devices);
  }
  return tpl;
}

}  // namespace

int64_t templateMicrobatches(int64_t global_microbatches, int nodes, int total_nodes) {
  __int128 num = static_cast<__int128>(2) * global_microbatches * nodes + total_nodes;
  int64_t m = static_cast<int64_t>(num / (static_cast<__int128>(2) * total_nodes));
  return std::max<int64_t>(1, m);
}

const PipelineTemplate* TemplateSet::find(int nodes) const {
  auto it = std::lower_bound(templates.begin(), templates.end(), nodes,
                             [](const PipelineTemplate& t, int n) { return t.nodes < n; });
  return it != templates.end() && it->nodes == nodes ? &*it : nullptr;
}

namespace {

// Throws InvalidArgument naming the option out of its range.
void checkTemplateOptions(const TemplateOptions& options) {
  if (options.nodes < 1 || options.nodes > (1 << 20)) {
    SINEW_THROW(InvalidArgument, "planTemplates: nodes must be in [1, 2^20], got ", options.nodes);
  }
  if (options.fault_tolerance < 0 || options.fault_tolerance >= options.nodes) {
    SINEW_THROW(InvalidArgument,
                "planTemplates: fault_tolerance must be in [0, nodes - 1 = ", options.nodes - 1,
                "], got ", options.fault_tolerance);
  }
  if (options.max_nodes < 0 || options.max_nodes > (1 << 20)) {
    SINEW_THROW(InvalidArgument, "planTemplates: max_nodes must be in [0, 2^20], got ",
                options.max_nodes);
  }
  if (options.global_microbatches < 1) {
    SINEW_THROW(InvalidArgument, "planTemplates: global_microbatches must be >= 1, got ",
                options.global_microbatches);
  }
}

// The best template for a node count: its objective, its split and the width of every stage.
struct BestTemplate {
  int64_t objective = kInf;
  Split split;
  std::vector<int> widths;
};

// Steps 1 and 2 (docs/planner.md): one planner per device width, with the bounds of every
// stage count a job of up to `maxNodes` nodes could use, and the exact search over the
// bottleneck for the best uniform-width template on n nodes.
class UniformSearch {
 public:
  UniformSearch(const CostModel& model, int maxNodes) : widths_(model.widths()) {
    const int L = model.numLayers();
    G_ = model.devicesPerNode();
    planners_.reserve(widths_.size());
    for (size_t w = 0; w < widths_.size(); ++w) {
      int64_t most = static_cast<int64_t>(maxNodes) * G_ / widths_[w];
      int K = static_cast<int>(std::min<int64_t>(L, most));
      if (static_cast<int64_t>(L + 1) * (K + 1) > kMaxTableEntries) {
        SINEW_THROW(InvalidArgument, "planTemplates: ", L, " layers x ", K,
                    " stages is beyond the planner's table limit of 2^27 entries");
      }
      planners_.emplace_back(model, static_cast<int>(w), K);
      planners_.back().computeBounds();
    }
  }

  // Whether some uniform-width split fits on exactly n nodes.
  bool feasible(int n) {
    for (size_t w = 0; w < widths_.size(); ++w) {
      auto r = stageRange(n, w);
      for (int S = r.second; S >= r.first; --S) {
        if (planners_[w].leastBottleneck(S) < kInf) return true;
      }
    }
    return false;
  }

  // The best uniform-width template on n nodes for M microbatches (objective kInf: none):
  // for each width, descend over bottleneck bounds (docs/planner.md, "Exact search over the
  // bottleneck").
  BestTemplate best(int n, int64_t M) {
    int64_t top = kInf;
    int best_w = -1;
    int best_S = -1;
    int64_t best_T = kInf;
    // Widths largest first, stage counts most first: on equal cost the earlier candidate stays.
    for (size_t w = 0; w < widths_.size(); ++w) {
      const std::pair<int, int> range = stageRange(n, w);
      for (int S = range.second; S >= range.first; --S) {
        WidthPlanner& p = planners_[w];
        const int64_t t_star = p.leastBottleneck(S);
        if (t_star >= kInf) continue;
        const int64_t g_inf = p.leastFill(S);
        if (g_inf + mulSat(M - 1, t_star) >= top) continue;
        int64_t phi0 = p.bottleneckSplitFill(S) + mulSat(M - 1, t_star);
        if (phi0 < top) {
          top = phi0;
          best_w = static_cast<int>(w);
          best_S = S;
          best_T = t_star;
        }
        if (phi0 == g_inf + mulSat(M - 1, t_star)) continue;  // meets the lower bound
        // Any split with phi < top has bottleneck <= (top - g_inf - 1) / (M - 1).
        int64_t T = M == 1 ? kInf : (top - g_inf - 1) / (M - 1);
        while (T >= t_star) {
          Split s = p.leastFillSplit(T, S);
          if (!s.feasible) break;
          int64_t phi = s.fill + mulSat(M - 1, s.bottleneck);
          if (phi < top) {
            top = phi;
            best_w = static_cast<int>(w);
            best_S = S;
            best_T = T;
          }
          if (s.fill + mulSat(M - 1, t_star) >= top) break;
          T = s.bottleneck - 1;
          if (M > 1) T = std::min(T, (top - g_inf - 1) / (M - 1));
        }
      }
    }
    BestTemplate b;
    if (best_w < 0) return b;
    b.split = planners_[best_w].leastFillSplit(best_T, best_S);
    SINEW_ENFORCE(b.split.feasible && b.split.fill + mulSat(M - 1, b.split.bottleneck) == top,
                  "planner reconstruction disagrees for n=", n);
    b.objective = top;
    b.widths.assign(best_S, best_w);
    return b;
  }

 private:
  // The stage counts that need exactly n nodes at width w: S in ((n - 1) * G / d, n * G / d]
  // (the last node may keep devices idle), capped at the planner's K for that width.
  std::pair<int, int> stageRange(int n, size_t w) const {
    const int64_t per_node = G_ / widths_[w];
    const int64_t lo = static_cast<int64_t>(n - 1) * per_node + 1;
    const int64_t hi =
        std::min<int64_t>(static_cast<int64_t>(n) * per_node, planners_[w].maxStages());
    return {static_cast<int>(std::min<int64_t>(lo, hi + 1)), static_cast<int>(hi)};
  }

  const std::vector<int>& widths_;  // the model's
  int G_ = 1;
  std::vector<WidthPlanner> planners_;
};

// Step 3, mixed widths: one descent over bottleneck bounds shared by every n in
// [n_min, n_min + best.size()), each bound one run of the table (docs/planner.md, "Mixed
// widths"). A mixed template replaces best[n - n_min] only if strictly better. `M(n)` is n's
// microbatch count. REQUIRES: mixed.run(kInf) ran.
void improveWithMixedWidths(MixedPlanner& mixed, int n_min,
                            const std::function<int64_t(int)>& microbatches,
                            std::vector<BestTemplate>& best) {
  struct Search {
    bool active = false;
    int64_t M = 1;
    int64_t t_star = 0;   // least bottleneck of any mixed split on n nodes
    int64_t fill = kInf;  // least fill under the last bound visited
    int64_t next = kInf;  // the next bound n needs
  };
  const int max_n = n_min + static_cast<int>(best.size()) - 1;
  std::vector<Search> search(best.size());
  // The cap on later bounds for a split to beat `objective`, given that every split under
  // them has fill >= x.fill (they are below the last bound): (objective - fill - 1) / (M - 1).
  auto cap = [](const Search& x, int64_t objective) {
    return x.M == 1 ? int64_t{-1}
                    : (objective >= kInf ? kInf : (objective - x.fill - 1) / (x.M - 1));
  };
  auto stillUseful = [&](Search& x, int64_t objective) {
    x.next = std::min(x.next, cap(x, objective));
    x.active = x.next >= x.t_star && x.fill + mulSat(x.M - 1, x.t_star) < objective;
  };
  auto consider = [&](int n, int64_t T) {
    Search& x = search[n - n_min];
    BestTemplate& b = best[n - n_min];
    MixedPlanner::Pick pk = mixed.pick(n);
    if (pk.fill >= kInf) {
      x.active = false;  // no split under T, so none under a smaller bound either
      return;
    }
    std::vector<int> ws;
    Split s = mixed.split(pk, T, &ws);
    const int64_t bottleneck = s.bottleneck;
    const int64_t phi = s.fill + mulSat(x.M - 1, bottleneck);
    x.fill = pk.fill;
    if (phi < b.objective) {
      b.objective = phi;
      b.split = std::move(s);
      b.widths = std::move(ws);
    }
    // The least-fill split under T is also one under n's own next bound if its bottleneck is
    // within it (its fill is the least under any bound between), so it answers that bound.
    if (bottleneck <= x.next) x.next = bottleneck - 1;
    stillUseful(x, b.objective);
  };
  for (int n = n_min; n <= max_n; ++n) {
    search[n - n_min].M = microbatches(n);
    consider(n, kInf);
  }
  mixed.runBottleneck();
  for (int n = n_min; n <= max_n; ++n) {
    Search& x = search[n - n_min];
    if (!x.active) continue;
    x.t_star = mixed.pick(n).fill;
    stillUseful(x, best[n - n_min].objective);
  }
  for (;;) {
    int64_t T = -1;
    for (const Search& x : search) {
      if (x.active) T = std::max(T, x.next);
    }
    if (T < 0) break;
    mixed.run(T);
    for (int n = n_min; n <= max_n; ++n) {
      if (search[n - n_min].active) consider(n, T);
    }
  }
}

}  // namespace

TemplateSet planTemplates(const Profile& profile, const TemplateOptions& options) {
  checkTemplateOptions(options);
  CostModel model(profile);
  if (static_cast<__int128>(options.global_microbatches + 1) * model.maxPipelineFillTicks() >=
      (static_cast<__int128>(1) << 62)) {
    SINEW_THROW(InvalidArgument, "planTemplates: global_microbatches=", options.global_microbatches,
                " times a pipeline's fill time (", model.maxPipelineFillTicks(),
                " ticks) overflows 62 bits");
  }
  const int L = model.numLayers();
  const int G = model.devicesPerNode();
  const int N = options.nodes;
  const int f = options.fault_tolerance;
  // The mixed-width search (docs/planner.md, "Mixed widths") runs when the chain has more than
  // one width and its table for up to n nodes fits kMaxMixedEntries.
  const std::vector<int> chain = chainWidths(model);
  auto mixedK = [&](int n) {
    return static_cast<int>(std::min<int64_t>(L, static_cast<int64_t>(n - f) * G));
  };
  auto mixedW = [&](int n) {
    return static_cast<int>(
        std::min<int64_t>(static_cast<int64_t>(mixedK(n)) * G, static_cast<int64_t>(n - f) * G));
  };
  auto mixedFits = [&](int n) {
    return chain.size() > 1 &&
           MixedPlanner::tableEntries(L, mixedK(n), mixedW(n)) <= kMaxMixedEntries;
  };
  // The nodes the job may grow to by joins. Growth never turns the mixed search off for the
  // starting nodes' templates: it stops where that search's table would not fit.
  int N_grown = std::max(N, options.max_nodes);
  if (mixedFits(N)) {
    while (N_grown > N && !mixedFits(N_grown)) --N_grown;
  }

  // Step 1 (docs/planner.md): bounds for every width and every stage count the job could use.
  UniformSearch uniform(model, N_grown - f);
  std::unique_ptr<MixedPlanner> mixed;
  if (mixedFits(N_grown)) {
    mixed = std::make_unique<MixedPlanner>(model, chain, mixedK(N_grown), mixedW(N_grown));
    mixed->run(kInf);
  }

  TemplateSet set;
  set.devices_per_node = G;
  set.num_layers = L;
  set.mixed_widths = mixed != nullptr;
  int n_min = 0;
  for (int n = 1; n <= std::min(N - f, L); ++n) {
    if (uniform.feasible(n) || (mixed && mixed->pick(n).fill < kInf)) {
      n_min = n;
      break;
    }
  }
  if (n_min == 0) {
    SINEW_THROW(InvalidArgument, "planTemplates: the model (", L,
                " layers) fits no pipeline of up to nodes - fault_tolerance = ", N - f,
                " nodes with device_memory_bytes=", model.deviceMemoryBytes(),
                " and devices_per_node=", G);
  }
  if (static_cast<int64_t>(f + 1) * n_min > N) {
    SINEW_THROW(InvalidArgument, "planTemplates: fault_tolerance=", f,
                " needs (f + 1) * n_min = ", static_cast<int64_t>(f + 1) * n_min,
                " nodes (n_min = ", n_min, ") but nodes=", N);
  }
  set.min_nodes = n_min;
  set.max_nodes = std::min(N_grown - f * n_min, L);
  auto microbatches = [&](int n) {
    return templateMicrobatches(options.global_microbatches, n, N);
  };
  // Step 2, uniform widths; step 3, mixed widths where they are better.
  std::vector<BestTemplate> best;
  best.reserve(set.max_nodes - n_min + 1);
  for (int n = n_min; n <= set.max_nodes; ++n) best.push_back(uniform.best(n, microbatches(n)));
  if (mixed) improveWithMixedWidths(*mixed, n_min, microbatches, best);

  for (int n = n_min; n <= set.max_nodes; ++n) {
    const BestTemplate& b = best[n - n_min];
    if (b.objective >= kInf) continue;  // no feasible template on n nodes
    set.templates.push_back(buildTemplate(model, n, microbatches(n), b.split, b.widths));
  }
  return set;
}

}  // namespace pipeline
}  // namespace sinew

namespace sinew {
namespace pipeline {

std::string explainNoTemplate(const Profile& profile, const TemplateSet& set,
                              const TemplateOptions& options, int n) {
  if (set.find(n) != nullptr) return "";
  const CostModel model(profile);
  const int L = model.numLayers();
  const int G = model.devicesPerNode();
  std::ostringstream why;
  if (n < 1) {
    why << "a pipeline needs at least one node";
    return why.str();
  }
  if (n > L) {
    why << n << " nodes would need at least " << n << " stages, but the model has only " << L
        << " layers";
    return why.str();
  }
  if (n > set.max_nodes && n >= set.min_nodes) {
    why << "above n_max = nodes - f * n_min = " << std::max(options.nodes, options.max_nodes)
        << " - " << options.fault_tolerance << " * " << set.min_nodes << " = " << set.max_nodes
        << ": the other " << options.fault_tolerance << " pipeline(s) need " << set.min_nodes
        << " nodes each";
    return why.str();
  }
  // Parameters and optimizer state are not split by a stage's width: the fewest stages any
  // split needs is the greedy count with the loosest memory (one microbatch in flight, activations
  // over G devices).
  int stages = 0;
  for (int i = 0; i < L;) {
    int j = i;
    while (j < L && model.fits(i, j + 1, 0, 1)) ++j;
    if (j == i) {
      why << "layer " << i << " ('" << profile.layers[i].name << "') alone needs "
          << model.memoryBytes(i, i + 1, 0, 1)
          << " bytes per device, more than device_memory_bytes=" << model.deviceMemoryBytes();
      return why.str();
    }
    ++stages;
    i = j;
  }
  if (stages > static_cast<int64_t>(n) * G) {
    why << "the model needs at least " << stages << " stages (parameters and optimizer state of "
        << "its layers fill " << stages
        << " devices of device_memory_bytes=" << model.deviceMemoryBytes() << "), and " << n
        << " nodes of " << G << " devices hold at most " << static_cast<int64_t>(n) * G;
    return why.str();
  }
  why << "no split into at most " << static_cast<int64_t>(n) * G
      << " stages fits device_memory_bytes=" << model.deviceMemoryBytes()
      << " once the first stages keep their 1F1B in-flight microbatches' activations";
  if (!set.mixed_widths && G > 1)
    why << " (among uniform-width templates; mixed widths not searched)";
  return why.str();
}

}  // namespace pipeline
}  // namespace sinew
