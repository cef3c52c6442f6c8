// net/: transports and frame I/O over Boost.Asio, shared by the page client and the page
// server. Knows frames and addresses, no policy.
//
// Endpoint: where a server listens or a client connects, as people write it:
// "unix:/run/gpulazy.sock" or "tcp:127.0.0.1:7070" ("tcp:[::1]:7070" for IPv6).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "proto/status.h"

namespace gpulazy::net {

struct Endpoint {
  enum class Kind { kUnix, kTcp };
  Kind kind = Kind::kUnix;
  std::string path;   // kUnix
  std::string host;   // kTcp
  uint16_t port = 0;  // kTcp

  static Result<Endpoint> Parse(std::string_view text);
  std::string ToString() const;
};

}  // namespace gpulazy::net
