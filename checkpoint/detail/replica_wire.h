#pragma once

// The replica service's messages (docs/checkpoint_format.md, "Replication protocol"), in
// frames of service kReplica of Sinew's one transport. Internal; not installed.

#include <cstdint>
#include <string>
#include <vector>

#include "sinew/checkpoint/shard.h"
#include "sinew/collectives/transport/frame.h"

namespace sinew {
namespace checkpoint {
namespace replica_wire {

enum class Type : uint8_t {
  kBegin = 1,      // -> service: owner i32, step i64, layout JSON
  kChunk = 2,      // -> service: the next bytes of the shard (consecutive offsets)
  kEnd = 3,        // -> service: empty; answered by kAck
  kAck = 4,        // <- service: empty if the shard was accepted, else why not
  kList = 5,       // -> service: empty; answered by kListReply
  kListReply = 6,  // <- service: JSON [{owner, step, layout}]
  kGet = 7,        // -> service: owner i32, step i64; answered by kGetReply + kData... or kError
  kGetReply = 8,   // <- service: layout JSON
  kData = 9,       // <- service: the next bytes of the shard
  kError = 10,     // <- service: why not
  // -> service: owner i32, step i64, base step i64, layout JSON: an incremental version,
  // followed by chunks of only the ranges ShardLayout::changedSince(base) names, in order,
  // none crossing a range; the service copies the rest from its replica of `base`.
  kBeginDelta = 11,
  // -> service: owner i32, step i64, JSON array of layer names; answered as kGet is, with the
  // layout and bytes of only those layers of the shard (ShardLayout::onlyLayers).
  kGetLayers = 12,
};

// The most layer names one get-layers message may name.
constexpr size_t kMaxGetLayers = 1 << 16;

// The service's answer (an ack's text) to a delta version whose base it does not hold; the
// client then sends the version whole.
constexpr const char* kNoBase = "no base version: ";

const char* requestName(uint8_t type);  // types a client sends; null for others
const char* answerName(uint8_t type);   // types the service sends; null for others

// Frame rules of the service (chunks up to maxChunk bytes) and of a client.
collectives::transport::FrameRules serviceRules(uint64_t token, uint32_t maxChunk);
collectives::transport::FrameRules clientRules(uint64_t token);

std::vector<uint8_t> encodeShardId(int owner, int64_t step);
// Decodes the first `size` (12) bytes of payload as owner and step (both >= 0). Throws
// Corruption naming `what`.
void decodeShardId(const std::vector<uint8_t>& payload, size_t size, int* owner, int64_t* step,
                   const char* what);

// One shard: a begin message's fields and an entry of a list reply.
struct ShardEntry {
  int owner = -1;
  int64_t step = -1;
  ShardLayout layout;
};
using BeginRequest = ShardEntry;
// Decodes a begin payload; the layout is checked by ShardLayout::fromJson and against
// maxShardBytes. Throws Corruption.
BeginRequest decodeBegin(const std::vector<uint8_t>& payload, uint64_t maxShardBytes);
// A begin-delta payload: owner and step, the base step (>= 0, < step), then the layout.
std::vector<uint8_t> encodeBeginDelta(int owner, int64_t step, int64_t base,
                                      const ShardLayout& layout);
BeginRequest decodeBeginDelta(const std::vector<uint8_t>& payload, uint64_t maxShardBytes,
                              int64_t* base);

// A get-layers payload: owner and step, then the JSON array of the layers wanted.
std::vector<uint8_t> encodeGetLayers(int owner, int64_t step,
                                     const std::vector<std::string>& layers);
// Decodes one: owner and step >= 0, then 1 to kMaxGetLayers non-empty strings. Throws
// Corruption naming what is wrong.
std::vector<std::string> decodeGetLayers(const std::vector<uint8_t>& payload, int* owner,
                                         int64_t* step);

// A list reply: the JSON array [{owner, step, layout}] of the shards a service holds.
std::vector<uint8_t> encodeList(const std::vector<ShardEntry>& shards);
// Decodes a list reply from `from` (named in errors): owners in [0, 2^31), steps >= 0, each
// layout checked by ShardLayout::fromJson. Throws Corruption.
std::vector<ShardEntry> decodeList(const std::vector<uint8_t>& payload, const std::string& from);

}  // namespace replica_wire
}  // namespace checkpoint
}  // namespace sinew
