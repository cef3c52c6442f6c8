// Whether this test binary runs under ASan or TSan. Tests that push tens of MiB through the
// whole pipeline only to cover its paths use fewer bytes there: every byte a sanitized build
// copies or hashes costs 5-20 times more, and the CI budget is shared by all stages.
#pragma once

#include <cstdint>

namespace gpulazy::testing {

// GCC defines __SANITIZE_*__; clang answers __has_feature.
#if defined(__has_feature)
#define GPULAZY_HAS_FEATURE(name) __has_feature(name)
#else
#define GPULAZY_HAS_FEATURE(name) 0
#endif

#if defined(__SANITIZE_ADDRESS__) || GPULAZY_HAS_FEATURE(address_sanitizer)
inline constexpr bool kAddressSanitized = true;
#else
inline constexpr bool kAddressSanitized = false;
#endif

#if defined(__SANITIZE_THREAD__) || GPULAZY_HAS_FEATURE(thread_sanitizer)
inline constexpr bool kThreadSanitized = true;
#else
inline constexpr bool kThreadSanitized = false;
#endif

#undef GPULAZY_HAS_FEATURE

inline constexpr bool kSanitized = kAddressSanitized || kThreadSanitized;

// `bytes` in an optimized build, a quarter of it (at least `floor`) under a sanitizer.
constexpr uint64_t SanitizerScaled(uint64_t bytes, uint64_t floor = 1) {
  if (!kSanitized) return bytes;
  return bytes / 4 > floor ? bytes / 4 : floor;
}

}  // namespace gpulazy::testing
