#pragma once

// The coordinator's messages (docs/coordinator_protocol.md), carried in frames of service
// kCoordinator of Sinew's one transport (collectives/transport/frame.h: magic, version,
// service, type, length, job token, epoch). The payload is a JSON object whose fields are
// checked per type by decodeBody: required fields present, integers within range, strings
// bounded.
//
// Internal to sinew_runtime; not installed.

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sinew/collectives/transport/frame.h"

namespace sinew {
namespace runtime {
namespace wire {

// Worker ids are below this (ids are never reused, so it bounds the workers a job ever has).
constexpr int64_t kMaxWorkerId = 1 << 24;
// Steps and epochs are below this.
constexpr int64_t kMaxStep = int64_t{1} << 53;

enum class Type : uint8_t {
  kHello = 1,      // worker -> coordinator: {worker, node, pid}; worker -1 asks to join
  kWelcome = 2,    // coordinator -> worker: {worker, store_host, store_port, ...}
  kHeartbeat = 3,  // worker -> coordinator: {step}
  kLost = 4,       // worker -> coordinator: {worker} a peer the data plane lost
  kVote = 5,       // worker -> coordinator: {step[, compute_us, stall_us]} reduction of step
                   // done in this epoch (and how long its compute and snapshot stall took)
  kCommit = 6,     // coordinator -> worker: {step[, next_epoch, checkpoint]} every member voted
                   // for step (checkpoint: make this step durable)
  kEpoch = 7,      // coordinator -> worker: {epoch, members, resume_step, source, joined, sync}
  kDone = 8,       // worker -> coordinator: {step} finished every step
  kExpelled = 9,   // coordinator -> worker: {reason} declared dead; must leave
  kRebuild = 10,   // worker -> coordinator: {} this epoch's communicator could not be built
  kReady = 11,     // worker -> coordinator: {resume_step[, global_batch, microbatch, steps]}
                   // ready to train from this step
  kLeave = 12,     // worker -> coordinator: {step} preempted: leave at the next step boundary
  kReleased = 13,  // coordinator -> worker: {step, reason} left the job cleanly after step
  kPipeline = 14,  // worker -> coordinator: {profile, fault_tolerance, microbatches,
                   // max_workers} plan the job as pipelines (templates up to max_workers);
                   // every later epoch message carries its plan
  kDurable = 15,   // worker -> coordinator: {step, bytes, flush_us, path} a version is durable
  kRollback = 16,  // worker -> coordinator: {step} (pipelines) some layer has no live copy
                   // after the epoch's resume step: resume after the older version `step`
};

// Largest profile (JSON) a worker may send, and largest plan (JSON) an epoch may carry.
constexpr int64_t kMaxProfileBytes = 1 << 20;
constexpr int64_t kMaxPlanBytes = 32 << 20;

const char* typeName(uint8_t type);
// Types a worker may send (the coordinator's rules) and types the coordinator sends (the
// client's rules); null for the others.
const char* workerTypeName(uint8_t type);
const char* coordinatorTypeName(uint8_t type);

// Frame rules of each side of a coordinator connection.
collectives::transport::FrameRules coordinatorRules(uint64_t token, uint32_t maxBytes);
collectives::transport::FrameRules clientRules(uint64_t token);

// Serialises a message body.
std::vector<uint8_t> encodeBody(const nlohmann::json& body);

// Parses a payload as the JSON object of a message of `type` and checks its fields (see the
// table in wire.cc). Throws Corruption naming the message, the field and the value.
nlohmann::json decodeBody(uint8_t type, const std::vector<uint8_t>& payload);

}  // namespace wire
}  // namespace runtime
}  // namespace sinew
