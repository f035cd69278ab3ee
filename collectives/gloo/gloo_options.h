#pragma once

// Internal: the Gloo backend's own knobs, kept out of the public CommunicatorOptions as c10d
// keeps ProcessGroupGloo::Options apart from ProcessGroup. The runtime passes them for the
// communicators it builds; createGlooCommunicator(store, options) uses the defaults.

#include <memory>

#include "sinew/communicator.h"

namespace sinew {
namespace collectives {

struct GlooOptions {
  // The largest laneSocketBufferBytes that can take effect (1 GiB).
  static constexpr int kMaxLaneSocketBufferBytes = 1 << 30;
  // The environment variable that overrides laneSocketBufferBytes (fromEnvironment).
  static constexpr const char* kLaneSocketBufferEnv = "SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES";

  // The kernel buffers of every lane socket, each way (docs/collectives.md, "Socket
  // buffers"), set where net.core.rmem_max and wmem_max allow that size; 0, or a system that
  // does not allow it, leaves the kernel's autotuning. Sized buffers let a new connection carry
  // bulk bytes at full speed from its first byte, as the runtime's layer copies on each epoch's
  // new lanes need; for the two-member allreduce one bench run measured autotuned ones faster.
  int laneSocketBufferBytes = 0;

  // Repair instead of rebuild (docs/collectives.md, "Repair: kept connections"): a
  // communicator that ends leaves its intact connections to the next communicator of its name
  // and member id, which connects only the pairs it has no connection for (a new member's, or
  // one whose connection broke). false: every communicator connects every pair anew and
  // closes them all at its end. Both ends of a pair must keep it for it to be kept.
  bool keepConnections = true;

  // These options with laneSocketBufferBytes = `laneSocketBufferBytes`, or the value of
  // SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES where that is set (a decimal count of bytes, 0 for the
  // kernel's autotuning). Throws InvalidArgument naming the variable and its value if that is
  // no count in [0, kMaxLaneSocketBufferBytes].
  static GlooOptions fromEnvironment(int laneSocketBufferBytes);
};

// createGlooCommunicator with the backend's options.
std::unique_ptr<Communicator> createGlooCommunicator(const std::shared_ptr<Store>& store,
                                                     const CommunicatorOptions& options,
                                                     const GlooOptions& gloo);
// createHostStagedCommunicator with the backend's options.
std::unique_ptr<Communicator> createHostStagedCommunicator(const std::shared_ptr<Store>& store,
                                                           const CommunicatorOptions& options,
                                                           const GlooOptions& gloo);

}  // namespace collectives
}  // namespace sinew
