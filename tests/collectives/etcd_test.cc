// The etcd client and EtcdStore (docs/ha.md) against a real three-member etcd cluster on
// loopback: the gateway's key-value, transaction, lease and watch calls; the Store contract;
// concurrent adds from several threads; and the loss of members: one member killed (requests
// move on), two killed (requests time out naming etcd, nothing written is lost), one back
// (requests go through again).

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <thread>

#include "../etcd_support.h"
#include "sinew/base/error.h"
#include "sinew/collectives/etcd_client.h"
#include "sinew/collectives/etcd_pki.h"
#include "sinew/collectives/etcd_store.h"

namespace sinew {
namespace collectives {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using sinew::testing::EtcdCluster;

#define SKIP_WITHOUT_ETCD()                                                                \
  if (sinew::testing::etcdPath().empty()) {                                                \
    GTEST_SKIP()                                                                           \
        << "etcd is not installed (apt-get install etcd-server; scripts/install-deps.sh)"; \
  }

class EtcdTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!sinew::testing::etcdPath().empty()) cluster_ = new EtcdCluster(3);
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  static EtcdCluster* cluster_;
};
EtcdCluster* EtcdTest::cluster_ = nullptr;

TEST(EtcdEndpointsTest, ParsesAndNamesBadEntries) {
  auto eps = parseEtcdEndpoints("127.0.0.1:2379,http://localhost:22379", "SINEW_ETCD");
  ASSERT_EQ(eps.size(), 2u);
  EXPECT_EQ(eps[1].host, "localhost");
  EXPECT_EQ(eps[1].port, 22379);
  try {
    parseEtcdEndpoints("127.0.0.1:2379,nope", "SINEW_ETCD");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("SINEW_ETCD"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'nope'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parseEtcdEndpoints("h:0", "x"), InvalidArgument);
  EXPECT_THROW(parseEtcdEndpoints("h:99999", "x"), InvalidArgument);
  EXPECT_THROW(EtcdClient{EtcdOptions{}}, InvalidArgument);
}

TEST(EtcdEndpointsTest, NoMemberIsATimeoutNamingEtcd) {
  EtcdOptions o;
  o.endpoints = {{"127.0.0.1", sinew::testing::freeLoopbackPort()}};
  o.timeout = 300ms;
  EtcdClient c(o);
  const auto start = Clock::now();
  try {
    c.put("k", "v");
    FAIL() << "no error";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("etcd"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 2s);
}

TEST_F(EtcdTest, KeyValueTransactionsAndPrefixes) {
  SKIP_WITHOUT_ETCD();
  EtcdClient c(cluster_->options());
  std::string binary("a\0b\xff\x01", 5);
  const int64_t rev = c.put("/t/kv/a", binary);
  auto kv = c.get("/t/kv/a");
  ASSERT_TRUE(kv);
  EXPECT_EQ(kv->value, binary);
  EXPECT_EQ(kv->modRevision, rev);
  EXPECT_EQ(kv->createRevision, rev);
  EXPECT_EQ(kv->version, 1);
  EXPECT_FALSE(c.get("/t/kv/absent"));
  c.put("/t/kv/b", "2");
  c.put("/t/kv0", "outside the prefix");
  auto all = c.getPrefix("/t/kv/");
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].key, "/t/kv/a");
  EXPECT_EQ(all[1].value, "2");

  // A transaction runs its success branch only when every compare holds.
  EtcdCompare isTwo{"/t/kv/b", EtcdCompare::Target::kValue, EtcdCompare::Op::kEqual, 0, "2"};
  auto r = c.txn({isTwo}, {EtcdOp::put("/t/kv/b", "3"), EtcdOp::get("/t/kv/b")},
                 {EtcdOp::get("/t/kv/b")});
  EXPECT_TRUE(r.succeeded);
  ASSERT_EQ(r.gets.size(), 1u);
  EXPECT_EQ(r.gets[0]->value, "3");
  r = c.txn({isTwo}, {EtcdOp::put("/t/kv/b", "4")}, {EtcdOp::get("/t/kv/b")});
  EXPECT_FALSE(r.succeeded);
  EXPECT_EQ(r.gets[0]->value, "3");
  EtcdCompare absent{"/t/kv/new", EtcdCompare::Target::kCreateRevision, EtcdCompare::Op::kEqual, 0,
                     ""};
  EXPECT_TRUE(c.txn({absent}, {EtcdOp::put("/t/kv/new", "x")}).succeeded);
  EXPECT_FALSE(c.txn({absent}, {EtcdOp::put("/t/kv/new", "y")}).succeeded);
  EXPECT_EQ(c.get("/t/kv/new")->value, "x");

  EXPECT_EQ(c.deleteKey("/t/kv/a"), 1);
  EXPECT_EQ(c.deleteKey("/t/kv/a"), 0);
  EXPECT_EQ(c.deletePrefix("/t/kv/"), 2);
  EXPECT_TRUE(c.get("/t/kv0"));
}

