// Stream: one connected byte stream, plain (Unix or TCP) or TLS over TCP, behind one type, so
// frame I/O (frame_stream.h) and the connections of server and client never care which. It
// models Asio's AsyncReadStream/AsyncWriteStream and SyncReadStream/SyncWriteStream, and
// forwards socket housekeeping (close, shutdown, is_open) to the socket underneath.
//
// TLS (docs/security.md): TLS 1.2 at least, 1.3 preferred (OpenSSL negotiates the highest).
// Clients verify the server's certificate chain against their CA file and its name (DNS name
// or IP address) against the endpoint's host or an override; servers with a client CA file
// require and verify a client certificate (mutual TLS).
//
// Thread-safety: like an Asio socket: one reader and one writer at a time, both on the stream's
// strand (or one io_context thread).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "page-client/net/asio.h"
#include "page-client/net/endpoint.h"
#include "proto/status.h"

namespace gpulazy::net {

// One socket type for Unix and TCP connections alike.
using Socket = boost::asio::generic::stream_protocol::socket;
using TlsContext = boost::asio::ssl::context;
template <typename T>
using Awaitable = boost::asio::awaitable<T>;

// What a client trusts and presents. TLS is on for tcp: endpoints when ca_file is set.
struct TlsClientOptions {
  std::string ca_file;      // PEM trust anchors for the server's certificate
  std::string cert_file;    // PEM client certificate chain (mutual TLS); needs key_file
  std::string key_file;     // PEM private key of cert_file
  std::string server_name;  // name the certificate must carry; empty: the endpoint's host
  bool enabled() const { return !ca_file.empty(); }
};

// What a server presents and whom it trusts. TLS is on for tcp: listeners when cert_file is set.
struct TlsServerOptions {
  std::string cert_file;       // PEM certificate chain
  std::string key_file;        // PEM private key
  std::string client_ca_file;  // set: clients must present a certificate this CA signed
  bool enabled() const { return !cert_file.empty(); }
};

Result<std::shared_ptr<TlsContext>> MakeClientTlsContext(const TlsClientOptions& options);
Result<std::shared_ptr<TlsContext>> MakeServerTlsContext(const TlsServerOptions& options);
// The certificate a context presents, for logs and --check (an operator checking a rotation).
struct CertificateSummary {
  std::string subject;   // "/CN=localhost"; empty when the context presents none
  std::string end;       // "2026-12-04 11:30:00 UTC"; empty when none or unreadable
  bool expired = false;  // its end of validity has passed: clients will refuse it
  // "/CN=localhost, expires 2026-12-04 11:30:00 UTC" ("EXPIRED" once past it).
  std::string ToString() const;
};
CertificateSummary SummarizeCertificate(TlsContext& context);

// How a client reaches servers: TLS (a loaded context) or, only when allowed, plain TCP.
// Unix endpoints are always plain; their security is the socket file's permissions and the
// server's peer-credential check.
struct ClientTransport {
  std::shared_ptr<TlsContext> tls;  // null: no TLS
  std::string server_name;          // overrides the endpoint's host for verification
  bool allow_insecure_tcp = false;  // plain tcp: without TLS (--insecure)

  // Loads the files named in `options` (once, for every connection made with the result).
  static Result<ClientTransport> Make(const TlsClientOptions& options, bool allow_insecure_tcp);
};

class Stream {
 public:
  using TlsStream = boost::asio::ssl::stream<Socket>;
  using executor_type = Socket::executor_type;
  using lowest_layer_type = Socket;
  enum class Side { kClient, kServer };

  // A plain stream.
  explicit Stream(Socket socket);
  // A TLS stream over `socket`; Handshake() must succeed before frames flow.
  Stream(Socket socket, std::shared_ptr<TlsContext> context, Side side);
  Stream(Stream&&) noexcept = default;
  Stream& operator=(Stream&&) noexcept = default;

  executor_type get_executor() { return socket().get_executor(); }
  Socket& socket();
  const Socket& socket() const;
  Socket& lowest_layer() { return socket(); }
  bool is_tls() const { return std::holds_alternative<std::unique_ptr<TlsStream>>(stream_); }
  bool is_open() const { return socket().is_open(); }
  // A TCP connection without TLS (asked of the socket once, then remembered).
  bool is_plain_tcp();
  // Raw socket close and shutdown: after them a TLS peer sees a truncated stream, which the
  // frame reader reports like an ordinary close.
  void close(boost::system::error_code& ec) { socket().close(ec); }
  void shutdown(Socket::shutdown_type what, boost::system::error_code& ec) {
    socket().shutdown(what, ec);
  }

