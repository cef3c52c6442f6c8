// Whether this test binary runs under ASan or TSan. Tests that push tens of MiB through the
// whole pipeline only to cover its paths use fewer bytes there: every byte a sanitized build
// copies or hashes costs 5-20 times more, and the CI budget is shared by all stages.
#pragma once

#include <cstdint>

namespace gpulazy::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

// `bytes` in an optimized build, a quarter of it (at least `floor`) under a sanitizer.
constexpr uint64_t SanitizerScaled(uint64_t bytes, uint64_t floor = 1) {
  if (!kSanitized) return bytes;
  return bytes / 4 > floor ? bytes / 4 : floor;
}

}  // namespace gpulazy::testing
