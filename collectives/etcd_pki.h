#pragma once

// Certificates made for one job (docs/ha.md, "Security"): the etcd members a job starts itself
// (SINEW_HA=1) speak TLS with certificates of a certificate authority that exists only for
// that launch. Rank 0 makes the authority and hands it to every rank over MPI; each rank that
// hosts a member issues that member's certificate for its own address. A client trusts only
// the job's authority, and a member accepts only peers with a certificate it issued.
//
// ECDSA P-256 keys, SHA-256 signatures (OpenSSL 3), PEM text. Thread-safe (no shared state).

#include <string>

namespace sinew {
namespace collectives {

struct PemCertificate {
  std::string cert;  // PEM "CERTIFICATE"
  std::string key;   // PEM "PRIVATE KEY" (PKCS#8)
};

// A self-signed authority named `name`, valid for `days` from an hour ago. Throws IoError
// naming OpenSSL's reason when a step fails.
PemCertificate makeCertificateAuthority(const std::string& name, int days = 365);

// A certificate for `host` (an IP address: an IP SAN; a name: a DNS SAN) signed by `ca`, good
// for TLS servers and clients (an etcd member uses one for both, towards its peers). Throws
// InvalidArgument when `ca` does not parse, IoError when a step fails.
PemCertificate issueCertificate(const PemCertificate& ca, const std::string& host, int days = 365);

}  // namespace collectives
}  // namespace sinew