  // Client side: the DNS name or IP address the server's certificate must carry (also sent as
  // SNI when it is a name). No-op on a plain stream.
  Status ExpectPeerName(const std::string& name);
  // TLS handshake (a no-op on a plain stream). A failure says why, with the certificate
  // verification error where there is one ("certificate has expired", "hostname mismatch").
  Awaitable<Status> Handshake();
  Status HandshakeBlocking();
  // The common name of the verified peer certificate, empty without one.
  std::string PeerCommonName() const;

  template <typename MutableBuffers, typename Token>
  auto async_read_some(const MutableBuffers& buffers, Token&& token) {
    return boost::asio::async_initiate<Token, void(boost::system::error_code, size_t)>(
        [this](auto handler, const MutableBuffers& into) {
          if (auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_))
            (*tls)->async_read_some(into, std::move(handler));
          else
            std::get<Socket>(stream_).async_read_some(into, std::move(handler));
        },
        token, buffers);
  }
  template <typename ConstBuffers, typename Token>
  auto async_write_some(const ConstBuffers& buffers, Token&& token) {
    return boost::asio::async_initiate<Token, void(boost::system::error_code, size_t)>(
        [this](auto handler, const ConstBuffers& from) {
          if (auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_))
            (*tls)->async_write_some(from, std::move(handler));
          else
            std::get<Socket>(stream_).async_write_some(from, std::move(handler));
        },
        token, buffers);
  }
  template <typename MutableBuffers>
  size_t read_some(const MutableBuffers& buffers, boost::system::error_code& ec) {
    if (auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_))
      return (*tls)->read_some(buffers, ec);
    return std::get<Socket>(stream_).read_some(buffers, ec);
  }
  template <typename ConstBuffers>
  size_t write_some(const ConstBuffers& buffers, boost::system::error_code& ec) {
    if (auto* tls = std::get_if<std::unique_ptr<TlsStream>>(&stream_))
      return (*tls)->write_some(buffers, ec);
    return std::get<Socket>(stream_).write_some(buffers, ec);
  }

 private:
  Status HandshakeError(const boost::system::error_code& ec) const;

  // Declared first, destroyed last: the TLS stream refers to it.
  std::shared_ptr<TlsContext> context_;
  // The TLS stream lives on the heap so a Stream moves without moving OpenSSL's state.
  std::variant<Socket, std::unique_ptr<TlsStream>> stream_;
  Side side_ = Side::kClient;
  std::optional<bool> plain_tcp_;
};

// Connects to `endpoint` (Unix or TCP), wrapping TCP in TLS when the transport has it; the TLS
// handshake is left to the caller (Stream::Handshake), so it can run under the caller's
// deadline. Plain TCP without transport.allow_insecure_tcp is refused (kPermissionDenied).
Awaitable<Result<Stream>> Connect(const Endpoint& endpoint, const ClientTransport& transport);
// Blocking, for tools: connects and, for TLS, completes the handshake.
Result<Stream> ConnectBlocking(boost::asio::io_context& io, const Endpoint& endpoint,
                               const ClientTransport& transport);

// Reads a bearer token from a file: read once, trailing newline (LF or CRLF) stripped. Refuses
// files others may read (mode & 007), non-regular files, empty tokens and files over 4 KiB,
// each with a message naming the file (docs/security.md).
Result<std::string> ReadTokenFile(const std::string& path);
// The server's side: the tokens it accepts, one per line (blank lines and lines starting with
// '#' skipped; CRLF ends a line too), so a token can be rotated without refusing anyone: list
// the old and the new, reload, move the clients, drop the old, reload. The file checks of
// ReadTokenFile, at most 64 KiB in all and 4 KiB a token, and at least one token.
Result<std::vector<std::string>> ReadTokenListFile(const std::string& path);
// Compares secrets in time independent of their contents and lengths.
bool ConstantTimeEqual(std::string_view a, std::string_view b);

}  // namespace gpulazy::net
