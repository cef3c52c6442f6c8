// Byte sizes as people type them: "4096", "4K", "512M", "2G", "1.5G" (binary units).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "proto/status.h"

namespace gpulazy {

Result<uint64_t> ParseSize(std::string_view text);
std::string FormatSize(uint64_t bytes);  // "512.0 MiB"

}  // namespace gpulazy
