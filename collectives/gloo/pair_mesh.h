#pragma once

// Internal to the Gloo backend: Gloo's full mesh of pairs over connections Sinew made and
// authenticated (docs/collectives.md, "Gloo's pairs"). Used by gloo/communicator.cc only.
//
// Gloo's own full mesh (gloo::rendezvous::Context::connectFullMesh) has every pair listen on
// an ephemeral port and take the first connection that arrives there: any local process that
// connects first takes the pair, and the member it was for cannot connect, so the
// communicator's build fails. Here the connections are made by a Lanes set-up of purpose
// kGlooPairs (a hello carrying the listener's nonce, which only a reader of the job's store
// knows, checked before anything is allocated), and each pair adopts its connection: no pair
// listens for anyone.

#include <gloo/context.h>
#include <gloo/transport/device.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "sinew/store.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {

// Whether this build's Gloo pairs adopt connections Sinew authenticated: true with a Gloo
// whose pairs listen one by one (Debian 12's, 2022); false with a Gloo of one listener per
// device (2023 on), whose pairs' layout the adopting pair was not written for, so that they
// connect through Gloo's own rendezvous as before.
bool pairsAdoptConnections();

// Closes every pair of a context connectPairs made, in one pass of Gloo's loop thread (a
// pair's destructor waits for a tick of the loop, each); the context is then destroyed
// without waits. False where that was not done (another Gloo, a loop that did not run in
// time): the destructors close the pairs as usual.
bool closePairsOnLoop(gloo::Context& context);

// What connectPairs leaves besides the context, indexed by rank: a descriptor of each pair's
// connection of the caller's own (a duplicate, close-on-exec; -1 for itself, or where pairs
// do not adopt), so that it can keep the connection when the context goes; and the id of each
// connection made here (linkId of the two ends' nonces; 0 for one that was kept or not made).
struct PairLinks {
  std::vector<int> fds;
  std::vector<uint64_t> ids;
};

// Connects rank `rank` of `size` to every other member through `store` (the communicator's
// own namespace: keys "pair/<rank>", or Gloo's under "gloo/" where pairs do not adopt) by
// `deadline`, on Gloo's TCP `device`, and returns the Gloo context. `kept`, indexed by rank
// (empty, or -1 for none): a connection to that member kept from the communicator before,
// resynchronised, which its pair adopts instead of connecting anew (taken over: closed on
// failure). `describe` prefixes error messages, `workerOf` names a rank's worker in them.
// Throws IoError (a member did not connect in time, a connection broke or was refused, Gloo
// could not set a pair up), or what the store throws otherwise.
std::shared_ptr<gloo::Context> connectPairs(const std::shared_ptr<Store>& store, int rank, int size,
                                            const std::string& host, int64_t epoch,
                                            std::chrono::steady_clock::time_point deadline,
                                            const std::string& describe,
                                            const std::function<int(int)>& workerOf,
                                            const std::shared_ptr<gloo::transport::Device>& device,
                                            const std::vector<int>& kept, PairLinks* links);

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
