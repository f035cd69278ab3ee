#include "sinew/runtime/coordinator_client.h"

#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "sinew/runtime/detail/wire.h"

namespace sinew {
namespace runtime {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

class CoordinatorClient::Impl {
 public:
  explicit Impl(CoordinatorClientOptions options)
      : options_(std::move(options)), socket_(io_), heartbeat_(io_) {}

  // Flushes queued messages (e.g. done), for at most a second, then closes.
  ~Impl() {
    asio::post(io_, [this] {
      stopping_ = true;
      heartbeat_.cancel();
      if (out_.empty() || closed_) return closeNow();
      flushThenClose_ = true;
      heartbeat_.expires_after(std::chrono::seconds(1));
      heartbeat_.async_wait([this](error_code) { closeNow(); });
    });
    if (thread_.joinable()) thread_.join();
  }

  void closeNow() {
    closed_ = true;
    heartbeat_.cancel();
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
  }

  void start() {
    connect();
    json hello = {{"worker", options_.worker}, {"node", options_.node}, {"pid", ::getpid()}};
    queue(wire::Type::kHello, -1, hello);
    readHeader();
    scheduleHeartbeat();
    thread_ = std::thread([this] { io_.run(); });
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, options_.connectTimeout, [&] { return welcomed_ || !gone_.empty(); })) {
      SINEW_THROW(Timeout, "coordinator at ", options_.host, ":", options_.port,
                  " did not answer the hello within ", options_.connectTimeout.count(), " ms");
    }
    if (!welcomed_) {
      SINEW_THROW(InvalidArgument, "coordinator at ", options_.host, ":", options_.port,
                  " rejected worker ", options_.worker, ": ", gone_);
    }
  }

  EpochInfo latestEpoch() const {
    std::lock_guard<std::mutex> lock(mu_);
    return epoch_;
  }

  EpochInfo waitEpochAfter(int64_t epoch, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    bool ok = cv_.wait_for(lock, timeout, [&] { return epoch_.epoch > epoch || !gone_.empty(); });
    if (!gone_.empty()) throwGone();
    if (!ok) {
      SINEW_THROW(Timeout, "worker ", worker_, ": no epoch after ", epoch, " was announced within ",
                  timeout.count(), " ms");
    }
    return epoch_;
  }

  VoteResult vote(int64_t epoch, int64_t step, std::chrono::milliseconds timeout) {
    post(wire::Type::kVote, epoch, json{{"step", step}});
    std::unique_lock<std::mutex> lock(mu_);
    bool ok = cv_.wait_for(lock, timeout, [&] {
      return committed_ >= step || epoch_.epoch > epoch || !gone_.empty();
    });
    // A commit precedes any later epoch on the connection, so check it first.
    if (committed_ >= step) {
      return reshapeAfter_ == step ? VoteResult::kCommittedThenReshape : VoteResult::kCommitted;
    }
    if (!gone_.empty()) throwGone();
    if (!ok) {
      SINEW_THROW(Timeout, "worker ", worker_, ": no verdict on step ", step, " of epoch ", epoch,
                  " within ", timeout.count(), " ms");
    }
    return VoteResult::kSuperseded;
  }

  void post(wire::Type type, int64_t epoch, json body) {
    asio::post(io_, [this, type, epoch, body = std::move(body)] { queue(type, epoch, body); });
  }

  void setStep(int64_t step) { step_.store(step); }
  void mute(std::chrono::milliseconds d) {
    std::lock_guard<std::mutex> lock(mu_);
    mutedUntil_ = Clock::now() + d;
  }
  void setListener(std::function<void(int64_t)> l) {
    std::lock_guard<std::mutex> lock(mu_);
    listener_ = std::move(l);
  }

  CoordinatorClientOptions options_;
  int worker_ = -1;
  std::string storeHost_;
  uint16_t storePort_ = 0;

 private:
  [[noreturn]] void throwGone() const {
    if (released_) SINEW_THROW(Released, "worker ", worker_, " left the job: ", gone_);
    SINEW_THROW(Expelled, "worker ", worker_, " must leave the job: ", gone_);
  }

