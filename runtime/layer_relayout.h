#pragma once

// Internal: moving layers between workers when a pipeline epoch changes the plan
// (docs/pipeline.md, "Reconfiguration"). Every member publishes what it holds (its layer
// range and the step its state is after); from those, every member derives the same list of
// copies (pipeline::liveLayerCopies: each layer to every worker of the new plan that does not
// hold it live, from the live holder with the least traffic so far), sends what it must from
// its current layers and receives into new ones: per layer a manifest
// (runtime/layer_copy_manifest.h), then the tensors, streamed in chunks between two barriers
// so that nothing else of the job runs beside them. Layers nobody holds live come from their
// seeds (nothing trained yet) or from a version (own RAM, peers' RAM, disk).
//
// Nothing of the worker changes here: a failure leaves it holding what it held, and the
// caller adopts the result only once every copy arrived whole.
//
// Thread safety: used by the training thread.

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sinew/checkpoint/shard.h"
#include "sinew/communicator.h"
#include "sinew/model.h"
#include "sinew/pipeline/plan.h"
#include "sinew/runtime/peer_versions.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

// A layer copy arrived damaged (its crc32c disagreed with the sender's, or its manifest was
// malformed). Nothing of it was adopted; the same members can try the epoch again.
class LayerCopyDamaged : public Corruption {
 public:
  using Corruption::Corruption;
};

// What a member holds when an epoch starts: layers [first, end) (first < 0: none built yet)
// with the state after step `applied`.
struct Holding {
  int first = -1;
  int end = -1;
  int64_t applied = -1;
  bool holds(int layer) const { return first >= 0 && layer >= first && layer < end; }
  bool holdsLive(int layer, int64_t resumeApplied) const {
    return holds(layer) && applied == resumeApplied;
  }
};

// Publishes `mine` as `self`'s holding for `epoch` and reads every member's. Throws Corruption
// naming the worker if a published holding is malformed.
std::map<int, Holding> exchangeHoldings(collectives::Store& store, int64_t epoch,
                                        const std::vector<int>& members, int self,
                                        const Holding& mine, std::chrono::milliseconds timeout);

// The new layers of a worker, and their state, from a reconfiguration.
struct Relayout {
  torch::nn::Sequential model;                             // [first, end), on the device
  std::map<std::string, checkpoint::RestoredLayer> state;  // by layer name, as checkpoints
  // The layers whose state is this worker's own live state or the copies it received: tensors
  // nothing else uses, which loadState() may adopt instead of cloning.
  std::set<std::string> adoptable;
  int copied = 0, fromDisk = 0, fromOwnRam = 0, fromPeerRam = 0, fresh = 0;
  std::vector<int> sources;     // workers copied from (live layers), sorted, each once
  std::vector<int> ramSources;  // workers whose RAM versions were restored, sorted, each once
  int64_t bytesCopied = 0;      // tensor bytes received from live workers
  double copySeconds = 0;       // the wall time of receiving them (with this worker's sends)

  // The event "layers_moved" of the worker that adopts it in `epoch` (held [oldFirst, oldEnd),
  // holds [first, end) at version `version`, after `seconds`).
  nlohmann::json movedEvent(int64_t epoch, int oldFirst, int oldEnd, int first, int end,
                            int64_t version, double seconds) const;

  // "sinew: worker 3 now holds layers h2..h5 (epoch 4; 2 copied from worker 1; ...)".
  std::string describe(int worker, const ModelSpec& spec, int first, int end, int64_t epoch,
                       int64_t version) const;
};

class LayerRelayout {
 public:
  // Tags of the copies' messages (beside the stage executor's 1-3).
  static constexpr uint32_t kTagLayerManifest = 4;
  static constexpr uint32_t kTagLayerState = 5;
  // Layer copies go as messages of at most this many bytes (collectives::exchangeInChunks).
  static constexpr size_t kLayerCopyChunkBytes = size_t{4} << 20;

  // REQUIRES: all references outlive this object.
  LayerRelayout(const TrainerServices& services, const ModelSpec& spec, at::Device device,
                PeerVersions& peers);

  // What this worker currently holds: layers [heldFirst, heldFirst + held->size()) of the
  // model, trained by `optimizer`.
  struct Current {
    const torch::nn::Sequential& layers;
    int heldFirst;
    torch::optim::Optimizer& optimizer;
  };

  // Runs epoch `plan`'s layer copies over `comm` (the epoch's communicator, every member of
  // `held`): this worker will hold [first, end) with the state after `resumeApplied`. Returns
  // its new layers and their state, or nothing when it keeps exactly what it holds. Throws
  // LayerCopyDamaged for a damaged copy, the communicator's errors for a lost member.
  std::optional<Relayout> run(const pipeline::Plan& plan, const std::map<int, Holding>& held,
                              int first, int end, int64_t resumeApplied,
                              collectives::Communicator& comm, const Current& current);

  // Rollback (docs/pipeline.md, "Rollback"): when some layer with parameters
  // (`hasParameters`) has no live holder in `held` after epoch `info`'s resume step, the
  // epoch's first member picks the newest version every layer can still be restored from
  // (PeerVersions::rollbackTarget) and publishes it in `store`; if it is older than the resume
  // step, it asks the coordinator for an epoch resuming after it, and every member throws
  // EpochChanged to wait for that epoch, in which nobody holds a layer live at the resume step
  // and every layer is restored from that version. Returns when no rollback is needed.
  void checkRollback(const EpochInfo& info, const std::map<int, Holding>& held,
                     collectives::Store& store, const std::function<bool(int)>& hasParameters);

 private:
  // Layers [first, end) as modules on the device: those `kept` says (layers this worker holds
  // live, or holds and restores from a version) are its current modules, the others built
  // from their seeds.
  torch::nn::Sequential stageModules(int first, int end, const Current& current,
                                     const std::function<bool(int)>& kept) const;

  // The state of r's layers that no copy brought: this worker's own for those it holds live,
  // the resume step's version for those nobody holds live once a step was applied (own RAM,
  // peers' RAM, then disk), their seeds' otherwise. REQUIRES: r.model holds [first, end).
  void fillUncopied(Relayout& r, int first, int end, const Current& current,
                    const std::vector<std::vector<int>>& holders, int64_t resumeApplied,
                    const std::map<int, Holding>& held, const std::function<bool(int)>& ownLive);

  // The manifest of held layer `layer` and its tensors in manifest order.
  at::Tensor manifestOf(const Current& current, int layer, std::vector<at::Tensor>* tensors);

  const TrainerServices& s_;  // The trainer's; outlives this object.
  const ModelSpec& spec_;     // The trainer's; outlives this object.
  const at::Device device_;
  PeerVersions& peers_;  // The trainer's; outlives this object.
};

}  // namespace runtime
}  // namespace sinew
