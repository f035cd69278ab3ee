#include "sinew/runtime/device_choice.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <map>

#include "sinew/collectives/cuda_device.h"
#include "sinew/config.h"

namespace sinew {
namespace runtime {

int localRankFromEnv() {
  for (const char* name : {"SINEW_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                           "MPI_LOCALRANKID", "LOCAL_RANK"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == 0) continue;
    char* end = nullptr;
    long r = std::strtol(v, &end, 10);
    if (*end == 0 && r >= 0 && r < (1 << 20)) return static_cast<int>(r);
  }
  return -1;
}

at::Device resolveDevice(const std::string& d, int worker) {
  auto bad = [&](const std::string& why) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::device = '", d, "' on worker ", worker, ": ",
                why);
  };
  if (d == "cpu") return at::Device(at::kCPU);
  int index = -1;
  if (d != "cuda") {
    const std::string digits = d.rfind("cuda:", 0) == 0 ? d.substr(5) : std::string();
    if (digits.empty() || digits.size() > 6 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
      bad("expected cpu, cuda or cuda:N");
    }
    index = std::stoi(digits);
  }
  if (!SINEW_WITH_NCCL) {
    bad("this Sinew was built without the CUDA toolkit (SINEW_WITH_NCCL=OFF)");
  }
  if (!at::hasCUDA()) bad("this libtorch has no CUDA (at::hasCUDA() is false)");
  const int count = collectives::cudaDeviceCount();
  if (count == 0) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    bad(std::string("this process sees no GPU (CUDA_VISIBLE_DEVICES=") +
        (visible ? visible : "unset") + ")");
  }
  if (index < 0) {
    const int local = localRankFromEnv();
    index = (local >= 0 ? local : std::max(worker, 0)) % count;
  }
  if (index >= count) bad("this process sees only " + std::to_string(count) + " GPUs");
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

BackendChooser::BackendChooser(const TrainerServices& services, at::Device device)
    : s_(services), device_(device) {}

std::string BackendChooser::key(int worker) { return "sinew/device/w" + std::to_string(worker); }

void BackendChooser::publish(collectives::Store& store) {
  const CommBackend b = s_.options.backend;
  const char* asks = b == CommBackend::kGloo ? "gloo" : b == CommBackend::kNccl ? "nccl" : "auto";
  const std::string where =
      device_.is_cuda() ? collectives::cudaDeviceUuid(device_.index()) : std::string("cpu");
  store.set(key(s_.worker()), collectives::toBytes(where + " " + asks));
}

// Whether the workers `members` use one NCCL communicator: each is on a GPU of its own (NCCL
// refuses two ranks of one communicator on the same GPU) and none asks for Gloo. Decided from
// what every member published, so that all decide alike. *why says why (not).
bool BackendChooser::ncclChosen(collectives::Store& store, const std::vector<int>& members,
                                std::string* why) {
  if (!SINEW_WITH_NCCL) {
    *why = "Sinew was built without NCCL";
    return false;
  }
  std::map<std::string, int> owner;
  for (int w : members) {
    const std::string published = collectives::toString(store.get(key(w), s_.opTimeout()));
    const size_t space = published.find(' ');
    const std::string id = published.substr(0, space);
    const std::string asks = space == std::string::npos ? "auto" : published.substr(space + 1);
    if (asks == "gloo") {
      *why = "worker " + std::to_string(w) + " asks for Gloo (TrainerOptions::backend)";
      return false;
    }
    if (id == "cpu") {
      *why = "worker " + std::to_string(w) + " trains on the CPU";
      return false;
    }
    auto [it, fresh] = owner.emplace(id, w);
    if (!fresh) {
      *why = "workers " + std::to_string(it->second) + " and " + std::to_string(w) + " share GPU " +
             id + ", and NCCL needs a GPU per worker";
      return false;
    }
  }
  *why = "every worker has a GPU of its own";
  return true;
}

std::unique_ptr<collectives::Communicator> BackendChooser::make(
    const std::shared_ptr<collectives::Store>& store, collectives::CommunicatorOptions co,
    const collectives::GlooOptions& gloo) {
  const CommBackend asked = s_.options.backend;
  std::string why = "this worker trains on the CPU";
  // A CPU worker needs no one else's word: NCCL needs every member on a GPU.
  const bool nccl = device_.is_cuda() && ncclChosen(*store, co.members, &why);
  if (asked == CommBackend::kNccl && !nccl) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::backend is kNccl, but communicator '", co.name,
                "' of epoch ", co.epoch, " cannot use NCCL: ", why);
  }
  const std::string backend = nccl ? "nccl" : "gloo";
  // CPU jobs with the default backend say nothing new (their output is as before).
  const bool report = device_.is_cuda() || asked != CommBackend::kAuto;
  if (co.name == "dp" || co.name == "pp") {
    if (report && (backend != backend_ || why != backendWhy_)) {
      nlohmann::json e = {
          {"event", "backend"}, {"epoch", co.epoch}, {"backend", backend}, {"reason", why}};
      if (nccl) e["membership_change"] = collectives::ncclMembershipChange();
      s_.event(e);
      if (co.members.front() == s_.worker()) {
        std::printf("sinew: epoch %lld transfers over %s%s (%s)\n",
                    static_cast<long long>(co.epoch), backend.c_str(),
                    !nccl && device_.is_cuda() ? " through host memory" : "", why.c_str());
        std::fflush(stdout);
      }
    }
    backend_ = backend;
    backendWhy_ = why;
  }
  if (nccl) {
    co.device = device_.index();
    return collectives::createNcclCommunicator(store, co);
  }
  return device_.is_cuda() ? collectives::createHostStagedCommunicator(store, co, gloo)
                           : collectives::createGlooCommunicator(store, co, gloo);
}

}  // namespace runtime
}  // namespace sinew