TEST_F(EtcdTest, LeasesBindKeysAndEnd) {
  SKIP_WITHOUT_ETCD();
  EtcdClient c(cluster_->options());
  int64_t granted = 0;
  const int64_t lease = c.grantLease(1, &granted);
  EXPECT_GE(granted, 1);
  c.put("/t/lease/k", "v", lease);
  EXPECT_EQ(c.get("/t/lease/k")->lease, lease);
  EXPECT_GT(c.keepAlive(lease), 0);
  c.revokeLease(lease);
  EXPECT_FALSE(c.get("/t/lease/k")) << "a revoked lease's keys are deleted";
  EXPECT_EQ(c.keepAlive(lease), 0) << "a revoked lease cannot be renewed";
  c.revokeLease(lease);  // Already gone: no error.

  // A lease nobody renews ends by itself after its TTL, and takes its keys with it.
  const int64_t shortLease = c.grantLease(1, &granted);
  c.put("/t/lease/short", "v", shortLease);
  const auto start = Clock::now();
  while (c.get("/t/lease/short") && Clock::now() - start < 10s) std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(c.get("/t/lease/short"));
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(granted * 1000 / 2));
}

TEST_F(EtcdTest, WatchSeesChangesFromARevisionAndTimesOut) {
  SKIP_WITHOUT_ETCD();
  EtcdClient c(cluster_->options());
  int64_t rev = 0;
  EXPECT_FALSE(c.get("/t/watch/k", &rev));
  // A change made before the watch starts is still seen, because the watch starts at rev + 1.
  c.put("/t/watch/k", "early");
  auto events = c.watch("/t/watch/k", false, rev + 1, 2s);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0].kv.value, "early");
  EXPECT_FALSE(events[0].deleted);

  // A change from another thread wakes a waiting watch.
  c.get("/t/watch/k", &rev);
  std::thread writer([&] {
    std::this_thread::sleep_for(200ms);
    EtcdClient other(cluster_->options());
    other.deleteKey("/t/watch/k");
  });
  const auto start = Clock::now();
  events = c.watch("/t/watch/k", false, rev + 1, 5s);
  writer.join();
  ASSERT_FALSE(events.empty());
  EXPECT_TRUE(events[0].deleted);
  EXPECT_LT(Clock::now() - start, 3s);

  // Prefix watches, and a watch with nothing to see ends empty at its deadline.
  c.get("/t/watch/", &rev);
  c.put("/t/watch/p/x", "1");
  events = c.watch("/t/watch/p/", true, rev + 1, 2s);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0].kv.key, "/t/watch/p/x");
  c.get("/t/watch/", &rev);
  const auto quiet = Clock::now();
  EXPECT_TRUE(c.watch("/t/watch/nothing", false, rev + 1, 300ms).empty());
  EXPECT_GE(Clock::now() - quiet, 250ms);
  EXPECT_LT(Clock::now() - quiet, 3s);
}

