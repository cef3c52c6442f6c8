#include "page-client/net/endpoint.h"

#include <charconv>

namespace gpulazy::net {

Result<Endpoint> Endpoint::Parse(std::string_view text) {
  Endpoint endpoint;
  if (text.starts_with("unix:")) {
    endpoint.kind = Kind::kUnix;
    endpoint.path = std::string(text.substr(5));
    if (endpoint.path.empty()) return InvalidArgument("endpoint '{}' has an empty path", text);
    // sockaddr_un holds 108 bytes including the terminator.
    if (endpoint.path.size() > 107)
      return InvalidArgument("endpoint '{}': Unix socket paths are limited to 107 bytes", text);
    return endpoint;
  }
  if (!text.starts_with("tcp:"))
    return InvalidArgument("endpoint '{}' must start with unix: or tcp:", text);
  std::string_view rest = text.substr(4);
  std::string_view host;
  std::string_view port;
  if (rest.starts_with("[")) {
    size_t close = rest.find(']');
    if (close == std::string_view::npos || close + 1 >= rest.size() || rest[close + 1] != ':')
      return InvalidArgument("endpoint '{}': expected tcp:[IPv6]:PORT", text);
    host = rest.substr(1, close - 1);
    port = rest.substr(close + 2);
  } else {
    size_t colon = rest.rfind(':');
    if (colon == std::string_view::npos)
      return InvalidArgument("endpoint '{}': expected tcp:HOST:PORT", text);
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  if (host.empty()) return InvalidArgument("endpoint '{}' has an empty host", text);
  unsigned value = 0;
  auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || ptr != port.data() + port.size() || value > 65535)
    return InvalidArgument("endpoint '{}' has a bad port '{}'", text, port);
  endpoint.kind = Kind::kTcp;
  endpoint.host = std::string(host);
  endpoint.port = static_cast<uint16_t>(value);
  return endpoint;
}

std::string Endpoint::ToString() const {
  if (kind == Kind::kUnix) return "unix:" + path;
  if (host.find(':') != std::string::npos) return fmt::format("tcp:[{}]:{}", host, port);
  return fmt::format("tcp:{}:{}", host, port);
}

}  // namespace gpulazy::net
