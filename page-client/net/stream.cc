#include "page-client/net/stream.h"

#include <fcntl.h>
#include <fmt/chrono.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/sha.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <array>
#include <cstdio>
#include <ctime>

#include "lazy-server/image/io.h"
#include "page-client/net/frame_stream.h"

namespace gpulazy::net {
namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
using boost::system::error_code;

namespace {

constexpr size_t kMaxTokenBytes = 4096;
constexpr size_t kMaxTokenListBytes = 64 << 10;

// Refuses everything below TLS 1.2; OpenSSL then picks the highest both ends speak (1.3).
Status RequireModernTls(TlsContext& context) {
  if (SSL_CTX_set_min_proto_version(context.native_handle(), TLS1_2_VERSION) != 1)
    return Internal("OpenSSL refused to set TLS 1.2 as the minimum version");
  context.set_options(ssl::context::default_workarounds | ssl::context::no_compression);
  return Status::Ok();
}

Status LoadIdentity(TlsContext& context, const std::string& cert_file, const std::string& key_file,
                    std::string_view cert_option, std::string_view key_option) {
  error_code ec;
  context.use_certificate_chain_file(cert_file, ec);
  if (ec)
    return InvalidArgument("{} {}: cannot load the certificate: {}", cert_option, cert_file,
                           ec.message());
  context.use_private_key_file(key_file, ssl::context::pem, ec);
  if (ec)
    return InvalidArgument("{} {}: cannot load the private key: {}", key_option, key_file,
                           ec.message());
  if (SSL_CTX_check_private_key(context.native_handle()) != 1)
    return InvalidArgument("{} {} does not match the certificate in {}", key_option, key_file,
                           cert_file);
  return Status::Ok();
}

Status LoadTrust(TlsContext& context, const std::string& ca_file, std::string_view option) {
  error_code ec;
  context.load_verify_file(ca_file, ec);
  if (ec)
    return InvalidArgument("{} {}: cannot load CA certificates: {}", option, ca_file, ec.message());
  return Status::Ok();
}

bool IsTransportClose(const error_code& ec) {
  return ec == asio::error::eof || ec == asio::error::connection_reset ||
         ec == asio::error::broken_pipe || ec == ssl::error::stream_truncated;
}

}  // namespace

Result<std::shared_ptr<TlsContext>> MakeClientTlsContext(const TlsClientOptions& options) {
  if (options.ca_file.empty()) return InvalidArgument("--tls-ca is needed for TLS");
  if (options.cert_file.empty() != options.key_file.empty())
    return InvalidArgument("--tls-cert and --tls-key go together");
  auto context = std::make_shared<TlsContext>(TlsContext::tls_client);
  GPULAZY_RETURN_IF_ERROR(RequireModernTls(*context));
  GPULAZY_RETURN_IF_ERROR(LoadTrust(*context, options.ca_file, "--tls-ca"));
  if (!options.cert_file.empty())
    GPULAZY_RETURN_IF_ERROR(
        LoadIdentity(*context, options.cert_file, options.key_file, "--tls-cert", "--tls-key"));
  context->set_verify_mode(ssl::verify_peer);
  return context;
}

Result<std::shared_ptr<TlsContext>> MakeServerTlsContext(const TlsServerOptions& options) {
  if (options.cert_file.empty() || options.key_file.empty())
    return InvalidArgument("--tls-cert and --tls-key go together");
  auto context = std::make_shared<TlsContext>(TlsContext::tls_server);
  GPULAZY_RETURN_IF_ERROR(RequireModernTls(*context));
  GPULAZY_RETURN_IF_ERROR(
      LoadIdentity(*context, options.cert_file, options.key_file, "--tls-cert", "--tls-key"));
  if (options.client_ca_file.empty()) {
    context->set_verify_mode(ssl::verify_none);
    return context;
  }
  GPULAZY_RETURN_IF_ERROR(LoadTrust(*context, options.client_ca_file, "--tls-client-ca"));
  // Tells clients which CAs we accept, so one holding several certificates picks the right one.
  if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(options.client_ca_file.c_str()))
    SSL_CTX_set_client_CA_list(context->native_handle(), names);
  context->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
  return context;
}

