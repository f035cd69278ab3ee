#pragma once

// An etcd cluster on loopback for tests (docs/ha.md): each member its own process (Debian's
// etcd-server), its own data directory and its own client and peer ports. Members are killed,
// stopped and restarted by PID only. Tests skip when etcd is not installed.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fs_support.h"
#include "sinew/collectives/etcd_client.h"

namespace sinew {
namespace testing {

// Starts argv[0] (a path) with `env` added, its stdout and stderr appended to `log`; returns
// its pid. Tests and benchmarks kill what it starts by that pid only.
inline pid_t spawnLogged(const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env, const std::string& log) {
  pid_t pid = ::fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "a");
    if (f) {
      ::dup2(fileno(f), 1);
      ::dup2(fileno(f), 2);
    }
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

// The etcd binary, or "" when it is not installed.
inline std::string etcdPath() {
  for (const char* p : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "";
}

// A port nobody listens on now (bound to 0, read, closed): good enough on loopback.
inline uint16_t freeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("no free loopback port");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// Certificates for a TLS test cluster, made with the openssl command in `dir`: a CA, the
// members' certificate (IP SAN 127.0.0.1) and a client certificate, both signed by the CA,
// and a second CA that signed nothing here. Throws when openssl fails.
struct TestPki {
  std::string ca, serverCert, serverKey, clientCert, clientKey, otherCa;
};
inline TestPki makeTestPki(const std::string& dir) {
  auto run = [&](const std::string& cmd) {
    const std::string full = "cd '" + dir + "' && " + cmd + " >>openssl.log 2>&1";
    if (std::system(full.c_str()) != 0) throw std::runtime_error("openssl failed: " + cmd);
  };
  const std::string days = " -days 2";
  run("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -subj /CN=sinew-ca" +
      days);
  run("openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other.pem "
      "-subj /CN=other-ca" +
      days);
  std::ofstream(dir + "/server.ext") << "subjectAltName=IP:127.0.0.1\n"
                                     << "extendedKeyUsage=serverAuth,clientAuth\n";
  run("openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=etcd");
  run("openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
      "-out server.pem -extfile server.ext" +
      days);
  std::ofstream(dir + "/client.ext") << "extendedKeyUsage=clientAuth\n";
  run("openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=root");
  run("openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
      "-out client.pem -extfile client.ext" +
      days);
  return {dir + "/ca.pem",     dir + "/server.pem", dir + "/server.key",
          dir + "/client.pem", dir + "/client.key", dir + "/other.pem"};
}

class EtcdCluster {
 public:
  struct Member {
    std::string name;
    uint16_t client = 0;
    uint16_t peer = 0;
    pid_t pid = -1;
    bool stopped = false;
  };

  // Starts `size` members and waits until the cluster answers (throws after 30 s). With
  // `tls`, clients must use https, trust its CA and present a certificate it signed; `pki`
  // makes the certificates in the cluster's folder.
  explicit EtcdCluster(int size = 3, bool tls = false,
                       const std::function<TestPki(const std::string&)>& pki = makeTestPki)
      : tls_(tls) {
    // Data on tmpfs where there is one: etcd fsyncs its log on every write and election, and
    // on a disk still writing back a build a single fsync took seconds (a put after losing a
    // member then missed its 3 s deadline). The tests are about Sinew over etcd, not etcd's
    // own durability; a killed member still finds its data when it restarts.
    std::string tmpl = (::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    tmpl += "/sinew-etcd-XXXXXX";
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
    // The certificates first: making them takes a second or two, and a port picked before
    // that can be taken by then (CI saw etcd fail with "address already in use").
    if (tls_) pki_ = pki(dir_);
    // Distinct ports: the kernel may hand out a port it just handed out and saw closed.
    std::set<uint16_t> taken;
    auto distinctPort = [&taken] {
      uint16_t port = freeLoopbackPort();
      while (!taken.insert(port).second) port = freeLoopbackPort();
      return port;
    };
    for (int i = 0; i < size; ++i) {
      Member m;
      m.name = "m" + std::to_string(i);
      m.client = distinctPort();
      m.peer = distinctPort();
      members_.push_back(m);
    }
    for (int i = 0; i < size; ++i) launch(i, /*fresh=*/true);
    if (!waitHealthy(std::chrono::seconds(30))) {
      stopAll();  // the destructor does not run after a throw
      throw std::runtime_error("etcd did not start (logs in " + dir_ + ")");
    }
  }

  ~EtcdCluster() {
    stopAll();
    removeTree(dir_);
  }

  void stopAll() {
    for (auto& m : members_) {
      if (m.pid > 0) {
        ::kill(m.pid, SIGKILL);
        ::waitpid(m.pid, nullptr, 0);
        m.pid = -1;
      }
    }
  }

  int size() const { return static_cast<int>(members_.size()); }
  const Member& member(int i) const { return members_.at(i); }
  const std::string& dir() const { return dir_; }
  const TestPki& pki() const { return pki_; }

  // "127.0.0.1:p0,127.0.0.1:p1,..." (all members, dead or alive; https:// with TLS).
  std::string endpoints() const {
    std::string out;
    for (const auto& m : members_) {
      out += (out.empty() ? "" : ",") + std::string(tls_ ? "https://" : "") +
             std::string("127.0.0.1:") + std::to_string(m.client);
    }
    return out;
  }
  // With TLS: the CA and the client certificate too.
  collectives::EtcdOptions options() const {
    collectives::EtcdOptions o;
    o.endpoints = collectives::parseEtcdEndpoints(endpoints(), "test cluster");
    if (tls_) {
      o.caFile = pki_.ca;
      o.certFile = pki_.clientCert;
      o.keyFile = pki_.clientKey;
    }
    return o;
  }
  // Credentials for the cluster's requests from now on (after EtcdClient::enableAuth).
  void setCredentials(const std::string& user, const std::string& password) {
    user_ = user;
    password_ = password;
  }

  void kill(int i) {
    auto& m = members_.at(i);
    if (m.pid <= 0) return;
    ::kill(m.pid, SIGKILL);
    ::waitpid(m.pid, nullptr, 0);
    m.pid = -1;
  }
  void stop(int i) {
    ::kill(members_.at(i).pid, SIGSTOP);
    members_.at(i).stopped = true;
  }
  void cont(int i) {
    ::kill(members_.at(i).pid, SIGCONT);
    members_.at(i).stopped = false;
  }
  // Starts a killed member again on its data directory.
  void restart(int i) { launch(i, /*fresh=*/false); }

  // Whether a write goes through within the timeout.
  bool waitHealthy(std::chrono::milliseconds timeout) {
    auto o = options();
    o.user = user_;
    o.password = password_;
    o.timeout = std::chrono::milliseconds(1000);
    collectives::EtcdClient c(o);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      try {
        c.put("/health", "ok");
        return true;
      } catch (const std::exception&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    return false;
  }

 private:
  void launch(int i, bool fresh) {
    auto& m = members_.at(i);
    std::string cluster;
    for (const auto& o : members_) {
      cluster +=
          (cluster.empty() ? "" : ",") + o.name + "=http://127.0.0.1:" + std::to_string(o.peer);
    }
    const std::string clientUrl =
        std::string(tls_ ? "https" : "http") + "://127.0.0.1:" + std::to_string(m.client);
    const std::string peerUrl = "http://127.0.0.1:" + std::to_string(m.peer);
    std::vector<std::string> argv = {
        etcdPath(),
        "--name=" + m.name,
        "--data-dir=" + dir_ + "/" + m.name,
        "--listen-client-urls=" + clientUrl,
        "--advertise-client-urls=" + clientUrl,
        "--listen-peer-urls=" + peerUrl,
        "--initial-advertise-peer-urls=" + peerUrl,
        "--initial-cluster=" + cluster,
        std::string("--initial-cluster-state=") + (fresh ? "new" : "existing"),
        "--initial-cluster-token=sinew-test",
        "--heartbeat-interval=50",
        "--election-timeout=500",
        "--logger=zap",
        "--log-level=error"};
    if (tls_) {
      for (const std::string& flag :
           {"--cert-file=" + pki_.serverCert, "--key-file=" + pki_.serverKey,
            "--trusted-ca-file=" + pki_.ca, std::string("--client-cert-auth")}) {
        argv.push_back(flag);
      }
    }
    m.pid = spawnLogged(argv, {}, dir_ + "/" + m.name + ".log");
  }

  std::string dir_;
  std::vector<Member> members_;
  bool tls_ = false;
  TestPki pki_;
  std::string user_, password_;
};

}  // namespace testing
}  // namespace sinew
