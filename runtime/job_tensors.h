#pragma once

// Internal: the job's tensors that ride along with the model (names starting with '@',
// docs/checkpoint_format.md): the dynamic loss scale ("@loss_scale") and the program's own state
// (Trainer::keepState, "@user.<name>"). Each is appended to every layer of every captured
// shard, so that any restored layer brings it back; when an epoch starts, the members agree on
// the value of its resume step: that of the lowest-ranked member that holds it (live, or
// restored with its layers), broadcast to the others, each of which that was not live loads it.
//
// Thread safety: used by the training thread.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "sinew/checkpoint/shard.h"
#include "sinew/communicator.h"
#include "sinew/trainer.h"

namespace sinew {
namespace runtime {

class JobTensors {
 public:
  struct Entry {
    std::string name;  // "@..."
    at::Tensor like;   // the initial value: the shape and dtype of every value
    // The value after committed step `step`; called once per committed step, in order.
    std::function<at::Tensor(int64_t step)> save;
    // Takes the value after step `step` from a restored version or another member.
    std::function<void(int64_t step, const at::Tensor&)> load;
  };

  // Throws InvalidArgument if the name is taken or does not start with '@'.
  void add(Entry entry);
  bool empty() const { return entries_.empty(); }

  // Calls every entry's save(step) at step `step`'s commit; appendTo() then carries them.
  void commit(int64_t step);
  // Appends every entry's value of the last commit() (its initial value before any) to every
  // layer of `state`.
  void appendTo(checkpoint::ShardState& state) const;

  // Keeps the entries' values among `restored` (runtime::jobTensors of restored layers) for
  // agree(). Throws Corruption naming `source` and the tensor if one has another shape or
  // dtype. Returns whether every entry was there.
  bool take(const std::map<std::string, at::Tensor>& restored, const std::string& source);

  // At the start of an epoch that resumes after step `step`, over `world` (every member calls
  // it): `live` members hold that step's values in memory; members that took restored values
  // since the last agree() know them too. The lowest-ranked member that knows broadcasts them;
  // every member that is not live loads them. Nothing happens when nobody knows (every member
  // keeps its own). Collective.
  void agree(collectives::Communicator& world, int64_t step, bool live, at::Device device,
             std::chrono::milliseconds timeout);

 private:
  std::vector<Entry> entries_;
  std::vector<at::Tensor> current_;          // per entry: the value of the last commit()
  std::map<std::string, at::Tensor> taken_;  // restored values since the last agree()
};

// The entry of TrainerOptions::keptState's `k` ("@user.<name>"). Throws InvalidArgument naming
// the option unless the name is [A-Za-z0-9_.-]+ and initial, save and load are given.
JobTensors::Entry keptStateEntry(const KeptState& k);

}  // namespace runtime
}  // namespace sinew