CertificateSummary SummarizeCertificate(TlsContext& context) {
  CertificateSummary summary;
  X509* cert = SSL_CTX_get0_certificate(context.native_handle());
  if (cert == nullptr) return summary;
  std::array<char, 256> subject{};
  X509_NAME_oneline(X509_get_subject_name(cert), subject.data(), static_cast<int>(subject.size()));
  summary.subject = subject.data();
  const ASN1_TIME* not_after = X509_get0_notAfter(cert);
  std::tm end{};
  if (not_after == nullptr || ASN1_TIME_to_tm(not_after, &end) != 1) return summary;
  summary.end = fmt::format("{:%Y-%m-%d %H:%M:%S} UTC", end);
  // Negative: the end of validity lies in the past.
  int days = 0;
  int seconds = 0;
  summary.expired =
      ASN1_TIME_diff(&days, &seconds, nullptr, not_after) == 1 && (days < 0 || seconds < 0);
  return summary;
}

std::string CertificateSummary::ToString() const {
  if (subject.empty()) return "no certificate";
  if (end.empty()) return subject + ", end of validity unreadable";
  return fmt::format("{}, {} {}", subject, expired ? "EXPIRED" : "expires", end);
}

Result<ClientTransport> ClientTransport::Make(const TlsClientOptions& options,
                                              bool allow_insecure_tcp) {
  ClientTransport transport;
  transport.allow_insecure_tcp = allow_insecure_tcp;
  transport.server_name = options.server_name;
  if (!options.enabled()) {
    if (!options.cert_file.empty() || !options.key_file.empty() || !options.server_name.empty())
      return InvalidArgument("--tls-cert, --tls-key and --tls-server-name need --tls-ca");
    return transport;
  }
  GPULAZY_ASSIGN_OR_RETURN(transport.tls, MakeClientTlsContext(options));
  return transport;
}

// ---------------------------------------------------------------------------------------------
// Stream

Stream::Stream(Socket socket) : stream_(std::move(socket)) {}

bool Stream::is_plain_tcp() {
  if (is_tls()) return false;
  if (!plain_tcp_ && is_open()) {
    int domain = 0;
    socklen_t length = sizeof domain;
    if (::getsockopt(socket().native_handle(), SOL_SOCKET, SO_DOMAIN, &domain, &length) == 0)
      plain_tcp_ = domain == AF_INET || domain == AF_INET6;
  }
  return plain_tcp_.value_or(false);
}

Stream::Stream(Socket socket, std::shared_ptr<TlsContext> context, Side side)
    : context_(std::move(context)),
      stream_(std::make_unique<TlsStream>(std::move(socket), *context_)),
      side_(side) {}

Socket& Stream::socket() {
  if (auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_)) return (*tls)->next_layer();
  return std::get<Socket>(stream_);
}

const Socket& Stream::socket() const {
  if (const auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_))
    return (*tls)->next_layer();
  return std::get<Socket>(stream_);
}

Status Stream::ExpectPeerName(const std::string& name) {
  auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_);
  if (!tls) return Status::Ok();
  SSL* ssl = (*tls)->native_handle();
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
  X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
  error_code not_an_address;
  asio::ip::make_address(name, not_an_address);
  if (!not_an_address) {
    // An address is matched against the certificate's IP SANs, never its DNS names.
    if (X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str()) != 1)
      return InvalidArgument("TLS: cannot verify against address '{}'", name);
  } else {
    if (X509_VERIFY_PARAM_set1_host(param, name.c_str(), name.size()) != 1)
      return InvalidArgument("TLS: cannot verify against host name '{}'", name);
    // SNI, so a server with several certificates presents the one for this name.
    SSL_set_tlsext_host_name(ssl, name.c_str());
  }
  (*tls)->set_verify_mode(ssl::verify_peer);
  return Status::Ok();
}

