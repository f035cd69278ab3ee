#include "sinew/collectives/etcd_pki.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <boost/asio/ip/address.hpp>

#include <memory>

#include "sinew/base/error.h"

namespace sinew {
namespace collectives {

namespace {

struct Free {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
  void operator()(X509* p) const { X509_free(p); }
  void operator()(BIO* p) const { BIO_free(p); }
  void operator()(X509_EXTENSION* p) const { X509_EXTENSION_free(p); }
};
template <class T>
using Owned = std::unique_ptr<T, Free>;

// Throws IoError with OpenSSL's newest reason when `ok` is false.
void check(bool ok, const char* step) {
  if (ok) return;
  char reason[256] = "no reason given";
  if (unsigned long e = ERR_get_error()) ERR_error_string_n(e, reason, sizeof(reason));
  ERR_clear_error();
  SINEW_THROW(IoError, "making a certificate: ", step, " failed (OpenSSL: ", reason, ")");
}

std::string pemOf(X509* cert) {
  Owned<BIO> bio(BIO_new(BIO_s_mem()));
  check(bio && PEM_write_bio_X509(bio.get(), cert) == 1, "PEM_write_bio_X509");
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

std::string pemOf(EVP_PKEY* key) {
  Owned<BIO> bio(BIO_new(BIO_s_mem()));
  check(bio && PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) == 1,
        "PEM_write_bio_PrivateKey");
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

void addExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  Owned<X509_EXTENSION> ext(X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str()));
  check(ext && X509_add_ext(cert, ext.get(), -1) == 1, "X509_add_ext");
}

// A certificate for `key` named `name`, valid for `days`, with a random 64-bit serial; the
// issuer and signature are set by the caller.
Owned<X509> newCertificate(EVP_PKEY* key, const std::string& name, int days) {
  Owned<X509> cert(X509_new());
  check(cert && X509_set_version(cert.get(), 2) == 1, "X509_set_version");
  unsigned char serial[8];
  check(RAND_bytes(serial, sizeof(serial)) == 1, "RAND_bytes");
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof(serial), nullptr);
  check(bn != nullptr && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get())) != nullptr,
        "the serial number");
  BN_free(bn);
  check(X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600) != nullptr, "notBefore");
  check(X509_gmtime_adj(X509_getm_notAfter(cert.get()), int64_t(days) * 86400) != nullptr,
        "notAfter");
  check(X509_set_pubkey(cert.get(), key) == 1, "X509_set_pubkey");
  X509_NAME* subject = X509_get_subject_name(cert.get());
  check(X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_UTF8,
                                   reinterpret_cast<const unsigned char*>(name.c_str()), -1, -1,
                                   0) == 1,
        "the subject name");
  return cert;
}

Owned<EVP_PKEY> newKey() {
  Owned<EVP_PKEY> key(EVP_EC_gen("P-256"));
  check(key != nullptr, "EVP_EC_gen(P-256)");
  return key;
}

}  // namespace

PemCertificate makeCertificateAuthority(const std::string& name, int days) {
  Owned<EVP_PKEY> key = newKey();
  Owned<X509> cert = newCertificate(key.get(), name, days);
  check(X509_set_issuer_name(cert.get(), X509_get_subject_name(cert.get())) == 1,
        "X509_set_issuer_name");
  addExtension(cert.get(), cert.get(), NID_basic_constraints, "critical,CA:TRUE");
  addExtension(cert.get(), cert.get(), NID_key_usage, "critical,keyCertSign,cRLSign");
  addExtension(cert.get(), cert.get(), NID_subject_key_identifier, "hash");
  check(X509_sign(cert.get(), key.get(), EVP_sha256()) > 0, "X509_sign");
  return {pemOf(cert.get()), pemOf(key.get())};
}

PemCertificate issueCertificate(const PemCertificate& ca, const std::string& host, int days) {
  Owned<BIO> certBio(BIO_new_mem_buf(ca.cert.data(), static_cast<int>(ca.cert.size())));
  Owned<X509> caCert(PEM_read_bio_X509(certBio.get(), nullptr, nullptr, nullptr));
  Owned<BIO> keyBio(BIO_new_mem_buf(ca.key.data(), static_cast<int>(ca.key.size())));
  Owned<EVP_PKEY> caKey(PEM_read_bio_PrivateKey(keyBio.get(), nullptr, nullptr, nullptr));
  if (!caCert || !caKey) {
    ERR_clear_error();
    SINEW_THROW(InvalidArgument,
                "the certificate authority's PEM certificate or key does not "
                "parse");
  }
  Owned<EVP_PKEY> key = newKey();
  Owned<X509> cert = newCertificate(key.get(), host, days);
  check(X509_set_issuer_name(cert.get(), X509_get_subject_name(caCert.get())) == 1,
        "X509_set_issuer_name");
  boost::system::error_code notIp;
  boost::asio::ip::make_address(host, notIp);
  addExtension(cert.get(), caCert.get(), NID_subject_alt_name, (notIp ? "DNS:" : "IP:") + host);
  addExtension(cert.get(), caCert.get(), NID_basic_constraints, "critical,CA:FALSE");
  addExtension(cert.get(), caCert.get(), NID_key_usage, "critical,digitalSignature");
  addExtension(cert.get(), caCert.get(), NID_ext_key_usage, "serverAuth,clientAuth");
  addExtension(cert.get(), caCert.get(), NID_authority_key_identifier, "keyid");
  check(X509_sign(cert.get(), caKey.get(), EVP_sha256()) > 0, "X509_sign");
  return {pemOf(cert.get()), pemOf(key.get())};
}

}  // namespace collectives
}  // namespace sinew