TEST_F(EtcdTest, StoreContract) {
  SKIP_WITHOUT_ETCD();
  auto client = std::make_shared<EtcdClient>(cluster_->options());
  EtcdStore s(client, "/t/store/");
  EtcdStore other(std::make_shared<EtcdClient>(cluster_->options()), "/t/store/");
  s.set("a", toBytes("1"));
  EXPECT_EQ(toString(other.get("a", 1s)), "1");
  Bytes binary(300 * 1024);
  for (size_t i = 0; i < binary.size(); ++i) binary[i] = static_cast<uint8_t>(i * 131 + 7);
  s.set("bin", binary);
  EXPECT_EQ(other.get("bin", 1s), binary);
  s.set("empty", Bytes());
  EXPECT_TRUE(s.get("empty", 1s).empty());
  EXPECT_TRUE(s.check({"a", "empty"}));
  EXPECT_FALSE(s.check({"a", "nope"}));

  EXPECT_EQ(s.add("n", 5), 5);
  EXPECT_EQ(other.add("n", -2), 3);
  s.set("text", toBytes("x"));
  EXPECT_THROW(s.add("text", 1), InvalidArgument);

  EXPECT_EQ(toString(s.compareSet("cs", Bytes(), toBytes("first"))), "first");
  EXPECT_EQ(toString(s.compareSet("cs", Bytes(), toBytes("second"))), "first");
  EXPECT_EQ(toString(s.compareSet("cs", toBytes("first"), toBytes("third"))), "third");
  EXPECT_TRUE(s.compareSet("absent", toBytes("x"), toBytes("y")).empty());
  EXPECT_FALSE(s.check({"absent"}));

  EXPECT_TRUE(s.deleteKey("a"));
  EXPECT_FALSE(s.deleteKey("a"));

  // A wait ends at its deadline naming what is missing, and wakes at once on a set.
  auto start = Clock::now();
  try {
    s.wait({"empty", "missing"}, 300ms);
    FAIL() << "no timeout";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("'missing'"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 3s);
  std::thread setter([&] {
    std::this_thread::sleep_for(300ms);
    other.set("late", toBytes("here"));
  });
  start = Clock::now();
  EXPECT_EQ(toString(s.get("late", 10s)), "here");
  setter.join();
  EXPECT_LT(Clock::now() - start, 3s);
}

TEST_F(EtcdTest, ConcurrentAddsAreExact) {
  SKIP_WITHOUT_ETCD();
  constexpr int kThreads = 4, kAdds = 40;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      EtcdStore s(std::make_shared<EtcdClient>(cluster_->options()), "/t/adds/");
      for (int i = 0; i < kAdds; ++i) s.add("counter", 1);
    });
  }
  for (auto& t : threads) t.join();
  EtcdStore s(std::make_shared<EtcdClient>(cluster_->options()), "/t/adds/");
  EXPECT_EQ(s.add("counter", 0), kThreads * kAdds);
}

// Its own cluster: members die here.
TEST(EtcdFaultTest, OneMemberLostIsNothingTwoPauseAndNothingWrittenIsLost) {
  SKIP_WITHOUT_ETCD();
  EtcdCluster cluster(3);
  auto o = cluster.options();
  o.timeout = 3s;
  auto client = std::make_shared<EtcdClient>(o);
  EtcdStore s(client, "/t/fault/");
  s.set("before", toBytes("1"));
  // The client talks to member 0 first: kill it; the store goes on through the others.
  cluster.kill(0);
  auto start = Clock::now();
  s.set("one-lost", toBytes("2"));
  EXPECT_EQ(s.add("n", 1), 1);
  EXPECT_EQ(toString(s.get("before", 1s)), "1");
  EXPECT_LT(Clock::now() - start, 3s);

  // Two of three lost: no majority. Requests end with a Timeout naming etcd, not a hang.
  cluster.kill(1);
  start = Clock::now();
  try {
    s.set("no-majority", toBytes("3"));
    FAIL() << "a write without a majority succeeded";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("etcd"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 8s);

  // One member back: the majority returns, and everything written before is there.
  cluster.restart(1);
  ASSERT_TRUE(cluster.waitHealthy(30s));
  EXPECT_EQ(toString(s.get("before", 5s)), "1");
  EXPECT_EQ(toString(s.get("one-lost", 5s)), "2");
  EXPECT_EQ(s.add("n", 1), 2);
}

}  // namespace
}  // namespace collectives
}  // namespace sinew

