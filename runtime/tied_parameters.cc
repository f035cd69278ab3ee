#include "sinew/runtime/tied_parameters.h"

#include <ATen/ATen.h>

#include <map>

#include "sinew/base/error.h"
#include "sinew/base/mix.h"
#include "sinew/runtime/step_update.h"

namespace sinew {
namespace runtime {

namespace {

// `name` split into the longest layer name of `spec` that prefixes it and the rest after its
// dot; `what` names the tie's side for errors.
std::pair<int, std::string> splitName(const ModelSpec& spec, const std::string& name,
                                      const std::string& what) {
  int best = -1;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const std::string& l = spec.layers[i].name;
    if (name.size() > l.size() + 1 && name.compare(0, l.size(), l) == 0 && name[l.size()] == '.' &&
        (best < 0 || l.size() > spec.layers[best].name.size())) {
      best = static_cast<int>(i);
    }
  }
  if (best < 0) {
    SINEW_THROW(InvalidArgument, what, " = '", name,
                "' names no parameter of a layer of the model: it must be '<layer>.<parameter>' "
                "with <layer> one of ModelSpec::layers' names");
  }
  return {best, name.substr(spec.layers[best].name.size() + 1)};
}

}  // namespace

std::vector<Tie> resolveTies(const ModelSpec& spec) {
  std::vector<Tie> ties;
  std::map<std::string, size_t> followers;  // name -> tie index
  for (size_t k = 0; k < spec.tied.size(); ++k) {
    const TiedParameters& t = spec.tied[k];
    const std::string where = "ModelSpec::tied[" + std::to_string(k) + "]";
    Tie tie;
    std::tie(tie.ownerLayer, tie.ownerParam) = splitName(spec, t.owner, where + ".owner");
    std::tie(tie.followerLayer, tie.followerParam) =
        splitName(spec, t.follower, where + ".follower");
    if (t.owner == t.follower) {
      SINEW_THROW(InvalidArgument, where, " ties '", t.owner, "' to itself");
    }
    if (!followers.emplace(t.follower, k).second) {
      SINEW_THROW(InvalidArgument, where, ".follower = '", t.follower,
                  "' is already the follower of ModelSpec::tied[", followers[t.follower], "]");
    }
    ties.push_back(std::move(tie));
  }
  for (size_t k = 0; k < spec.tied.size(); ++k) {
    auto it = followers.find(spec.tied[k].owner);
    if (it != followers.end()) {
      SINEW_THROW(InvalidArgument, "ModelSpec::tied[", k, "].owner = '", spec.tied[k].owner,
                  "' is the follower of ModelSpec::tied[", it->second,
                  "]: tie every follower to the first owner instead");
    }
  }
  return ties;
}

at::Tensor tiedParameter(const torch::nn::Module& layer, const std::string& name, int index,
                         const std::string& layerName) {
  for (const auto& p : layer.named_parameters(/*recurse=*/true)) {
    if (p.key() == name) return p.value();
  }
  SINEW_THROW(InvalidArgument, "ModelSpec::tied names '", layerName, ".", name, "', but layer ",
              index, " ('", layerName, "') has no parameter '", name, "'");
}

torch::nn::Sequential buildUntiedLayers(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype,
                                        int first, int end) {
  torch::nn::Sequential seq;
  for (int i = first; i < end; ++i) {
    const auto& l = spec.layers[i];
    // Each layer from its own seed: the same parameters whichever layers a worker builds.
    at::manual_seed(
        detail::splitmix64(seed ^ detail::splitmix64(0x1A7E5u + static_cast<uint64_t>(i))));
    seq->push_back(l.name, l.build());
  }
  seq->to(dtype);
  return seq;
}

void copyOwnersIntoFollowers(const ModelSpec& spec, const std::vector<Tie>& ties, uint64_t seed,
                             at::ScalarType dtype, int first, int end,
                             torch::nn::Sequential& layers) {
  for (const Tie& t : ties) {
    if (t.followerLayer < first || t.followerLayer >= end) continue;
    const std::string& ownerName = spec.layers[t.ownerLayer].name;
    const std::string& followerName = spec.layers[t.followerLayer].name;
    torch::nn::Sequential ownerHolder =
        t.ownerLayer >= first && t.ownerLayer < end
            ? layers
            : buildUntiedLayers(spec, seed, dtype, t.ownerLayer, t.ownerLayer + 1);
    const int ownerIndex = t.ownerLayer >= first && t.ownerLayer < end ? t.ownerLayer - first : 0;
    at::Tensor owner =
        tiedParameter(*ownerHolder[ownerIndex], t.ownerParam, t.ownerLayer, ownerName);
    at::Tensor follower = tiedParameter(*layers[t.followerLayer - first], t.followerParam,
                                        t.followerLayer, followerName);
    if (owner.sizes() != follower.sizes() || owner.scalar_type() != follower.scalar_type() ||
        owner.requires_grad() != follower.requires_grad()) {
      SINEW_THROW(InvalidArgument, "ModelSpec::tied ties '", ownerName, ".", t.ownerParam,
                  "' (shape ", owner.sizes(), ", ", owner.scalar_type(),
                  owner.requires_grad() ? ", trainable" : ", frozen", ") to '", followerName, ".",
                  t.followerParam, "' (shape ", follower.sizes(), ", ", follower.scalar_type(),
                  follower.requires_grad() ? ", trainable" : ", frozen",
                  "): tied parameters must agree");
    }
    at::NoGradGuard noGrad;
    follower.copy_(owner);
  }
}

at::Tensor heldParameter(const torch::nn::Sequential& held, int heldFirst, int layer,
                         const std::string& name) {
  const int i = layer - heldFirst;
  if (i < 0 || i >= static_cast<int>(held->size())) return at::Tensor();
  return tiedParameter(*held->ptr(i), name, layer, held->named_children()[i].key());
}

void sumTiedGradients(const torch::nn::Sequential& model, const std::vector<Tie>& ties) {
  for (const Tie& t : ties) {
    at::Tensor owner = heldParameter(model, 0, t.ownerLayer, t.ownerParam);
    at::Tensor follower = heldParameter(model, 0, t.followerLayer, t.followerParam);
    if (!owner.requires_grad()) continue;  // Frozen: neither is stepped.
    // In the owner's gradient, in place: no copy of what may be the model's largest tensor.
    if (!owner.grad().defined()) owner.mutable_grad() = at::zeros_like(owner);
    at::Tensor sum = owner.grad();
    if (follower.grad().defined()) sum.add_(follower.grad());
    if (follower.grad().defined()) {
      follower.mutable_grad().copy_(sum);
    } else {
      follower.mutable_grad() = sum.clone();
    }
  }
}

std::unordered_set<const void*> heldFollowers(const torch::nn::Sequential& held, int heldFirst,
                                              const std::vector<Tie>& ties) {
  std::unordered_set<const void*> out;
  for (const Tie& t : ties) {
    at::Tensor follower = heldParameter(held, heldFirst, t.followerLayer, t.followerParam);
    if (follower.defined()) out.insert(follower.unsafeGetTensorImpl());
  }
  return out;
}

double squaredNormCountingTiesOnce(const torch::nn::Sequential& held, int heldFirst,
                                   const std::vector<Tie>& ties) {
  const std::unordered_set<const void*> followers = heldFollowers(held, heldFirst, ties);
  std::vector<at::Tensor> counted;
  for (const auto& p : held->parameters()) {
    if (p.requires_grad() && followers.count(p.unsafeGetTensorImpl()) == 0) counted.push_back(p);
  }
  return squaredGradientNorm(counted);
}

std::map<std::string, std::string> storedOnce(const ModelSpec& spec, const std::vector<Tie>& ties) {
  std::map<std::string, std::string> out;
  for (const Tie& t : ties) {
    out[spec.layers[t.followerLayer].name + "/" + t.followerParam] =
        spec.layers[t.ownerLayer].name + "/" + t.ownerParam;
  }
  return out;
}

}  // namespace runtime
}  // namespace sinew
