#include "proto/size.h"

#include <cctype>
#include <charconv>
#include <cmath>

namespace gpulazy {

Result<uint64_t> ParseSize(std::string_view text) {
  if (text.empty()) return InvalidArgument("empty size");
  size_t digits_end = 0;
  while (digits_end < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits_end])) || text[digits_end] == '.'))
    ++digits_end;
  std::string_view number = text.substr(0, digits_end);
  std::string_view suffix = text.substr(digits_end);
  if (number.empty()) return InvalidArgument("size '{}' does not start with a number", text);

  std::string unit;
  for (char c : suffix)
    unit += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  uint64_t multiplier = 0;
  if (unit.empty() || unit == "B")
    multiplier = 1;
  else if (unit == "K" || unit == "KB" || unit == "KIB")
    multiplier = 1ull << 10;
  else if (unit == "M" || unit == "MB" || unit == "MIB")
    multiplier = 1ull << 20;
  else if (unit == "G" || unit == "GB" || unit == "GIB")
    multiplier = 1ull << 30;
  else if (unit == "T" || unit == "TB" || unit == "TIB")
    multiplier = 1ull << 40;
  else
    return InvalidArgument("size '{}' has an unknown unit '{}' (use K, M, G or T)", text, suffix);

  if (number.find('.') == std::string_view::npos) {
    uint64_t value = 0;
    auto [ptr, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
    if (ec != std::errc() || ptr != number.data() + number.size())
      return InvalidArgument("size '{}' is not a number", text);
    if (value > UINT64_MAX / multiplier) return OutOfRange("size '{}' overflows 64 bits", text);
    return value * multiplier;
  }
  double value = 0;
  auto [ptr, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (ec != std::errc() || ptr != number.data() + number.size() || !std::isfinite(value))
    return InvalidArgument("size '{}' is not a number", text);
  double bytes = value * static_cast<double>(multiplier);
  if (bytes >= 18446744073709551615.0) return OutOfRange("size '{}' overflows 64 bits", text);
  return static_cast<uint64_t>(std::llround(bytes));
}

std::string FormatSize(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.1f} {}", value, kUnits[unit]);
}

}  // namespace gpulazy
