// libFuzzer harness: chunk decoding (proto/chunk_codec.h DecodeChunkBytes, and the client's
// page-client/chunk_codec.h DecodeChunkPayload, which the session runs on every ChunkData).
//
// Input: u8 codec | u24 LE declared raw length | stored bytes S.
// Checks, besides the sanitizers (the output buffer is a heap block of exactly the declared
// length, so a single byte written past it is an ASan report):
//   - given the checksum of what a reference LZ4 decode of S yields, DecodeChunkBytes refuses
//     S whenever it decodes to more or less than the declared length (or not at all), and what
//     it accepts is exactly the reference bytes (a valid block may still be refused: LZ4's
//     end-of-block rules are checked against the exact capacity); RAW and ZERO are accepted
//     exactly when they match their definitions;
//   - S compressed with LZ4 round-trips at its exact length, and is refused, without writing
//     past the buffer, when declared one byte shorter or longer;
//   - the client's decoder agrees with DecodeChunkBytes, in place and not.
#include <lz4.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "page-client/chunk_codec.h"
#include "proto/checksum.h"
#include "proto/chunk_codec.h"

namespace {

using namespace gpulazy;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "fuzz_chunk_codec: %s\n", what);
  std::abort();
}

// An exactly sized heap block: ASan flags the first byte past it.
std::unique_ptr<uint8_t[]> Exact(size_t n) {
  return std::make_unique_for_overwrite<uint8_t[]>(std::max<size_t>(n, 1));
}

// What S decodes to with one byte to spare, or -1 (malformed, or longer than raw_length + 1):
// the reference for "decodes to more or less than raw_length".
int ReferenceLz4(std::span<const uint8_t> stored, uint32_t raw_length, std::vector<uint8_t>* out) {
  out->assign(size_t{raw_length} + 1, 0);
  if (stored.empty()) return -1;
  return LZ4_decompress_safe(reinterpret_cast<const char*>(stored.data()),
                             reinterpret_cast<char*>(out->data()), static_cast<int>(stored.size()),
                             static_cast<int>(out->size()));
}

void CheckDecode(manifest::Codec codec, std::span<const uint8_t> stored, uint32_t raw_length) {
  std::vector<uint8_t> expected;  // what a correct decode yields, when one exists
  bool decodable = false;         // a correct chunk: nothing may refuse it (LZ4: may refuse)
  switch (codec) {
    case manifest::CODEC_RAW:
      decodable = stored.size() == raw_length;
      expected.assign(stored.begin(), stored.end());
      break;
    case manifest::CODEC_ZERO:
      decodable = stored.empty();
      expected.assign(raw_length, 0);
      break;
    case manifest::CODEC_LZ4: {
      int n = ReferenceLz4(stored, raw_length, &expected);
      decodable = n >= 0 && static_cast<uint32_t>(n) == raw_length;
      expected.resize(n >= 0 ? static_cast<size_t>(n) : 0);
      break;
    }
    default:
      break;
  }
  const uint64_t checksum = Checksum64(expected);
  auto raw = Exact(raw_length);
  Status status =
      DecodeChunkBytes(codec, checksum, stored, {raw.get(), raw_length}, "fuzz BO 0 chunk 0");
  const bool may_refuse = codec == manifest::CODEC_LZ4;
  if (status.ok() && !decodable) Die("accepted a bad chunk");
  if (!status.ok() && decodable && !may_refuse) Die("refused a valid chunk");
  if (status.ok() && !std::equal(expected.begin(), expected.end(), raw.get()))
    Die("decoded bytes differ from the reference");
  if (!status.ok() && status.message().find("fuzz BO 0 chunk 0") == std::string::npos)
    Die("error does not name the chunk");

  // The client's path: a copy into a vector, and RAW checked in place.
  wire::ChunkData data;
  data.set_codec(codec);
  data.set_raw_length(raw_length);
  data.set_checksum(checksum);
  std::vector<uint8_t> out;
  Status client = client::DecodeChunkPayload(data, stored, &out, "fuzz");
  if (client.ok() != status.ok()) Die("client decoder disagrees");
  if (client.ok() && out != expected) Die("client decoded other bytes");
  if (codec == manifest::CODEC_RAW) {
    std::vector<uint8_t> in_place(stored.begin(), stored.end());
    Status st = client::DecodeChunkPayload(data, in_place, &in_place, "fuzz");
    if (st.ok() != status.ok()) Die("client in-place decoder disagrees");
  }
}

void CheckRoundTrip(std::span<const uint8_t> content) {
  if (content.empty()) return;
  std::vector<uint8_t> block(
      static_cast<size_t>(LZ4_compressBound(static_cast<int>(content.size()))));
  int n = LZ4_compress_default(reinterpret_cast<const char*>(content.data()),
                               reinterpret_cast<char*>(block.data()),
                               static_cast<int>(content.size()), static_cast<int>(block.size()));
  if (n <= 0) Die("LZ4 could not compress");
  std::span<const uint8_t> stored(block.data(), static_cast<size_t>(n));
  const uint64_t checksum = Checksum64(content);
  const size_t length = content.size();
  auto exact = Exact(length);
  if (!DecodeChunkBytes(manifest::CODEC_LZ4, checksum, stored, {exact.get(), length}, "rt").ok() ||
      !std::equal(content.begin(), content.end(), exact.get()))
    Die("LZ4 round trip failed");
  auto shorter = Exact(length - 1);
  if (DecodeChunkBytes(manifest::CODEC_LZ4, checksum, stored, {shorter.get(), length - 1}, "rt")
          .ok())
    Die("a block decoding to more than the raw length was accepted");
  auto longer = Exact(length + 1);
  if (DecodeChunkBytes(manifest::CODEC_LZ4, checksum, stored, {longer.get(), length + 1}, "rt")
          .ok())
    Die("a block decoding to less than the raw length was accepted");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const auto codec = static_cast<manifest::Codec>(data[0] % 4);  // 3 is not a codec
  // At most one 4 MiB chunk, the largest chunk size there is.
  const uint32_t raw_length =
      (uint32_t{data[1]} | uint32_t{data[2]} << 8 | uint32_t{data[3]} << 16) % ((4u << 20) + 1);
  std::span<const uint8_t> stored(data + 4, size - 4);
  CheckDecode(codec, stored, raw_length);
  CheckRoundTrip(stored);
  return 0;
}