  void connect() {
    auto deadline = Clock::now() + options_.connectTimeout;
    auto backoff = std::chrono::milliseconds(5);
    std::string last;
    while (true) {
      error_code ec;
      tcp::resolver resolver(io_);
      auto endpoints = resolver.resolve(options_.host, std::to_string(options_.port), ec);
      if (!ec) asio::connect(socket_, endpoints, ec);
      if (!ec) {
        socket_.set_option(tcp::no_delay(true), ec);
        return;
      }
      last = ec.message();
      error_code ignored;
      socket_.close(ignored);
      auto now = Clock::now();
      if (now >= deadline) break;
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
    }
    SINEW_THROW(Timeout, "cannot reach the coordinator at ", options_.host, ":", options_.port,
                " within ", options_.connectTimeout.count(), " ms: ", last);
  }

  // io thread only.
  void queue(wire::Type type, int64_t epoch, const json& body) {
    if (closed_) return;
    out_.push_back(wire::encode(type, options_.token, epoch, body));
    if (out_.size() == 1) writeNext();
  }

  void writeNext() {
    asio::async_write(socket_, asio::buffer(out_.front()), [this](error_code ec, size_t) {
      if (ec && stopping_) return closeNow();
      if (ec) return fail("lost the connection to the coordinator: " + ec.message());
      out_.pop_front();
      if (!out_.empty()) return writeNext();
      if (flushThenClose_) closeNow();
    });
  }

  void scheduleHeartbeat() {
    heartbeat_.expires_after(heartbeatInterval_);
    heartbeat_.async_wait([this](error_code ec) {
      // Stopping: the destructor reuses this timer to bound the final flush.
      if (ec || closed_ || stopping_) return;
      bool muted;
      int64_t epoch;
      {
        std::lock_guard<std::mutex> lock(mu_);
        muted = Clock::now() < mutedUntil_;
        epoch = epoch_.epoch;
      }
      if (!muted) queue(wire::Type::kHeartbeat, epoch, json{{"step", step_.load()}});
      scheduleHeartbeat();
    });
  }

  void readHeader() {
    asio::async_read(socket_, asio::buffer(header_), [this](error_code ec, size_t) {
      if (ec) return fail("the coordinator closed the connection (" + ec.message() + ")");
      std::string why;
      if (!wire::decodeHeader(header_.data(), 64u << 20, &h_, &why) || h_.token != options_.token) {
        return fail("malformed message from the coordinator: " +
                    (why.empty() ? std::string("wrong job token") : why));
      }
      payload_.assign(h_.length, 0);
      asio::async_read(socket_, asio::buffer(payload_), [this](error_code ec2, size_t) {
        if (ec2) return fail("the coordinator closed the connection (" + ec2.message() + ")");
        json body;
        std::string why2;
        if (!wire::decodeBody(payload_, &body, &why2)) {
          return fail("malformed message from the coordinator: " + why2);
        }
        try {
          handle(static_cast<wire::Type>(h_.type), body);
        } catch (const std::exception& e) {
          return fail(std::string("bad message from the coordinator: ") + e.what());
        }
        if (!closed_) readHeader();
      });
    });
  }

  void handle(wire::Type type, const json& body) {
    std::function<void(int64_t)> listener;
    int64_t announce = -2;
    {
      std::lock_guard<std::mutex> lock(mu_);
      switch (type) {
        case wire::Type::kWelcome:
          worker_ = body.at("worker").get<int>();
          storeHost_ = body.at("store_host").get<std::string>();
          storePort_ = body.at("store_port").get<uint16_t>();
          heartbeatInterval_ = std::chrono::milliseconds(body.at("heartbeat_ms").get<int64_t>());
          welcomed_ = true;
          break;
        case wire::Type::kEpoch: {
          EpochInfo e;
          e.epoch = body.at("epoch").get<int64_t>();
          e.members = body.at("members").get<std::vector<int>>();
          e.resumeStep = body.at("resume_step").get<int64_t>();
          e.source = body.at("source").get<int>();
          e.joined = body.at("joined").get<std::vector<int>>();
          e.sync = body.at("sync").get<bool>();
          if (e.epoch > epoch_.epoch) {
            epoch_ = e;
            announce = e.epoch;
          }
          break;
        }
        case wire::Type::kCommit: {
          int64_t step = body.at("step").get<int64_t>();
          committed_ = std::max(committed_, step);
          if (body.value("next_epoch", false)) reshapeAfter_ = step;
          break;
        }
        case wire::Type::kReleased:
          gone_ = "released by the coordinator: " + body.value("reason", std::string("?"));
          released_ = true;
          announce = -1;
          closed_ = true;
          break;
        case wire::Type::kExpelled:
          gone_ = "the coordinator expelled it: " + body.value("reason", std::string("?"));
          announce = -1;
          closed_ = true;
          break;
        default:
          throw std::runtime_error(std::string("unexpected ") +
                                   wire::typeName(static_cast<uint8_t>(type)));
      }
      listener = listener_;
    }
    cv_.notify_all();
    if (listener && announce != -2) listener(announce);
  }