Status Stream::HandshakeError(const error_code& ec) const {
  const auto& tls = std::get<std::unique_ptr<TlsStream>>(stream_);
  // The verification result names the reason a certificate was refused, which the bare SSL
  // error ("certificate verify failed") does not.
  const long verify = SSL_get_verify_result(tls->native_handle());
  const char* side = side_ == Side::kClient ? "server" : "client";
  if (verify != X509_V_OK)
    return PermissionDenied("TLS handshake: {} certificate refused: {}", side,
                            X509_verify_cert_error_string(verify));
  if (IsTransportClose(ec))
    return Unavailable("TLS handshake: connection closed by the {} ({})", side, ec.message());
  if (ec == asio::error::operation_aborted || ec == asio::error::bad_descriptor)
    return Aborted("TLS handshake: cancelled");
  if (ec.category() == asio::error::get_ssl_category()) {
    // What a TLS peer says of bytes that are not TLS records: the other end is not speaking
    // TLS, which is a configuration to name, not a failure to diagnose.
    if (ERR_GET_REASON(static_cast<unsigned long>(ec.value())) == SSL_R_WRONG_VERSION_NUMBER) {
      if (side_ == Side::kClient)
        return PermissionDenied(
            "TLS handshake with the server failed: its answer is not TLS ({}); is it a plain "
            "TCP listener (gpulazy-server --insecure-tcp)? Then connect with --insecure instead "
            "of --tls-ca, or give the server --tls-cert and --tls-key",
            ec.message());
      return PermissionDenied("TLS handshake with the client failed: it does not speak TLS ({})",
                              ec.message());
    }
    return PermissionDenied("TLS handshake with the {} failed: {}", side, ec.message());
  }
  return Unavailable("TLS handshake with the {} failed: {}", side, ec.message());
}

Awaitable<Status> Stream::Handshake() {
  auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_);
  if (!tls) co_return Status::Ok();
  error_code ec;
  co_await (*tls)->async_handshake(
      side_ == Side::kClient ? ssl::stream_base::client : ssl::stream_base::server,
      asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return HandshakeError(ec);
  co_return Status::Ok();
}

Status Stream::HandshakeBlocking() {
  auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_);
  if (!tls) return Status::Ok();
  error_code ec;
  (*tls)->handshake(side_ == Side::kClient ? ssl::stream_base::client : ssl::stream_base::server,
                    ec);
  if (ec) return HandshakeError(ec);
  return Status::Ok();
}

std::string Stream::PeerCommonName() const {
  const auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_);
  if (!tls) return {};
  SSL* ssl = (*tls)->native_handle();
  // Only a certificate that passed verification names anyone.
  if (SSL_get_verify_result(ssl) != X509_V_OK) return {};
  X509* cert = SSL_get0_peer_certificate(ssl);
  if (!cert) return {};
  X509_NAME* subject = X509_get_subject_name(cert);
  const int index = X509_NAME_get_index_by_NID(subject, NID_commonName, -1);
  if (index < 0) return {};
  ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, index));
  unsigned char* utf8 = nullptr;
  const int length = ASN1_STRING_to_UTF8(&utf8, data);
  if (length < 0) return {};
  std::unique_ptr<unsigned char, void (*)(unsigned char*)> owned(
      utf8, [](unsigned char* p) { OPENSSL_free(p); });
  return std::string(reinterpret_cast<const char*>(owned.get()), static_cast<size_t>(length));
}

// ---------------------------------------------------------------------------------------------
// Connecting

