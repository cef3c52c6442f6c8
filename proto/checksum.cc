#include "proto/checksum.h"

#include <fmt/format.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t by value
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "proto/checksum_variants.h"
#if defined(GPULAZY_XXH3_DISPATCH)
#define XXH_DISPATCH_DISABLE_REPLACE  // both the plain and the dispatching names, as they are
#include <xxh_x86dispatch.h>
#endif

namespace gpulazy {
namespace checksum_internal {
namespace {

uint64_t LibraryHash(const void* bytes, size_t length) {
  return XXH3_64bits(bytes, length);
}
void LibraryUpdate(void* state, const void* bytes, size_t length) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), bytes, length);
}

#if defined(GPULAZY_XXH3_DISPATCH)
uint64_t DispatchHash(const void* bytes, size_t length) {
  return XXH3_64bits_dispatch(bytes, length);
}
void DispatchUpdate(void* state, const void* bytes, size_t length) {
  XXH3_64bits_update_dispatch(static_cast<XXH3_state_t*>(state), bytes, length);
}
#endif

}  // namespace

const Xxh3Variant& LibraryXxh3() {
  static constexpr Xxh3Variant kLibrary{"library", LibraryHash, LibraryUpdate};
  return kLibrary;
}

const Xxh3Variant* DispatchXxh3() {
#if defined(GPULAZY_XXH3_DISPATCH)
  static constexpr Xxh3Variant kDispatch{"dispatch", DispatchHash, DispatchUpdate};
  return &kDispatch;
#else
  return nullptr;
#endif
}

std::vector<const Xxh3Variant*> AvailableXxh3Variants() {
  std::vector<const Xxh3Variant*> variants{&LibraryXxh3()};
  if (DispatchXxh3() != nullptr) variants.push_back(DispatchXxh3());
  return variants;
}

const Xxh3Variant& SelectedXxh3() {
  static const Xxh3Variant& selected = []() -> const Xxh3Variant& {
    const char* forced = std::getenv("GPULAZY_XXH3");
    if (forced != nullptr && std::string_view(forced) == "library") return LibraryXxh3();
    return *AvailableXxh3Variants().back();
  }();
  return selected;
}

}  // namespace checksum_internal

using checksum_internal::SelectedXxh3;

uint64_t Checksum64(std::span<const uint8_t> bytes) {
  return SelectedXxh3().hash(bytes.data(), bytes.size());
}

struct Checksum64Stream::State {
  XXH3_state_t xxh3;
};

Checksum64Stream::Checksum64Stream() : state_(std::make_unique<State>()) {
  XXH3_64bits_reset(&state_->xxh3);
}
Checksum64Stream::~Checksum64Stream() = default;
Checksum64Stream::Checksum64Stream(Checksum64Stream&&) noexcept = default;
Checksum64Stream& Checksum64Stream::operator=(Checksum64Stream&&) noexcept = default;

void Checksum64Stream::Update(std::span<const uint8_t> bytes) {
  SelectedXxh3().update(&state_->xxh3, bytes.data(), bytes.size());
}

uint64_t Checksum64Stream::Digest() const {
  return XXH3_64bits_digest(&state_->xxh3);
}

Digest128 ContentDigest(std::span<const uint8_t> bytes) {
  XXH128_hash_t hash = XXH3_128bits(bytes.data(), bytes.size());
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, hash);
  Digest128 digest;
  std::memcpy(digest.data(), canonical.digest, digest.size());
  return digest;
}

std::string DigestToString(const Digest128& digest) {
  std::string out;
  out.reserve(32);
  for (uint8_t b : digest)
    out += fmt::format("{:02x}", b);
  return out;
}

uint64_t ZeroChecksum64(uint64_t length) {
  // Lengths seen so far, most recent last; a few suffice (the chunk size and the BOs' tails).
  constexpr size_t kRemembered = 16;
  static std::mutex mu;
  static std::vector<std::pair<uint64_t, uint64_t>> known;  // length -> checksum
  {
    std::lock_guard lock(mu);
    for (const auto& [known_length, sum] : known)
      if (known_length == length) return sum;
  }
  static const std::array<uint8_t, 64u << 10> kZeros{};
  Checksum64Stream hash;
  for (uint64_t left = length; left > 0;) {
    const size_t piece = static_cast<size_t>(std::min<uint64_t>(left, kZeros.size()));
    hash.Update(std::span(kZeros.data(), piece));
    left -= piece;
  }
  const uint64_t sum = hash.Digest();
  std::lock_guard lock(mu);
  if (known.size() == kRemembered) known.erase(known.begin());
  known.emplace_back(length, sum);
  return sum;
}

bool IsAllZero(std::span<const uint8_t> bytes) {
  // Word-at-a-time scan; the compiler vectorizes the inner loop.
  size_t i = 0;
  const size_t words = bytes.size() / sizeof(uint64_t);
  for (size_t w = 0; w < words; ++w, i += sizeof(uint64_t)) {
    uint64_t v;
    std::memcpy(&v, bytes.data() + i, sizeof v);
    if (v != 0) return false;
  }
  for (; i < bytes.size(); ++i)
    if (bytes[i] != 0) return false;
  return true;
}

}  // namespace gpulazy
