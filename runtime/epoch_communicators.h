#pragma once

// Internal: the communicators of the epoch a worker is in (docs/architecture.md section 6):
// the epoch's world communicator ("dp": the data-parallel gradient allreduce; "pp": a
// pipeline job's activations, loss sums and layer copies), in pipeline mode the gradient
// groups (maximal ranges of this worker's layers held by the same workers, each with a
// communicator over those holders when there are several) and this worker's stage executor,
// which refers to the world communicator.
//
// Thread safety: the training thread builds, uses and drops them; the coordinator client's io
// thread calls abortBefore() when it hears of a newer epoch, so that a collective waiting on a
// dead member returns at once. Both hold mu_ while they touch the pointers.

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "sinew/collectives/gloo/gloo_options.h"
#include "sinew/communicator.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/stage_executor.h"
#include "sinew/runtime/device_choice.h"
#include "sinew/runtime/tied_parameters.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

class EpochCommunicators {
 public:
  // Runs one blocking transfer (the argument), e.g. marked as waiting on the others.
  using Around = std::function<void(const std::function<void()>& transfer)>;

  // REQUIRES: services and chooser outlive this object.
  EpochCommunicators(const TrainerServices& services, BackendChooser& chooser);

  // Aborts every communicator of an epoch older than `epoch`, or all of them when `epoch` < 0
  // (the client's io thread, on an announcement or a lost coordinator).
  void abortBefore(int64_t epoch);
  // Aborts and destroys them: the epoch is being left after a failure or a superseded build.
  void drop();
  // Destroys them healthy (the end of training): their peers are told they closed, not that
  // they aborted.
  void close();

  // The options of one of epoch `epoch`'s communicators over `members`.
  collectives::CommunicatorOptions options(int64_t epoch, std::vector<int> members,
                                           std::string name) const;

  // Builds epoch `epoch`'s world communicator `name` over `members` through `store` (the
  // epoch's rendezvous), replacing the previous epoch's. Aborted at once if a newer epoch was
  // announced while it was built (the announcement found nothing to abort).
  void buildWorld(const std::shared_ptr<collectives::Store>& store, int64_t epoch,
                  const std::vector<int>& members, const std::string& name,
                  const collectives::GlooOptions& gloo = {});

  // Pipeline mode: the gradient groups of this worker's layers [first, end) in `plan`, built
  // in increasing layer order on every worker (so that no two builds wait on each other in a
  // cycle), each with a communicator when several workers hold its layers.
  void buildGradGroups(const std::shared_ptr<collectives::Store>& store, int64_t epoch,
                       const pipeline::Plan& plan, int first, int end);

  // Pipeline mode, after buildGradGroups(): for each tie one of whose two layers this worker
  // holds, a communicator over every holder of either layer when there are several, built in
  // the ties' order.
  void buildTies(const std::shared_ptr<collectives::Store>& store, int64_t epoch,
                 const pipeline::Plan& plan, int first, int end, const std::vector<Tie>& ties);

  // This worker's stage executor of the epoch (null: it holds no stage).
  void setExecutor(std::unique_ptr<pipeline::StageExecutor> executor);
  pipeline::StageExecutor* executor() { return executor_.get(); }

  // REQUIRES: buildWorld() succeeded for the current epoch.
  collectives::Communicator& world() { return *world_; }

  // Pipeline mode: sums the gradients of the trainable parameters of each gradient group over
  // its holders (`held` are this worker's layers, the first of them layer `heldFirst`), in
  // increasing layer order, then gives both parameters of each tie the sum of the two (the
  // lowest-id holder of each layer contributes its parameter's summed gradient), each
  // allreduce run through `around`. Returns the sum of the squares of the gradients of the
  // groups this worker is the lowest-id holder of, followers left out, so that summed over the
  // members every parameter counts once, however many pipelines hold it.
  double reduceGradients(torch::nn::Sequential& held, int heldFirst, const std::vector<Tie>& ties,
                         const Around& around);

 private:
  struct GradGroup {
    int first = 0;
    int end = 0;
    std::vector<int> members;                         // sorted
    std::unique_ptr<collectives::Communicator> comm;  // null when this worker holds it alone
  };

  struct TieGroup {
    size_t tie = 0;                                   // index into the ties
    int ownerFirst = -1;                              // lowest-id holder of the owner's layer
    int followerFirst = -1;                           // likewise of the follower's
    std::unique_ptr<collectives::Communicator> comm;  // null when this worker holds both alone
  };

  // Gives both parameters of each tie group the sum of their gradients.
  void reduceTies(torch::nn::Sequential& held, int heldFirst, const std::vector<Tie>& ties,
                  const Around& around);

  const TrainerServices& s_;  // The trainer's; outlives this object.
  BackendChooser& chooser_;   // Likewise.
  std::mutex mu_;
  // Guarded by mu_ (abortBefore() runs on the client's io thread); replaced by the training
  // thread only.
  std::unique_ptr<collectives::Communicator> world_;
  std::vector<GradGroup> groups_;
  std::vector<TieGroup> ties_;
  std::unique_ptr<pipeline::StageExecutor> executor_;  // Refers to world_.
};

}  // namespace runtime
}  // namespace sinew