namespace {

Status RefusePlainTcp(const Endpoint& endpoint) {
  return PermissionDenied(
      "{}: plain TCP would carry GPU memory and the token unencrypted; give a CA file (--tls-ca) "
      "or allow it explicitly (--insecure)",
      endpoint.ToString());
}

Result<Stream> WrapForTransport(Socket socket, const Endpoint& endpoint,
                                const ClientTransport& transport) {
  if (endpoint.kind == Endpoint::Kind::kUnix || !transport.tls) return Stream(std::move(socket));
  Stream stream(std::move(socket), transport.tls, Stream::Side::kClient);
  GPULAZY_RETURN_IF_ERROR(
      stream.ExpectPeerName(transport.server_name.empty() ? endpoint.host : transport.server_name));
  return stream;
}

}  // namespace

Awaitable<Result<Stream>> Connect(const Endpoint& endpoint, const ClientTransport& transport) {
  if (endpoint.kind == Endpoint::Kind::kTcp && !transport.tls && !transport.allow_insecure_tcp)
    co_return RefusePlainTcp(endpoint);
  Result<Socket> socket = co_await Connect(endpoint);
  if (!socket.ok()) co_return socket.status();
  co_return WrapForTransport(std::move(*socket), endpoint, transport);
}

Result<Stream> ConnectBlocking(asio::io_context& io, const Endpoint& endpoint,
                               const ClientTransport& transport) {
  if (endpoint.kind == Endpoint::Kind::kTcp && !transport.tls && !transport.allow_insecure_tcp)
    return RefusePlainTcp(endpoint);
  GPULAZY_ASSIGN_OR_RETURN(Socket socket, ConnectBlocking(io, endpoint));
  GPULAZY_ASSIGN_OR_RETURN(Stream stream, WrapForTransport(std::move(socket), endpoint, transport));
  GPULAZY_RETURN_IF_ERROR(
      stream.HandshakeBlocking().Context(fmt::format("connecting to {}", endpoint.ToString())));
  return stream;
}

// ---------------------------------------------------------------------------------------------
// Secrets

namespace {

// A secret file's bytes, at most max_bytes, after the checks every token file gets.
Result<std::string> ReadSecretFile(const std::string& path, size_t max_bytes) {
  // A token others can read is a token others have.
  return ReadGuardedFile(path, {.kind = "token file",
                                .refused_mode = S_IRWXO,
                                .refused_because = "is accessible to other users",
                                .fix = "chmod o-rwx it",
                                .max_bytes = max_bytes});
}

}  // namespace

Result<std::string> ReadTokenFile(const std::string& path) {
  GPULAZY_ASSIGN_OR_RETURN(std::string token, ReadSecretFile(path, kMaxTokenBytes));
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r'))
    token.pop_back();
  if (token.empty()) return InvalidArgument("token file {} holds an empty token", path);
  return token;
}

Result<std::vector<std::string>> ReadTokenListFile(const std::string& path) {
  GPULAZY_ASSIGN_OR_RETURN(std::string text, ReadSecretFile(path, kMaxTokenListBytes));
  std::vector<std::string> tokens;
  for (const NumberedLine& line : SplitLines(text)) {
    if (line.text.empty() || line.text.front() == '#') continue;
    // The message names the line, never the token.
    if (line.text.size() > kMaxTokenBytes)
      return InvalidArgument("token file {}: the token on line {} is longer than {} bytes", path,
                             line.number, kMaxTokenBytes);
    tokens.emplace_back(line.text);
  }
  if (tokens.empty()) return InvalidArgument("token file {} holds no token", path);
  return tokens;
}

bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  // Comparing digests makes the time independent of the lengths too.
  std::array<unsigned char, SHA256_DIGEST_LENGTH> digest_a{}, digest_b{};
  SHA256(reinterpret_cast<const unsigned char*>(a.data()), a.size(), digest_a.data());
  SHA256(reinterpret_cast<const unsigned char*>(b.data()), b.size(), digest_b.data());
  const bool same_digest = CRYPTO_memcmp(digest_a.data(), digest_b.data(), digest_a.size()) == 0;
  return same_digest & (a.size() == b.size());
}

}  // namespace gpulazy::net
