#include "plugin/config.h"

#include <cstdlib>
#include <fstream>
#include <map>

namespace gpulazy::plugin {
namespace {

// The most `lanes` accepts, as `gpulazy-client fetch --lanes` (the client uses at most 16).
constexpr uint64_t kMaxLanesSetting = 16;

std::string Trim(std::string s) {
  const char* ws = " \t\r\n";
  s.erase(0, s.find_first_not_of(ws));
  s.erase(s.find_last_not_of(ws) + 1);
  return s;
}

Result<bool> ParseBool(const std::string& key, const std::string& v) {
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  return InvalidArgument("{}: '{}' is not a boolean", key, v);
}

Result<uint64_t> ParseU64(const std::string& key, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  unsigned long long n = std::strtoull(v.c_str(), &end, 0);
  if (v.empty() || errno != 0 || *end != '\0')
    return InvalidArgument("{}: '{}' is not a number", key, v);
  return static_cast<uint64_t>(n);
}

Status Apply(PluginConfig& c, const std::string& key, const std::string& value) {
  if (key == "mode") {
    if (value == "eager")
      c.mode = Mode::kEager;
    else if (value == "parallel")
      c.mode = Mode::kParallel;
    else if (value == "lazy")
      c.mode = Mode::kLazy;
    else
      return InvalidArgument("mode: '{}' is not eager, parallel or lazy", value);
  } else if (key == "server") {
    c.server = value;
  } else if (key == "image") {
    c.image = value;
  } else if (key == "token") {
    c.token = value;
  } else if (key == "token_file") {
    // Read once, with the same rules as the CLIs (not readable by others, not empty).
    GPULAZY_ASSIGN_OR_RETURN(c.token, net::ReadTokenFile(value));
  } else if (key == "tls_ca") {
    c.tls.ca_file = value;
  } else if (key == "tls_cert") {
    c.tls.cert_file = value;
  } else if (key == "tls_key") {
    c.tls.key_file = value;
  } else if (key == "tls_server_name") {
    c.tls.server_name = value;
  } else if (key == "insecure_tcp") {
    GPULAZY_ASSIGN_OR_RETURN(c.insecure_tcp, ParseBool(key, value));
  } else if (key == "engine") {
    if (value == "auto")
      c.engine = EngineKind::kAuto;
    else if (value == "sdma")
      c.engine = EngineKind::kSdma;
    else if (value == "host")
      c.engine = EngineKind::kHost;
    else
      return InvalidArgument("engine: '{}' is not auto, sdma or host", value);
  } else if (key == "fake_kfd") {
    c.fake_kfd = value;
  } else if (key == "topology") {
    c.topology_root = value;
  } else if (key == "dri_root") {
    if (value.empty()) return InvalidArgument("dri_root: empty path");
    c.dri_root = value;
  } else if (key == "fault_socket") {
    c.fault_socket = value;
  } else if (key == "window") {
    GPULAZY_ASSIGN_OR_RETURN(c.window_bytes, ParseU64(key, value));
  } else if (key == "background_nice") {
    GPULAZY_ASSIGN_OR_RETURN(uint64_t nice, ParseU64(key, value));
    if (nice > 19) return InvalidArgument("background_nice: {} is not in 0..19", nice);
    c.background_nice = static_cast<int>(nice);
  } else if (key == "lanes") {
    GPULAZY_ASSIGN_OR_RETURN(uint64_t lanes, ParseU64(key, value));
    if (lanes > kMaxLanesSetting)
      return InvalidArgument("lanes: {} is not in 0..{}", lanes, kMaxLanesSetting);
    c.lanes = static_cast<uint32_t>(lanes);
  } else if (key == "resume_timeout_ms") {
    GPULAZY_ASSIGN_OR_RETURN(uint64_t ms, ParseU64(key, value));
    c.resume_timeout = std::chrono::milliseconds(ms);
  } else if (key == "log_level") {
    c.log_level = value;
  } else if (key == "lazy_image") {
    GPULAZY_ASSIGN_OR_RETURN(c.lazy_image, ParseBool(key, value));
  } else if (key.starts_with("check_")) {
    GPULAZY_ASSIGN_OR_RETURN(bool on, ParseBool(key, value));
    bool* flag = c.checks.Find(key.substr(6));
    if (flag == nullptr) return InvalidArgument("{}: no such topology check", key);
    *flag = on;
  } else {
    return InvalidArgument("unknown setting '{}'", key);
  }
  return Status::Ok();
}

const char* const kKeys[] = {
    "mode",      "server",          "image",        "token",    "engine",
    "fake_kfd",  "topology",        "fault_socket", "window",   "resume_timeout_ms",
    "log_level", "lazy_image",      "token_file",   "tls_ca",   "tls_cert",
    "tls_key",   "tls_server_name", "insecure_tcp", "dri_root", "background_nice",
    "lanes"};

}  // namespace

std::string_view ModeName(Mode mode) {
  switch (mode) {
    case Mode::kEager:
      return "eager";
    case Mode::kParallel:
      return "parallel";
    case Mode::kLazy:
      return "lazy";
  }
  return "?";
}

Result<PluginConfig> LoadConfig(const EnvLookup& env) {
  PluginConfig c;
  std::filesystem::path file;
  if (auto f = env("GPULAZY_CONFIG")) {
    file = *f;
  } else if (std::error_code ec; std::filesystem::exists("/etc/gpulazy/plugin.conf", ec)) {
    file = "/etc/gpulazy/plugin.conf";
  }
  if (!file.empty()) {
    std::ifstream in(file);
    if (!in) return NotFound("plugin config {}: cannot open", file.string());
    std::string line;
    int number = 0;
    while (std::getline(in, line)) {
      ++number;
      line = Trim(line.substr(0, line.find('#')));
      if (line.empty()) continue;
      size_t eq = line.find('=');
      if (eq == std::string::npos)
        return InvalidArgument("{}:{}: expected 'key = value'", file.string(), number);
      Status s = Apply(c, Trim(line.substr(0, eq)), Trim(line.substr(eq + 1)));
      if (!s.ok()) return s.Context(fmt::format("{}:{}", file.string(), number));
    }
  }
  for (const char* key : kKeys) {
    std::string var = "GPULAZY_";
    for (const char* p = key; *p != '\0'; ++p)
      var += static_cast<char>(std::toupper(*p));
    if (auto v = env(var)) GPULAZY_RETURN_IF_ERROR(Apply(c, key, *v).Context(var));
  }
  for (const std::string& name : TopologyChecks::Names()) {
    std::string var = "GPULAZY_CHECK_";
    for (char ch : name)
      var += static_cast<char>(std::toupper(ch));
    if (auto v = env(var)) GPULAZY_RETURN_IF_ERROR(Apply(c, "check_" + name, *v).Context(var));
  }
  return c;
}

Result<PluginConfig> LoadConfigFromProcess() {
  return LoadConfig([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  });
}

Status CheckServerTransport(const PluginConfig& config) {
  if (!config.server.starts_with("tcp:") || config.tls.enabled() || config.insecure_tcp)
    return Status::Ok();
  return PermissionDenied(
      "server {}: plain TCP would carry GPU memory and the token unencrypted; set tls_ca "
      "(GPULAZY_TLS_CA) to the server's CA for TLS, or insecure_tcp = 1 (GPULAZY_INSECURE_TCP) to "
      "allow plain TCP",
      config.server);
}

}  // namespace gpulazy::plugin