namespace sinew {
namespace collectives {
namespace {

// `reader` watches `key` from after its current value while `writer` puts `value` there.
void expectWatchSeesPut(EtcdClient& reader, EtcdClient& writer, const std::string& key,
                        const std::string& value) {
  int64_t revision = 0;
  ASSERT_TRUE(reader.get(key, &revision));
  std::thread put([&] {
    std::this_thread::sleep_for(200ms);
    writer.put(key, value);
  });
  auto events = reader.watch(key, false, revision + 1, 5s);
  put.join();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kv.value, value);
}

EtcdOptions withUser(EtcdOptions o, const std::string& user, const std::string& password) {
  o.user = user;
  o.password = password;
  return o;
}

std::string messageOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// etcd's authentication: once it is on (enableAuth, as for the members a job starts itself),
// a client without credentials is refused with an error that says what to set, a wrong
// password is refused naming the user, the right one reads, writes and watches; a token that
// the member's restart made invalid is replaced without the caller noticing; and nobody can
// set up authentication a second time (a root user exists).
TEST(EtcdAuthTest, OnlyTheJobsCredentialsReadOrWrite) {
  SKIP_WITHOUT_ETCD();
  EtcdCluster cluster(1);
  EtcdOptions o = cluster.options();
  o.timeout = 3s;
  EtcdClient admin(o);
  admin.put("/before", "open");
  admin.enableAuth("pw-of-this-job");
  cluster.setCredentials("root", "pw-of-this-job");
  EXPECT_EQ(admin.get("/before")->value, "open");  // as root from now on
  admin.put("/after", "closed");

  EtcdClient stranger(o);
  std::string why = messageOf([&] { stranger.get("/after"); });
  EXPECT_NE(why.find("without authentication"), std::string::npos) << why;
  EXPECT_NE(why.find("SINEW_ETCD_USER"), std::string::npos) << why;
  why = messageOf([&] { stranger.put("/after", "forged"); });
  EXPECT_NE(why.find("without authentication"), std::string::npos) << why;
  why = messageOf([&] { stranger.deleteKey("/after"); });
  EXPECT_NE(why.find("without authentication"), std::string::npos) << why;

  EtcdClient guesser(withUser(o, "root", "a guess"));
  why = messageOf([&] { guesser.get("/after"); });
  EXPECT_NE(why.find("refused to authenticate user 'root'"), std::string::npos) << why;

  EtcdClient member(withUser(o, "root", "pw-of-this-job"));
  EXPECT_EQ(member.get("/after")->value, "closed");
  expectWatchSeesPut(member, admin, "/after", "changed");

  // etcd's simple tokens do not survive the member's restart: the client authenticates again.
  cluster.kill(0);
  cluster.restart(0);
  ASSERT_TRUE(cluster.waitHealthy(30s));
  EXPECT_EQ(member.get("/after")->value, "changed");
  EXPECT_EQ(member.watch("/after", false, 1, 2s).size(), 2u);

  why = messageOf([&] { member.enableAuth("another password"); });
  EXPECT_NE(why.find("has a root user already"), std::string::npos) << why;
  EXPECT_EQ(member.get("/after")->value, "changed");
}

// TLS: members that present a certificate of the job's CA and require one from the client
// (etcd --client-cert-auth). The client checks the member's certificate against the CA and
// the endpoint's IP; without its own certificate, with another CA, or in plain HTTP it gets
// nothing, and the error says why.
TEST(EtcdTlsTest, MembersAndClientsProveWhoTheyAre) {
  SKIP_WITHOUT_ETCD();
  if (std::system("openssl version >/dev/null 2>&1") != 0) GTEST_SKIP() << "no openssl command";
  EtcdCluster cluster(1, /*tls=*/true);
  EtcdClient good(cluster.options());
  good.put("/tls", "yes");
  EXPECT_EQ(good.get("/tls")->value, "yes");
  expectWatchSeesPut(good, good, "/tls", "still");

  EtcdOptions otherCa = cluster.options();
  otherCa.caFile = cluster.pki().otherCa;
  otherCa.timeout = 1500ms;
  std::string why = messageOf([&] { EtcdClient(otherCa).get("/tls"); });
  EXPECT_NE(why.find("certificate verify failed"), std::string::npos) << why;

  EtcdOptions noCert = cluster.options();
  noCert.certFile.clear();
  noCert.keyFile.clear();
  noCert.timeout = 1500ms;
  why = messageOf([&] { EtcdClient(noCert).get("/tls"); });
  EXPECT_NE(why.find("TLS: sslv3 alert bad certificate"), std::string::npos) << why;
  EXPECT_EQ(why.find("(no error)"), std::string::npos) << why;

  EtcdOptions plain = cluster.options();
  plain.endpoints[0].tls = false;
  plain.timeout = 1500ms;
  why = messageOf([&] { EtcdClient(plain).get("/tls"); });
  EXPECT_EQ(why.find("(no error)"), std::string::npos) << why;

  EtcdOptions badFiles = cluster.options();
  badFiles.caFile = cluster.dir() + "/missing.pem";
  why = messageOf([&] { EtcdClient c(badFiles); });
  EXPECT_NE(why.find("missing.pem"), std::string::npos) << why;
}

// The certificates a job makes for the etcd members it starts (collectives/etcd_pki.h): a
// member with a certificate issued for 127.0.0.1 by a fresh authority serves a client that
// trusts that authority (and presents a certificate of it); a client that trusts another
// authority gets nothing ("certificate verify failed"); a damaged authority is refused.
TEST(EtcdTlsTest, CertificatesMadeForAJobWork) {
  SKIP_WITHOUT_ETCD();
  auto jobPki = [](const std::string& dir) {
    const PemCertificate ca = makeCertificateAuthority("sinew job test");
    const PemCertificate member = issueCertificate(ca, "127.0.0.1");
    const PemCertificate client = issueCertificate(ca, "127.0.0.1");
    const PemCertificate other = makeCertificateAuthority("another job");
    sinew::testing::TestPki p{dir + "/ca.pem",     dir + "/server.pem", dir + "/server.key",
                              dir + "/client.pem", dir + "/client.key", dir + "/other.pem"};
    std::ofstream(p.ca) << ca.cert;
    std::ofstream(p.serverCert) << member.cert;
    std::ofstream(p.serverKey) << member.key;
    std::ofstream(p.clientCert) << client.cert;
    std::ofstream(p.clientKey) << client.key;
    std::ofstream(p.otherCa) << other.cert;
    return p;
  };
  EtcdCluster cluster(1, /*tls=*/true, jobPki);
  EtcdClient good(cluster.options());
  good.put("/job-tls", "yes");
  EXPECT_EQ(good.get("/job-tls")->value, "yes");

  EtcdOptions otherCa = cluster.options();
  otherCa.caFile = cluster.pki().otherCa;
  otherCa.timeout = 1500ms;
  const std::string why = messageOf([&] { EtcdClient(otherCa).get("/job-tls"); });
  EXPECT_NE(why.find("certificate verify failed"), std::string::npos) << why;

  PemCertificate damaged = makeCertificateAuthority("x");
  damaged.key = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
  EXPECT_THROW(issueCertificate(damaged, "127.0.0.1"), InvalidArgument);
  EXPECT_NE(issueCertificate(makeCertificateAuthority("y"), "etcd.example").cert.find("BEGIN"),
            std::string::npos);
}

}  // namespace
}  // namespace collectives
}  // namespace sinew
