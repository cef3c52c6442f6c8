// TestPki: certificates for TLS tests, made with the openssl CLI in a directory the caller owns:
// two CAs ("ca", "other-ca") and leaf certificates. Signed by "ca": "server" (CN localhost,
// SAN IP:127.0.0.1 and localhost), "expired" (the same, expired before it was issued),
// "elsewhere" (SAN elsewhere.example only), "node7" (a client certificate, CN node7); signed
// by "other-ca": "rogue" (CN node7). pem(name) and key(name) are the PEM files.
// Thread-safety: build once, then read-only.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace gpulazy::testing {

class TestPki {
 public:
  explicit TestPki(const std::filesystem::path& dir) : dir_(dir) {
    ok_ = MakeCa("ca") && MakeCa("other-ca") &&
          MakeLeaf("server", "ca", "localhost", "IP:127.0.0.1,DNS:localhost", 2) &&
          MakeLeaf("expired", "ca", "localhost", "IP:127.0.0.1,DNS:localhost", -1) &&
          MakeLeaf("elsewhere", "ca", "elsewhere.example", "DNS:elsewhere.example", 2) &&
          MakeLeaf("node7", "ca", "node7", "DNS:node7", 2) &&
          MakeLeaf("rogue", "other-ca", "node7", "DNS:node7", 2);
  }
  // False when openssl failed; log() says how.
  bool ok() const { return ok_; }
  const std::string& log() const { return log_; }
  std::string pem(const std::string& name) const { return (dir_ / (name + ".pem")).string(); }
  std::string key(const std::string& name) const { return (dir_ / (name + ".key")).string(); }

 private:
  bool Openssl(const std::string& args) {
    FILE* pipe = ::popen(("timeout 60 openssl " + args + " 2>&1").c_str(), "r");
    if (pipe == nullptr) return false;
    char buffer[4096];
    size_t n = 0;
    while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0)
      log_.append(buffer, n);
    const int status = ::pclose(pipe);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  bool MakeCa(const std::string& name) {
    return Openssl("req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " +
                   key(name) + " -out " + pem(name) + " -days 2 -subj /CN=gpulazy-test-" + name);
  }
  // days < 0 makes a certificate that expired before it was issued.
  bool MakeLeaf(const std::string& name, const std::string& ca, const std::string& cn,
                const std::string& san, int days) {
    const std::filesystem::path csr = dir_ / (name + ".csr");
    const std::filesystem::path ext = dir_ / (name + ".ext");
    std::ofstream(ext) << "subjectAltName=" << san << "\n";
    return Openssl("req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " +
                   key(name) + " -out " + csr.string() + " -subj /CN=" + cn) &&
           Openssl("x509 -req -in " + csr.string() + " -CA " + pem(ca) + " -CAkey " + key(ca) +
                   " -CAcreateserial -out " + pem(name) + " -days " + std::to_string(days) +
                   " -extfile " + ext.string());
  }

  std::filesystem::path dir_;
  bool ok_ = false;
  std::string log_;
};

}  // namespace gpulazy::testing
