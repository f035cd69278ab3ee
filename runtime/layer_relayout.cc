#include "sinew/runtime/layer_relayout.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "sinew/base/crc32c.h"
#include "sinew/base/parse.h"
#include "sinew/pipeline/reconfiguration.h"
#include "sinew/runtime/layer_copy_manifest.h"
#include "sinew/runtime/optimizer_state.h"

namespace sinew {
namespace runtime {

namespace {

std::string heldKey(int64_t epoch, int worker) {
  return "sinew/pipeline/held/" + std::to_string(epoch) + "/w" + std::to_string(worker);
}

Holding parseHolding(const std::string& text, int worker, int64_t epoch) {
  Holding h;
  std::istringstream is(text);
  if (!(is >> h.first >> h.end >> h.applied) || h.end < h.first || h.applied < -1) {
    SINEW_THROW(Corruption, "worker ", worker, " published a malformed holding for epoch ", epoch,
                ": '", text, "'");
  }
  return h;
}

// crc32c of the tensors' bytes, one after the other (host copies of device tensors).
uint32_t checksum(const std::vector<at::Tensor>& tensors) {
  uint32_t crc = 0;
  for (const auto& t : tensors) {
    at::Tensor h = t.is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
    crc = ::sinew::detail::crc32cExtend(crc, h.data_ptr(),
                                        static_cast<size_t>(h.numel() * h.element_size()));
  }
  return crc;
}

// A tensor of a layer copy this worker receives, and where it goes in the layer's state.
struct IncomingTensor {
  std::string layer, name;
  at::Tensor tensor;
  size_t copy;  // its copy's index
};

// The receive buffers of the copies whose manifests arrived (`manifests`, by copy index), in
// manifest order and zero-filled like the fresh layers' parameters (`fresh` holds layers from
// `first` on), each with its receive from the copy's sender in `ops`. The manifests' checksums
// go to `expected`; r gets the step counts the manifests carry, and the copies and their
// sources. Throws LayerCopyDamaged naming the layer, the sender and the bad word of a
// malformed manifest.
std::vector<IncomingTensor> prepareReceives(
    const ModelSpec& spec, int self, const std::vector<pipeline::LiveLayerCopy>& copies,
    const std::map<size_t, at::Tensor>& manifests, const torch::nn::Sequential& fresh, int first,
    const StateLayout& layout, const std::function<int(int)>& rankIn, Relayout& r,
    std::map<size_t, uint32_t>& expected, std::vector<collectives::P2POp>& ops) {
  std::vector<IncomingTensor> incoming;
  for (const auto& [c, received] : manifests) {
    const pipeline::LiveLayerCopy& k = copies[c];
    const std::string& layerName = spec.layers[k.layer].name;
    auto params = fresh->ptr(k.layer - first)->named_parameters(/*recurse=*/true);
    at::Tensor words = received.cpu().contiguous();
    LayerCopyManifest manifest;
    try {
      manifest = LayerCopyManifest::decode(
          words.data_ptr<int64_t>(), static_cast<size_t>(words.numel()), params.size(), layout,
          "layer '" + layerName + "' from worker " + std::to_string(k.from));
    } catch (const Corruption& e) {
      // The decoder's message names the layer, the sender and the bad word (and its place).
      throw LayerCopyDamaged("worker " + std::to_string(self) + " received " + e.what());
    }
    expected[c] = manifest.crc32c;
    size_t i = 0;
    for (const auto& np : params) {
      const LayerCopyManifest::Parameter& p = manifest.parameters[i++];
      for (const std::string& suffix : LayerCopyManifest::tensorSuffixes(p.fields, layout)) {
        // Zero-filled, not empty: the pages are faulted in here, while the sender's first
        // chunks are already on their way, instead of one by one inside Gloo's reads (which
        // halved the copy's receive time and cut 10% off the reconfiguration).
        incoming.push_back({layerName, np.key() + suffix, at::zeros_like(np.value()), c});
        ops.push_back(collectives::P2POp::recv(incoming.back().tensor, rankIn(k.from),
                                               LayerRelayout::kTagLayerState));
      }
      if (layout.countField >= 0 && (p.fields & (int64_t{1} << layout.countField)) != 0) {
        r.state[layerName][np.key() + "." + layout.fields[layout.countField]] =
            at::full({1}, p.count, at::kLong);
      }
    }
    r.copied++;
    r.sources.push_back(k.from);
  }
  return incoming;
}

// Throws LayerCopyDamaged naming the layer, its sender and the two checksums unless the
// tensors of every copy in `expected` arrived with the crc32c its manifest announced.
void verifyCopies(const ModelSpec& spec, int self, int64_t epoch,
                  const std::vector<pipeline::LiveLayerCopy>& copies,
                  const std::map<size_t, uint32_t>& expected,
                  const std::vector<IncomingTensor>& incoming) {
  for (const auto& [c, crc] : expected) {
    std::vector<at::Tensor> got;
    for (const auto& in : incoming) {
      if (in.copy == c) got.push_back(in.tensor);
    }
    const uint32_t actual = checksum(got);
    if (actual != crc) {
      SINEW_THROW(LayerCopyDamaged, "layer '", spec.layers[copies[c].layer].name,
                  "' copied from worker ", copies[c].from, " to worker ", self, " in epoch ", epoch,
                  " arrived damaged: crc32c ", actual, ", the sender's ", crc);
    }
  }
}

}  // namespace

std::map<int, Holding> exchangeHoldings(collectives::Store& store, int64_t epoch,
                                        const std::vector<int>& members, int self,
                                        const Holding& mine, std::chrono::milliseconds timeout) {
  store.set(heldKey(epoch, self),
            collectives::toBytes(std::to_string(mine.first) + " " + std::to_string(mine.end) + " " +
                                 std::to_string(mine.applied)));
  std::map<int, Holding> held;
  for (int w : members) {
    held[w] = parseHolding(collectives::toString(store.get(heldKey(epoch, w), timeout)), w, epoch);
  }
  return held;
}

nlohmann::json Relayout::movedEvent(int64_t epoch, int oldFirst, int oldEnd, int first, int end,
                                    int64_t version, double seconds) const {
  return {{"event", "layers_moved"},
          {"epoch", epoch},
          {"held", {oldFirst, oldEnd}},
          {"holds", {first, end}},
          {"copied", copied},
          {"from", sources},
          {"from_disk", fromDisk},
          {"from_own_ram", fromOwnRam},
          {"from_peer_ram", fromPeerRam},
          {"ram_sources", ramSources},
          {"version", version},
          {"fresh", fresh},
          {"copied_bytes", bytesCopied},
          {"copy_s", copySeconds},
          {"duration_s", seconds}};
}

std::string Relayout::describe(int worker, const ModelSpec& spec, int first, int end, int64_t epoch,
                               int64_t version) const {
  std::ostringstream os;
  os << "sinew: worker " << worker << " now holds ";
  if (end > first) {
    os << "layers " << spec.layers[first].name << ".." << spec.layers[end - 1].name;
  } else {
    os << "no layers";
  }
  os << " (epoch " << epoch;
  if (copied > 0) {
    os << "; " << copied << " copied from worker" << (sources.size() > 1 ? "s" : "");
    for (int w : sources) os << " " << w;
  }
  if (fromOwnRam > 0) {
    os << "; " << fromOwnRam << " restored from its own RAM (version " << version << ")";
  }
  if (fromPeerRam > 0) {
    os << "; " << fromPeerRam << " restored from the RAM of worker"
       << (ramSources.size() > 1 ? "s" : "");
    for (int w : ramSources) os << " " << w;
    os << " (version " << version << ")";
  }
  if (fromDisk > 0) {
    os << "; " << fromDisk << " read from the durable checkpoint (version " << version << ")";
  }
  if (fresh > 0) os << "; " << fresh << " built from their seeds";
  if (copied + fromDisk + fromOwnRam + fromPeerRam + fresh == 0) {
    os << (end > first ? "; all its own" : "; idle");
  }
  os << ")";
  return os.str();
}

LayerRelayout::LayerRelayout(const TrainerServices& services, const ModelSpec& spec,
                             at::Device device, PeerVersions& peers)
    : s_(services), spec_(spec), device_(device), peers_(peers) {}

at::Tensor LayerRelayout::manifestOf(const Current& current, int layer,
                                     std::vector<at::Tensor>* tensors) {
  LayerCopyManifest manifest;
  const size_t before = tensors->size();
  const StateLayout& layout = optimizerStateCodec(current.optimizer, "the optimizer").layout();
  for (const auto& np : (*current.layers)[layer - current.heldFirst]->named_parameters(true)) {
    std::vector<checkpoint::NamedTensor> named;
    captureParameterState(np.key(), np.value(), current.optimizer, &named);
    // named[0] is the parameter; the rest are its state's fields, "<param>.<field>", in the
    // layout's order.
    tensors->push_back(named[0].tensor.contiguous());
    LayerCopyManifest::Parameter p;
    for (size_t i = 0; i < layout.fields.size(); ++i) {
      const std::string want = np.key() + "." + layout.fields[i];
      for (size_t k = 1; k < named.size(); ++k) {
        if (named[k].name != want) continue;
        p.fields |= int64_t{1} << i;
        if (layout.isCount(i)) {
          p.count = named[k].tensor.item<int64_t>();  // In the manifest.
        } else {
          tensors->push_back(named[k].tensor.contiguous());
        }
      }
    }
    manifest.parameters.push_back(p);
  }
  manifest.crc32c = checksum(std::vector<at::Tensor>(
      tensors->begin() + static_cast<std::ptrdiff_t>(before), tensors->end()));
  std::vector<int64_t> words = manifest.encode();
  return at::tensor(words, at::kLong).to(device_);
}

torch::nn::Sequential LayerRelayout::stageModules(int first, int end, const Current& current,
                                                  const std::function<bool(int)>& kept) const {
  // A layer this worker holds live, or holds and restores from a version, stays the module
  // it is (`kept`; its state is loaded onto itself); only the others are built from their
  // seeds, to be copied into, restored or kept fresh. Building a GPT-2 small block from its
  // seed (its random initialisation) took longer than copying it from a peer, and a tied
  // layer built alone builds its owner too. Nothing of the current modules changes before
  // EpochEntry adopts them.
  torch::nn::Sequential model;
  for (int l = first; l < end;) {
    if (kept(l)) {
      model->push_back(spec_.layers[l].name, current.layers->begin()[l - current.heldFirst]);
      ++l;
      continue;
    }
    int to = l;
    while (to < end && !kept(to)) ++to;
    torch::nn::Sequential built = buildLayers(spec_, s_.options.seed, s_.options.dtype, l, to);
    built->to(device_);
    for (int k = l; k < to; ++k) model->push_back(spec_.layers[k].name, built->begin()[k - l]);
    l = to;
  }
  return model;
}

void LayerRelayout::fillUncopied(Relayout& r, int first, int end, const Current& current,
                                 const std::vector<std::vector<int>>& holders,
                                 int64_t resumeApplied, const std::map<int, Holding>& held,
                                 const std::function<bool(int)>& ownLive) {
  const int self = s_.worker();
  auto freshParams = [&](int l) { return (*r.model)[l - first]->named_parameters(true); };
  // Layers this worker keeps: its own state. Layers nobody holds live: from their seeds if
  // no step was applied yet, else from the version of the resume step.
  std::map<std::string, checkpoint::RestoredLayer> own;
  for (auto& l : captureState(current.layers, current.optimizer)) {
    auto& m = own[l.name];
    for (auto& t : l.tensors) m[t.name] = t.tensor;
  }
  std::vector<std::string> fromVersion;
  for (int l = first; l < end; ++l) {
    const std::string& name = spec_.layers[l].name;
    if (freshParams(l).size() == 0 || r.state.count(name)) continue;
    if (ownLive(l)) {
      r.state[name] = own.at(name);  // The module's own tensors (run() keeps the module).
      r.adoptable.insert(name);
    } else if (holders[l].empty() && resumeApplied >= 0) {
      fromVersion.push_back(name);
    } else {
      for (const auto& np : freshParams(l)) r.state[name][np.key()] = np.value().detach();
      r.fresh++;
    }
  }
  if (!fromVersion.empty()) {
    // The version of the resume step (after a rollback, every layer): own RAM, peers' RAM,
    // then disk (the trainer chose a step every layer can be restored from).
    std::vector<int> alive;
    for (const auto& [w, h] : held) alive.push_back(w);
    checkpoint::RestoreResult restored = peers_.restore(resumeApplied, fromVersion, alive);
    for (auto& [name, layer] : restored.layers) {
      const std::string& from = restored.source.at(name);
      if (from == "local") {
        r.fromOwnRam++;
      } else if (from.rfind("peer ", 0) == 0) {
        r.fromPeerRam++;
        r.ramSources.push_back(std::stoi(from.substr(5)));
      } else {
        r.fromDisk++;
      }
      r.state[name] = std::move(layer);
    }
    for (const std::string& why : restored.fellThrough) {
      std::fprintf(stderr, "sinew: worker %d: restoring version %lld: %s\n", self,
                   static_cast<long long>(resumeApplied), why.c_str());
    }
  }
}

std::optional<Relayout> LayerRelayout::run(const pipeline::Plan& plan,
                                           const std::map<int, Holding>& held, int first, int end,
                                           int64_t resumeApplied, collectives::Communicator& comm,
                                           const Current& current) {
  const int self = s_.worker();
  auto live = [&](int w, int l) { return held.at(w).holdsLive(l, resumeApplied); };
  // Who copies which layer to whom. Traffic is counted in layers, which every member knows
  // alike: the measured profile is not on every member (a joiner has none), and members that
  // weighed the copies differently would post unmatched messages and wait for them until the
  // epoch's deadline (seen in PipelineJoinTest.AJoinedWorkerGetsAStage).
  std::vector<std::vector<int>> holders(plan.numLayers);
  for (int l = 0; l < plan.numLayers; ++l) {
    for (const auto& [w, h] : held) {
      if (live(w, l)) holders[l].push_back(w);
    }
  }
  const std::vector<pipeline::LiveLayerCopy> copies = pipeline::liveLayerCopies(
      plan, holders, std::vector<int64_t>(static_cast<size_t>(plan.numLayers), 1));
  const std::vector<int>& members = comm.members();
  auto rankIn = [&](int w) {
    return static_cast<int>(std::find(members.begin(), members.end(), w) - members.begin());
  };
  const Holding& me = held.at(self);
  const bool keeps = me.first == first && me.end == end && me.applied == resumeApplied;
  Relayout r;
  auto heldParams = [&](int l) {
    return (*current.layers)[l - current.heldFirst]->named_parameters(/*recurse=*/true);
  };
  if (!keeps && end > first) {
    const int heldEnd = current.heldFirst + static_cast<int>(current.layers->size());
    r.model = stageModules(first, end, current, [&](int l) {
      if (live(self, l)) return true;
      // A layer it holds that is restored from a version (no live holder: a rollback, or a
      // loss during a reconfiguration) gets the version's state at adoption: its module
      // serves as well as one built from its seed, and costs nothing.
      return holders[l].empty() && resumeApplied >= 0 && l >= current.heldFirst && l < heldEnd &&
             heldParams(l).size() > 0;
    });
  }
  auto freshParams = [&](int l) { return (*r.model)[l - first]->named_parameters(true); };
  // Phase 1: manifests.
  std::vector<collectives::P2POp> ops;
  std::map<size_t, std::vector<at::Tensor>> outgoing;  // by copy index, where it sends
  std::map<size_t, at::Tensor> manifests;              // by copy index, where it receives
  for (size_t c = 0; c < copies.size(); ++c) {
    const pipeline::LiveLayerCopy& k = copies[c];
    if (k.from == self && heldParams(k.layer).size() > 0) {
      at::Tensor m = manifestOf(current, k.layer, &outgoing[c]);
      ops.push_back(collectives::P2POp::send(m, rankIn(k.to), kTagLayerManifest));
    } else if (k.to == self && freshParams(k.layer).size() > 0) {
      const size_t words = LayerCopyManifest::encodedWords(freshParams(k.layer).size());
      at::Tensor m = at::zeros({static_cast<int64_t>(words)},
                               at::TensorOptions().dtype(at::kLong).device(device_));
      manifests[c] = m;
      ops.push_back(collectives::P2POp::recv(m, rankIn(k.from), kTagLayerManifest));
    }
  }
  if (!ops.empty()) {
    comm.exchange(ops, s_.recoveryTimeout());
    // Between the two exchanges of this worker's copies (a kill during a layer copy).
    s_.state.injector.fire(self, resumeApplied + 1, Phase::kCopy, &s_.client);
  }
  // Phase 2: the tensors, in manifest order.
  ops.clear();
  if (!outgoing.empty() && s_.state.injector.damageCopy(self, resumeApplied + 1)) {
    // Failure injection (corrupt, phase copy): the first tensor goes out with its first
    // bytes overwritten, from a copy (its own state stays intact).
    at::Tensor& t = outgoing.begin()->second.front();
    at::Tensor damaged = t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
    std::memcpy(damaged.data_ptr(), kDamageBytes,
                std::min<size_t>(sizeof kDamageBytes, damaged.nbytes()));
    t = damaged.to(t.device());
  }
  for (const auto& [c, tensors] : outgoing) {
    for (const auto& t : tensors) {
      ops.push_back(collectives::P2POp::send(t, rankIn(copies[c].to), kTagLayerState));
    }
  }
  std::map<size_t, uint32_t> expected;  // crc32c by copy index
  const StateLayout& layout = optimizerStateCodec(current.optimizer, "the optimizer").layout();
  std::vector<IncomingTensor> incoming = prepareReceives(spec_, self, copies, manifests, r.model,
                                                         first, layout, rankIn, r, expected, ops);
  // The copies run while nothing else of the job does (docs/pipeline.md, "Reconfiguration, step by
  // step"; measured in bench/RESULTS.md, "Quiet copies"): every member enters them once every
  // receiver has built and zero-filled its buffers and every sender has its manifests' checksums,
  // and leaves them only once every copy has arrived. Every member derives the same copy list, so
  // all of them take both barriers or none; a member lost meanwhile fails them as it fails the
  // copies (PeerLost).
  const bool anyCopies = !copies.empty();
  if (anyCopies) comm.barrier(s_.recoveryTimeout());
  if (!ops.empty()) {
    // Streamed in chunks; timed on the receivers for the copy's throughput (layers_moved).
    auto t0 = TrainerClock::now();
    collectives::exchangeInChunks(comm, ops, kLayerCopyChunkBytes, s_.recoveryTimeout());
    for (const auto& in : incoming) r.bytesCopied += in.tensor.nbytes();
    if (!incoming.empty()) r.copySeconds = seconds(TrainerClock::now() - t0);
  }
  if (anyCopies) comm.barrier(s_.recoveryTimeout());
  if (keeps) return std::nullopt;
  // Every copy arrived whole, or the reconfiguration fails here (nothing adopted).
  verifyCopies(spec_, self, comm.epoch(), copies, expected, incoming);
  for (auto& in : incoming) {
    r.state[in.layer][in.name] = in.tensor;
    r.adoptable.insert(in.layer);
  }
  fillUncopied(r, first, end, current, holders, resumeApplied, held,
               [&](int l) { return live(self, l); });
  for (auto* v : {&r.sources, &r.ramSources}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  return r;
}

void LayerRelayout::checkRollback(const EpochInfo& info, const std::map<int, Holding>& held,
                                  collectives::Store& store,
                                  const std::function<bool(int)>& hasParameters) {
  const int64_t e = info.epoch;
  const int64_t resumeApplied = info.resumeStep - 1;
  int orphan = -1;
  for (int l = 0; l < static_cast<int>(spec_.layers.size()) && orphan < 0; ++l) {
    if (!hasParameters(l)) continue;
    bool live = false;
    for (const auto& [w, h] : held) live = live || h.holdsLive(l, resumeApplied);
    if (!live) orphan = l;
  }
  // The first member always publishes its decision (its own view of which layers have
  // parameters decides), so a member that sees an orphan never waits for nothing.
  const std::string key = "sinew/pipeline/rollback/" + std::to_string(e);
  const bool decides = info.members.front() == s_.worker();
  if (decides) {
    const int64_t t =
        orphan < 0 ? resumeApplied
                   : peers_.rollbackTarget(resumeApplied, e, info.members, store,
                                           static_cast<int>(spec_.layers.size()), hasParameters);
    store.set(key, collectives::toBytes(std::to_string(t)));
  }
  if (orphan < 0) return;
  const int64_t target =
      sinew::detail::parseInt(collectives::toString(store.get(key, s_.recoveryTimeout())),
                              key.c_str(), -1, int64_t{1} << 53);
  if (target >= resumeApplied) return;  // That very version is restorable.
  s_.event({{"event", "rollback"},
            {"epoch", e},
            {"layer", spec_.layers[orphan].name},
            {"from", resumeApplied},
            {"to", target}});
  if (decides) {
    std::printf(
        "sinew: epoch %lld: layer %s has no live copy after step %lld; rolling back to %s\n",
        static_cast<long long>(e), spec_.layers[orphan].name.c_str(),
        static_cast<long long>(resumeApplied),
        target >= 0 ? ("version " + std::to_string(target)).c_str() : "the start");
    std::fflush(stdout);
    s_.client.requestRollback(e, target);
  }
  SINEW_THROW(EpochChanged, "epoch ", e, ": layer '", spec_.layers[orphan].name,
              "' has no live copy after step ", resumeApplied, "; the job rolls back to ",
              target >= 0 ? "version " + std::to_string(target) : std::string("the start"));
}

}  // namespace runtime
}  // namespace sinew
