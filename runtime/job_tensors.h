#pragma once

// Internal: the job's tensors that ride along with the model (names starting with '@',
// docs/checkpoint_format.md): the dynamic loss scale ("@loss_scale") and the program's own state
// (Trainer::keepState, "@user.<name>"). Each is appended to every layer of every captured
// shard, so that any restored layer brings it back. The values always belong to one step, like
// the model state beside them: a commit sets them, a restore loads them at once (so that a
// worker whose layers went back to a version holds that version's values too, whatever happens
// to the epoch that restored them), and when an epoch starts the members agree on the values of
// its resume step: those of a member that holds them, broadcast to the others.
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

  // The step the values belong to (-1: the initial values, before step 0).
  int64_t step() const { return step_; }

  // Calls every entry's save(step) at step `step`'s commit; appendTo() then carries them. All
  // or nothing: if a save throws or returns another shape or dtype than its entry's initial
  // value, throws InvalidArgument naming the entry and the step, and keeps the values it had.
  void commit(int64_t step);
  // Appends every entry's value of the last commit() (its initial value before any) to every
  // layer of `state`.
  void appendTo(checkpoint::ShardState& state) const;

  // The values after step `step` among `restored` (runtime::jobTensors of layers restored to
  // that step's version): if every entry is there, loads them (each entry's load) and returns
  // true; otherwise changes nothing and returns false (a version written without them). Throws
  // Corruption naming `source` and the tensor if one has another shape or dtype.
  bool take(const std::map<std::string, at::Tensor>& restored, const std::string& source,
            int64_t step);

  // At the start of an epoch that resumes after step `step`, over `world` (every member calls
  // it): the members whose values belong to `step` know them; `preferredRoot` (a rank) if it
  // knows, else the lowest-ranked member that knows, broadcasts them, and every member that did
  // not know loads them (all entries are received before any is loaded). Nothing happens when
  // nobody knows (every member keeps its own). Collective.
  void agree(collectives::Communicator& world, int64_t step, at::Device device,
             std::chrono::milliseconds timeout, int preferredRoot = -1);

 private:
  std::vector<Entry> entries_;
  // Makes `values` (one per entry) those after `step` and loads them.
  void load(std::vector<at::Tensor> values, int64_t step);

  std::vector<at::Tensor> current_;  // per entry: the value after step_
  int64_t step_ = -1;
};

// The entry of TrainerOptions::keptState's `k` ("@user.<name>"). Throws InvalidArgument naming
// the option unless the name is [A-Za-z0-9_.-]+ and initial, save and load are given.
JobTensors::Entry keptStateEntry(const KeptState& k);

}  // namespace runtime
}  // namespace sinew