  void fail(const std::string& why) {
    if (stopping_) return;
    std::function<void(int64_t)> listener;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gone_.empty()) gone_ = why;
      closed_ = true;
      listener = listener_;
    }
    heartbeat_.cancel();
    error_code ec;
    socket_.close(ec);
    cv_.notify_all();
    if (listener) listener(-1);
  }

  asio::io_context io_;
  tcp::socket socket_;
  asio::steady_timer heartbeat_;
  std::thread thread_;
  std::atomic<int64_t> step_{-1};
  // io thread only.
  std::array<uint8_t, wire::kHeaderBytes> header_{};
  wire::Header h_;
  std::vector<uint8_t> payload_;
  std::deque<std::vector<uint8_t>> out_;
  bool closed_ = false;
  bool stopping_ = false;
  bool flushThenClose_ = false;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  bool welcomed_ = false;
  bool released_ = false;
  std::string gone_;  // why this worker left the job; empty while it is in
  EpochInfo epoch_;
  int64_t committed_ = -1;
  int64_t reshapeAfter_ = -1;
  std::chrono::milliseconds heartbeatInterval_{100};
  Clock::time_point mutedUntil_{};
  std::function<void(int64_t)> listener_;
};

CoordinatorClient::CoordinatorClient(CoordinatorClientOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->start();
}
CoordinatorClient::~CoordinatorClient() = default;
int CoordinatorClient::worker() const { return impl_->worker_; }
const std::string& CoordinatorClient::node() const { return impl_->options_.node; }
const std::string& CoordinatorClient::storeHost() const { return impl_->storeHost_; }
uint16_t CoordinatorClient::storePort() const { return impl_->storePort_; }
EpochInfo CoordinatorClient::latestEpoch() const { return impl_->latestEpoch(); }
EpochInfo CoordinatorClient::waitEpochAfter(int64_t epoch, std::chrono::milliseconds timeout) {
  return impl_->waitEpochAfter(epoch, timeout);
}
CoordinatorClient::VoteResult CoordinatorClient::vote(int64_t epoch, int64_t step,
                                                      std::chrono::milliseconds timeout) {
  return impl_->vote(epoch, step, timeout);
}
void CoordinatorClient::reportLost(int64_t epoch, int worker) {
  impl_->post(wire::Type::kLost, epoch, json{{"worker", worker}});
}
void CoordinatorClient::requestRebuild(int64_t epoch) {
  impl_->post(wire::Type::kRebuild, epoch, json::object());
}
void CoordinatorClient::ready(int64_t resumeStep) {
  impl_->post(wire::Type::kReady, impl_->latestEpoch().epoch, json{{"resume_step", resumeStep}});
}
void CoordinatorClient::leave(int64_t step) {
  impl_->post(wire::Type::kLeave, impl_->latestEpoch().epoch, json{{"step", step}});
}
void CoordinatorClient::done(int64_t step) {
  impl_->post(wire::Type::kDone, impl_->latestEpoch().epoch, json{{"step", step}});
}
void CoordinatorClient::setStep(int64_t step) { impl_->setStep(step); }
void CoordinatorClient::muteHeartbeats(std::chrono::milliseconds d) { impl_->mute(d); }
void CoordinatorClient::setEpochListener(std::function<void(int64_t)> l) {
  impl_->setListener(std::move(l));
}

}  // namespace runtime
}  // namespace sinew
