#include "sinew/runtime/epoch_communicators.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "sinew/runtime/step_update.h"

namespace sinew {
namespace runtime {

EpochCommunicators::EpochCommunicators(const TrainerServices& services, BackendChooser& chooser)
    : s_(services), chooser_(chooser) {}

void EpochCommunicators::abortBefore(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!world_ || (epoch >= 0 && epoch <= world_->epoch())) return;
  world_->abort();
  for (auto& g : groups_) {
    if (g.comm) g.comm->abort();
  }
  for (auto& t : ties_) {
    if (t.comm) t.comm->abort();
  }
}

void EpochCommunicators::drop() {
  std::lock_guard<std::mutex> lock(mu_);
  executor_.reset();  // It refers to world_.
  if (world_) world_->abort();
  world_.reset();
  for (auto& g : groups_) {
    if (g.comm) g.comm->abort();
  }
  groups_.clear();
  for (auto& t : ties_) {
    if (t.comm) t.comm->abort();
  }
  ties_.clear();
}

void EpochCommunicators::close() {
  std::lock_guard<std::mutex> lock(mu_);
  executor_.reset();
  world_.reset();
  groups_.clear();
  ties_.clear();
}

collectives::CommunicatorOptions EpochCommunicators::options(int64_t epoch,
                                                             std::vector<int> members,
                                                             std::string name) const {
  collectives::CommunicatorOptions co;
  co.members = std::move(members);
  co.self = s_.worker();
  co.epoch = epoch;
  co.name = std::move(name);
  co.timeout = s_.opTimeout();
  co.initTimeout = std::min(s_.options.buildTimeout, s_.recoveryTimeout());
  co.hostname = s_.ctx.host();
  return co;
}

void EpochCommunicators::buildWorld(const std::shared_ptr<collectives::Store>& store, int64_t epoch,
                                    const std::vector<int>& members, const std::string& name,
                                    const collectives::GlooOptions& gloo) {
  auto comm = chooser_.make(store, options(epoch, members, name), gloo);
  std::lock_guard<std::mutex> lock(mu_);
  executor_.reset();
  world_ = std::move(comm);
  if (s_.client.latestEpoch().epoch > epoch) world_->abort();
}

void EpochCommunicators::buildGradGroups(const std::shared_ptr<collectives::Store>& store,
                                         int64_t epoch, const pipeline::Plan& plan, int first,
                                         int end) {
  std::vector<std::vector<int>> holders(plan.numLayers);
  for (const auto& w : plan.workers) {
    for (int l = w.firstLayer; l < w.endLayer; ++l) holders[l].push_back(w.worker);
  }
  for (auto& h : holders) std::sort(h.begin(), h.end());
  for (int l = first; l < end;) {
    int r = l + 1;
    while (r < end && holders[r] == holders[l]) ++r;
    GradGroup g;
    g.first = l;
    g.end = r;
    g.members = holders[l];
    if (g.members.size() > 1) {
      g.comm = chooser_.make(
          store, options(epoch, g.members, "grad-" + std::to_string(l) + "-" + std::to_string(r)));
    }
    std::lock_guard<std::mutex> lock(mu_);
    groups_.push_back(std::move(g));
    if (s_.client.latestEpoch().epoch > epoch && groups_.back().comm) {
      groups_.back().comm->abort();
    }
    l = r;
  }
}

void EpochCommunicators::buildTies(const std::shared_ptr<collectives::Store>& store, int64_t epoch,
                                   const pipeline::Plan& plan, int first, int end,
                                   const std::vector<Tie>& ties) {
  auto holders = [&plan](int layer) {
    std::vector<int> h;
    for (const auto& w : plan.workers) {
      if (layer >= w.firstLayer && layer < w.endLayer) h.push_back(w.worker);
    }
    std::sort(h.begin(), h.end());
    return h;
  };
  for (size_t k = 0; k < ties.size(); ++k) {
    const Tie& t = ties[k];
    auto holds = [&](int layer) { return layer >= first && layer < end; };
    if (!holds(t.ownerLayer) && !holds(t.followerLayer)) continue;
    const std::vector<int> owners = holders(t.ownerLayer), followers = holders(t.followerLayer);
    std::vector<int> members = owners;
    members.insert(members.end(), followers.begin(), followers.end());
    std::sort(members.begin(), members.end());
    members.erase(std::unique(members.begin(), members.end()), members.end());
    TieGroup g;
    g.tie = k;
    g.ownerFirst = owners.front();
    g.followerFirst = followers.front();
    if (members.size() > 1) {
      g.comm = chooser_.make(store, options(epoch, members, "tie-" + std::to_string(k)));
    }
    std::lock_guard<std::mutex> lock(mu_);
    ties_.push_back(std::move(g));
    if (s_.client.latestEpoch().epoch > epoch && ties_.back().comm) ties_.back().comm->abort();
  }
}

void EpochCommunicators::setExecutor(std::unique_ptr<pipeline::StageExecutor> executor) {
  std::lock_guard<std::mutex> lock(mu_);
  executor_ = std::move(executor);
}

double EpochCommunicators::reduceGradients(torch::nn::Sequential& held, int heldFirst,
                                           const std::vector<Tie>& ties, const Around& around) {
  for (auto& g : groups_) {
    std::vector<at::Tensor> ps;
    for (int l = g.first; l < g.end; ++l) {
      for (auto& p : held[l - heldFirst]->parameters()) {
        if (p.requires_grad()) ps.push_back(p);  // Frozen ones are not reduced.
      }
    }
    if (ps.empty() || !g.comm) continue;
    reduceInBuckets(ps, kGradientBucketBytes, [&](at::Tensor& t) {
      around([&] { g.comm->allreduce(t, collectives::ReduceOp::kSum, s_.opTimeout()); });
    });
  }
  reduceTies(held, heldFirst, ties, around);
  const std::unordered_set<const void*> followers = heldFollowers(held, heldFirst, ties);
  double squares = 0;
  for (auto& g : groups_) {
    if (g.members.front() != s_.worker()) continue;
    std::vector<at::Tensor> ps;
    for (int l = g.first; l < g.end; ++l) {
      for (auto& p : held[l - heldFirst]->parameters()) {
        if (p.requires_grad() && followers.count(p.unsafeGetTensorImpl()) == 0) ps.push_back(p);
      }
    }
    squares += squaredGradientNorm(ps);
  }
  return squares;
}

void EpochCommunicators::reduceTies(torch::nn::Sequential& held, int heldFirst,
                                    const std::vector<Tie>& ties, const Around& around) {
  const int self = s_.worker();
  for (auto& g : ties_) {
    const Tie& t = ties[g.tie];
    // This worker's copies of the two parameters (undefined where it holds the layer not).
    at::Tensor owner = heldParameter(held, heldFirst, t.ownerLayer, t.ownerParam);
    at::Tensor follower = heldParameter(held, heldFirst, t.followerLayer, t.followerParam);
    at::Tensor& base = owner.defined() ? owner : follower;   // the side whose gradient sums
    if (!base.requires_grad()) continue;                     // Frozen: neither is stepped.
    at::Tensor& other = owner.defined() ? follower : owner;  // undefined unless both are held
    const bool baseCounts = owner.defined() ? g.ownerFirst == self : g.followerFirst == self;
    const bool otherCounts = owner.defined() ? g.followerFirst == self : false;
    // The sum is made in base's own gradient, in place: no copy of a tensor that may be a
    // model's largest (a GPT's token embedding).
    at::Tensor sum = base.grad();
    if (!sum.defined()) {
      sum = at::zeros_like(base);
      base.mutable_grad() = sum;
    } else if (!baseCounts) {
      sum.zero_();  // Another holder's copy of the same gradient counts.
    }
    if (!sum.is_contiguous()) {
      sum = sum.contiguous();
      base.mutable_grad() = sum;
    }
    if (otherCounts && other.grad().defined()) sum.add_(other.grad());
    if (g.comm) {
      around([&] { g.comm->allreduce(sum, collectives::ReduceOp::kSum, s_.opTimeout()); });
    }
    if (other.defined()) {
      if (other.grad().defined()) {
        other.mutable_grad().copy_(sum);
      } else {
        other.mutable_grad() = sum.clone();
      }
    }
  }
}

}  // namespace runtime
}  // namespace sinew
