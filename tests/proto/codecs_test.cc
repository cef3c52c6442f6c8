#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <lz4.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t by value
#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "proto/checksum.h"
#include "proto/checksum_variants.h"
#include "proto/chunk_codec.h"
#include "proto/criu_file.h"
#include "proto/endian.h"
#include "proto/file_header.h"
#include "proto/frame.h"
#include "proto/size.h"

namespace gpulazy {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> Bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

wire::Header ChunkHeader() {
  wire::Header header;
  header.set_request_id(77);
  auto* chunk = header.mutable_chunk();
  chunk->set_bo(3);
  chunk->set_chunk(9);
  chunk->set_codec(manifest::CODEC_LZ4);
  chunk->set_raw_length(4096);
  chunk->set_checksum(0x0123456789abcdefull);
  return header;
}

// --- Chunk decoding: never past the declared raw length --------------------------------------
// Output buffers are heap blocks of exactly the declared length, so under ASan a single byte
// written past one is a reported overflow, not a silent scribble.

std::vector<uint8_t> Lz4Block(const std::vector<uint8_t>& raw) {
  std::vector<uint8_t> block(static_cast<size_t>(LZ4_compressBound(static_cast<int>(raw.size()))));
  const int n = LZ4_compress_default(reinterpret_cast<const char*>(raw.data()),
                                     reinterpret_cast<char*>(block.data()),
                                     static_cast<int>(raw.size()), static_cast<int>(block.size()));
  EXPECT_GT(n, 0);
  block.resize(static_cast<size_t>(n));
  return block;
}

std::vector<uint8_t> Pattern(size_t n) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = static_cast<uint8_t>((i / 97) * 13 + (i % 7));
  return out;
}

Status DecodeInto(size_t declared, const std::vector<uint8_t>& block, uint64_t checksum,
                  std::vector<uint8_t>* out = nullptr) {
  auto exact = std::make_unique<uint8_t[]>(declared == 0 ? 1 : declared);
  Status status = DecodeChunkBytes(manifest::CODEC_LZ4, checksum, block, {exact.get(), declared},
                                   "image x, BO 2, chunk 5");
  if (out != nullptr) out->assign(exact.get(), exact.get() + declared);
  return status;
}

TEST(ChunkCodecTest, Lz4DecodesExactlyToTheDeclaredLength) {
  for (size_t n : {size_t{1}, size_t{4095}, size_t{4096}, size_t{65539}, size_t{4} << 20}) {
    SCOPED_TRACE(n);
    const std::vector<uint8_t> raw = Pattern(n);
    const std::vector<uint8_t> block = Lz4Block(raw);
    std::vector<uint8_t> out;
    ASSERT_TRUE(DecodeInto(n, block, Checksum64(raw), &out).ok());
    EXPECT_EQ(out, raw);
  }
}

TEST(ChunkCodecTest, Lz4DecodingToMoreThanDeclaredIsRefusedWithoutOverrun) {
  for (size_t n : {size_t{2}, size_t{4096}, size_t{65539}}) {
    SCOPED_TRACE(n);
    const std::vector<uint8_t> raw = Pattern(n);
    const std::vector<uint8_t> block = Lz4Block(raw);
    // One byte short, and far short: the decoder stops at the buffer's end.
    for (size_t declared : {n - 1, n / 2}) {
      Status status = DecodeInto(declared, block, Checksum64(raw));
      EXPECT_EQ(status.code(), Code::kCorrupt) << declared;
      EXPECT_THAT(status.message(), HasSubstr("image x, BO 2, chunk 5"));
    }
  }
  // A block that expands 4 MiB of zeros from a few kilobytes, declared as one page.
  const std::vector<uint8_t> zeros(4u << 20, 0);
  const std::vector<uint8_t> bomb = Lz4Block(zeros);
  ASSERT_LT(bomb.size(), 32u * 1024);
  EXPECT_EQ(DecodeInto(4096, bomb, Checksum64(zeros)).code(), Code::kCorrupt);
}

TEST(ChunkCodecTest, Lz4DecodingToLessThanDeclaredIsRefused) {
  const std::vector<uint8_t> raw = Pattern(4096);
  const std::vector<uint8_t> block = Lz4Block(raw);
  for (size_t declared : {size_t{4097}, size_t{8192}}) {
    Status status = DecodeInto(declared, block, Checksum64(raw));
    EXPECT_EQ(status.code(), Code::kCorrupt);
    EXPECT_THAT(status.message(), HasSubstr("decodes to 4096 bytes"));
  }
  // A hand-made block of five literals only ("token 0x50"), declared as 4 and as 6 bytes.
  const std::vector<uint8_t> literals = {0x50, 'h', 'e', 'l', 'l', 'o'};
  const std::vector<uint8_t> hello = {'h', 'e', 'l', 'l', 'o'};
  std::vector<uint8_t> out;
  ASSERT_TRUE(DecodeInto(5, literals, Checksum64(hello), &out).ok());
  EXPECT_EQ(out, hello);
  EXPECT_EQ(DecodeInto(4, literals, Checksum64(hello)).code(), Code::kCorrupt);
  EXPECT_EQ(DecodeInto(6, literals, Checksum64(hello)).code(), Code::kCorrupt);
}

TEST(ChunkCodecTest, Lz4TruncatedOrEmptyBlocksAreRefused) {
  const std::vector<uint8_t> raw = Pattern(4096);
  const std::vector<uint8_t> block = Lz4Block(raw);
  for (size_t keep : {size_t{0}, size_t{1}, block.size() / 2, block.size() - 1}) {
    const std::vector<uint8_t> cut(block.begin(), block.begin() + static_cast<long>(keep));
    EXPECT_EQ(DecodeInto(4096, cut, Checksum64(raw)).code(), Code::kCorrupt) << keep;
  }
}

TEST(ChecksumTest, PiecewiseEqualsWholeForEverySplit) {
  const std::vector<uint8_t> bytes = Pattern(1u << 20);
  const uint64_t whole = Checksum64(bytes);
  // Pieces around XXH3's internal block sizes (64 B stripes, 1 KiB blocks) and odd lengths.
  for (size_t piece : {size_t{1}, size_t{63}, size_t{64}, size_t{1000}, size_t{1024}, size_t{4096},
                       size_t{256u << 10}, bytes.size()}) {
    Checksum64Stream hash;
    for (size_t at = 0; at < bytes.size(); at += piece)
      hash.Update(std::span(bytes).subspan(at, std::min(piece, bytes.size() - at)));
    EXPECT_EQ(hash.Digest(), whole) << "pieces of " << piece;
  }
  Checksum64Stream empty;
  EXPECT_EQ(empty.Digest(), Checksum64({}));
  // A changed byte changes the digest: the stream hashes what it is given, not a cached value.
  std::vector<uint8_t> changed = bytes;
  changed[12345] ^= 1;
  Checksum64Stream other;
  other.Update(changed);
  EXPECT_NE(other.Digest(), whole);
}

// Every XXH3 entry point available computes the plain library's function: whole, and streamed
// in pieces that cross the internal stripes, blocks and the vector loops' own steps; lengths 0
// to 4 KiB byte by byte (xxhash has separate paths for 0-16, 17-128, 129-240 and longer).
TEST(ChecksumTest, EveryVariantComputesThePlainLibrarysHash) {
  using checksum_internal::AvailableXxh3Variants;
  using checksum_internal::LibraryXxh3;
  const std::vector<uint8_t> bytes = Pattern(3u << 20);
  const auto library = [&](size_t length) { return LibraryXxh3().hash(bytes.data(), length); };
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 4096; ++n)
    lengths.push_back(n);
  for (size_t n : {size_t{65535}, size_t{65536}, size_t{256u << 10} + 7, bytes.size()})
    lengths.push_back(n);
  for (const checksum_internal::Xxh3Variant* variant : AvailableXxh3Variants()) {
    SCOPED_TRACE(std::string(variant->name));
    for (size_t n : lengths)
      ASSERT_EQ(variant->hash(bytes.data(), n), library(n)) << n << " bytes";
    for (size_t piece :
         {size_t{1}, size_t{37}, size_t{64}, size_t{1024}, size_t{4099}, size_t{256u << 10}}) {
      XXH3_state_t state;
      XXH3_64bits_reset(&state);
      for (size_t at = 0; at < bytes.size(); at += piece)
        variant->update(&state, bytes.data() + at, std::min(piece, bytes.size() - at));
      EXPECT_EQ(XXH3_64bits_digest(&state), library(bytes.size())) << "pieces of " << piece;
    }
  }
}

// Checksum64 runs the library's CPU dispatch where the library has one (x86-64).
TEST(ChecksumTest, TheDispatchingEntryPointsAreSelectedWhereAvailable) {
  const char* forced = std::getenv("GPULAZY_XXH3");
  if (forced != nullptr && std::string_view(forced) == "library") {
    EXPECT_EQ(checksum_internal::SelectedXxh3().name, "library");
    return;
  }
  EXPECT_EQ(checksum_internal::SelectedXxh3().name,
            checksum_internal::DispatchXxh3() != nullptr ? "dispatch" : "library");
#if defined(__x86_64__) && __has_include(<xxh_x86dispatch.h>)
  // Debian's x86-64 libxxhash has it: a build that failed to detect it would quietly hash at
  // SSE2 speed.
  EXPECT_NE(checksum_internal::DispatchXxh3(), nullptr);
#endif
}

// Found by fuzz_chunk_codec (corpus/chunk_codec/crash-zero-codec-empty-raw): a ZERO chunk of
// raw length 0 decoded into an empty vector passed memset a null pointer (UBSan: nonnull).
TEST(ChunkCodecTest, EmptyZeroChunkIntoAnEmptyBuffer) {
  std::vector<uint8_t> empty;
  EXPECT_TRUE(DecodeChunkBytes(manifest::CODEC_ZERO, Checksum64({}), {}, empty, "t").ok());
  EXPECT_TRUE(DecodeChunkBytes(manifest::CODEC_RAW, Checksum64({}), {}, empty, "t").ok());
  EXPECT_EQ(DecodeChunkBytes(manifest::CODEC_LZ4, Checksum64({}), {}, empty, "t").code(),
            Code::kCorrupt);
}

// --- Frames --------------------------------------------------------------------------------

// ZeroChecksum64 stands in for hashing a zero chunk's bytes: it must be that hash for every
// length (remembered or not, around the block it hashes in), and a zero chunk whose checksum is
// anything else is refused.
TEST(ChecksumTest, ZeroChecksumIsTheChecksumOfThatManyZeros) {
  for (uint64_t length : {0ull, 1ull, 240ull, 4096ull, 65535ull, 65536ull, 65537ull, 1ull << 20,
                          (4ull << 20) + 4096, 4096ull}) {
    const std::vector<uint8_t> zeros(length);
    EXPECT_EQ(ZeroChecksum64(length), Checksum64(zeros)) << length;
  }
  for (uint64_t length = 1; length <= 40; ++length)  // more lengths than it remembers
    EXPECT_EQ(ZeroChecksum64(length * 4096), Checksum64(std::vector<uint8_t>(length * 4096)));
  std::vector<uint8_t> raw(4096, 0xff);
  EXPECT_TRUE(DecodeChunkBytes(manifest::CODEC_ZERO, ZeroChecksum64(4096), {}, raw, "z").ok());
  EXPECT_TRUE(std::all_of(raw.begin(), raw.end(), [](uint8_t b) { return b == 0; }));
  Status bad = DecodeChunkBytes(manifest::CODEC_ZERO, ZeroChecksum64(4096) ^ 1, {}, raw, "z");
  EXPECT_EQ(bad.code(), Code::kCorrupt);
  EXPECT_NE(bad.message().find("checksum mismatch"), std::string::npos) << bad.message();
}

TEST(FrameTest, RoundTrip) {
  FrameLimits limits;
  std::string payload = "chunk bytes \x00\x01\x02";
  auto head = EncodeFrameHead(ChunkHeader(), static_cast<uint32_t>(payload.size()), limits);
  ASSERT_TRUE(head.ok()) << head.status().ToString();
  std::vector<uint8_t> buffer = Bytes(*head + payload + "next frame starts");
  auto frame = TryDecodeFrame(buffer, limits);
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  ASSERT_TRUE(frame->has_value());
  const DecodedFrame& f = **frame;
  EXPECT_EQ(f.frame_size, head->size() + payload.size());
  EXPECT_EQ(std::string(f.payload.begin(), f.payload.end()), payload);
  EXPECT_EQ(f.header.request_id(), 77u);
  ASSERT_TRUE(f.header.has_chunk());
  EXPECT_EQ(f.header.chunk().chunk(), 9u);
  EXPECT_EQ(f.header.chunk().codec(), manifest::CODEC_LZ4);
  EXPECT_EQ(f.header.chunk().checksum(), 0x0123456789abcdefull);
}

TEST(FrameTest, PrefixIsLittleEndianLengths) {
  auto head = EncodeFrameHead(ChunkHeader(), 1234, FrameLimits{});
  ASSERT_TRUE(head.ok());
  auto* p = reinterpret_cast<const uint8_t*>(head->data());
  EXPECT_EQ(LoadLe32(p), head->size() - kFramePrefixSize);
  EXPECT_EQ(LoadLe32(p + 4), 1234u);
}

TEST(FrameTest, TruncatedBuffersAreIncomplete) {
  FrameLimits limits;
  std::string payload(100, 'x');
  auto head = EncodeFrameHead(ChunkHeader(), 100, limits);
  ASSERT_TRUE(head.ok());
  std::vector<uint8_t> whole = Bytes(*head + payload);
  for (size_t n = 0; n < whole.size(); ++n) {
    auto frame = TryDecodeFrame(std::span<const uint8_t>(whole.data(), n), limits);
    ASSERT_TRUE(frame.ok()) << n << ": " << frame.status().ToString();
    EXPECT_FALSE(frame->has_value()) << n;
  }
  auto frame = TryDecodeFrame(whole, limits);
  ASSERT_TRUE(frame.ok());
  EXPECT_TRUE(frame->has_value());
}

TEST(FrameTest, OversizedLengthsRejectedFromPrefixAlone) {
  FrameLimits limits;
  limits.max_header = 1024;
  limits.max_payload = 4096;
  // Only the 8-byte prefix is present: the verdict must not wait for (or allocate) the body.
  uint8_t prefix[8];
  StoreLe32(prefix, 1025);
  StoreLe32(prefix + 4, 10);
  auto r = TryDecodeFrame(prefix, limits);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kResourceExhausted);
  StoreLe32(prefix, 10);
  StoreLe32(prefix + 4, 4097);
  r = TryDecodeFrame(prefix, limits);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kResourceExhausted);
  StoreLe32(prefix, 0xffffffffu);
  StoreLe32(prefix + 4, 0xffffffffu);
  EXPECT_FALSE(DecodeFramePrefix(prefix, limits).ok());
  StoreLe32(prefix, 0);
  StoreLe32(prefix + 4, 0);
  EXPECT_EQ(DecodeFramePrefix(prefix, limits).status().code(), Code::kCorrupt);
  EXPECT_FALSE(DecodeFramePrefix(std::span<const uint8_t>(prefix, 7), limits).ok());
}

// The openings other protocols send first, as a gpulazy reader sees them in place of a frame.
TEST(FrameTest, OtherProtocolsAreNamedWhereAFrameWasExpected) {
  // A TLS 1.2/1.3 ClientHello record (type 22, legacy version 3.1, 512 bytes, ClientHello) and
  // a fatal protocol_version alert, the records a plain peer of a TLS end receives.
  const uint8_t client_hello[8] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01};
  const uint8_t alert[7] = {0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46};
  EXPECT_EQ(ForeignProtocol(client_hello), "a TLS handshake");
  EXPECT_EQ(ForeignProtocol(alert), "a TLS alert");
  EXPECT_EQ(ForeignProtocol(Bytes("GET / HTTP/1.1\r\n")), "an HTTP request");
  EXPECT_EQ(ForeignProtocol(Bytes("HTTP/1.1 400 Bad Request")), "an HTTP response");
  EXPECT_EQ(ForeignProtocol(Bytes("PRI * HTTP/2.0")), "an HTTP/2 preface");
  EXPECT_EQ(ForeignProtocol(Bytes("SSH-2.0-OpenSSH_9.2")), "an SSH banner");
  // A real frame's prefix, and bytes too few to tell, are nothing else's.
  wire::Header header;
  header.mutable_hello()->set_max_version(2);
  Result<std::string> frame = EncodeFrameHead(header, 0, FrameLimits{});
  ASSERT_TRUE(frame.ok());
  EXPECT_EQ(ForeignProtocol(Bytes(*frame)), std::nullopt);
  EXPECT_EQ(ForeignProtocol(Bytes("GE")), std::nullopt);
  EXPECT_EQ(ForeignProtocol({}), std::nullopt);
  // Where the prefix is refused, the message says what it looks like.
  Result<FramePrefix> tls = DecodeFramePrefix(client_hello, FrameLimits{});
  ASSERT_FALSE(tls.ok());
  EXPECT_EQ(tls.status().code(), Code::kResourceExhausted);
  EXPECT_THAT(tls.status().message(),
              ::testing::HasSubstr("look like a TLS handshake, not a gpulazy frame"));
  Result<FramePrefix> http = DecodeFramePrefix(Bytes("GET / HT"), FrameLimits{});
  ASSERT_FALSE(http.ok());
  EXPECT_THAT(http.status().message(), ::testing::HasSubstr("an HTTP request"));
  // An ordinary oversized prefix gets no guess.
  uint8_t oversized[8];
  StoreLe32(oversized, 1u << 20);
  StoreLe32(oversized + 4, 0);
  Result<FramePrefix> plain = DecodeFramePrefix(oversized, FrameLimits{});
  ASSERT_FALSE(plain.ok());
  EXPECT_THAT(plain.status().message(), ::testing::Not(::testing::HasSubstr("look like")));
}

TEST(FrameTest, EncoderRefusesOversizedPayload) {
  FrameLimits limits;
  limits.max_payload = 100;
  EXPECT_FALSE(EncodeFrameHead(ChunkHeader(), 101, limits).ok());
  EXPECT_TRUE(EncodeFrameHead(ChunkHeader(), 100, limits).ok());
  limits.max_header = 4;
  EXPECT_FALSE(EncodeFrameHead(ChunkHeader(), 1, limits).ok());
  EXPECT_FALSE(EncodeFrameHead(wire::Header(), 0, FrameLimits{}).ok());  // empty header
}

TEST(FrameTest, GarbageHeaderRejected) {
  std::string garbage = "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff";
  uint8_t prefix[8];
  StoreLe32(prefix, static_cast<uint32_t>(garbage.size()));
  StoreLe32(prefix + 4, 0);
  std::vector<uint8_t> buffer(prefix, prefix + 8);
  buffer.insert(buffer.end(), garbage.begin(), garbage.end());
  auto r = TryDecodeFrame(buffer, FrameLimits{});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kCorrupt);
}

TEST(FrameTest, HeaderWithoutBodyRejected) {
  wire::Header header;
  header.set_request_id(5);  // valid protobuf, but no message in the oneof
  std::string bytes = header.SerializeAsString();
  auto r = DecodeFrameHeader(Bytes(bytes));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kCorrupt);
}

// --- gpulazy file header -------------------------------------------------------------------

TEST(FileHeaderTest, RoundTripAndLayout) {
  FileHeader header;
  header.magic = kManifestMagic;
  header.payload_length = 0x1122334455667788ull;
  header.payload_checksum = 0x99aabbccddeeff00ull;
  auto bytes = EncodeFileHeader(header);
  EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 8), "GPLZMANI");
  EXPECT_EQ(LoadLe32(bytes.data() + 8), 1u);
  EXPECT_EQ(LoadLe32(bytes.data() + 12), 0u);
  EXPECT_EQ(bytes[16], 0x88);  // little-endian
  auto decoded = DecodeFileHeader(bytes, kManifestMagic, "m");
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->payload_length, header.payload_length);
  EXPECT_EQ(decoded->payload_checksum, header.payload_checksum);
}

TEST(FileHeaderTest, BadMagicVersionFlagsAndLength) {
  FileHeader header;
  header.magic = kChunkFileMagic;
  auto bytes = EncodeFileHeader(header);
  auto r = DecodeFileHeader(bytes, kManifestMagic, "gpulazy-manifest.img");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kCorrupt);
  EXPECT_THAT(r.status().message(), HasSubstr("gpulazy-manifest.img"));

  auto v2 = bytes;
  StoreLe32(v2.data() + 8, 2);
  EXPECT_EQ(DecodeFileHeader(v2, kChunkFileMagic, "c").status().code(), Code::kUnsupported);
  auto flags = bytes;
  StoreLe32(flags.data() + 12, 1);
  EXPECT_EQ(DecodeFileHeader(flags, kChunkFileMagic, "c").status().code(), Code::kUnsupported);
  EXPECT_EQ(DecodeFileHeader(std::span<const uint8_t>(bytes.data(), 31), kChunkFileMagic, "c")
                .status()
                .code(),
            Code::kCorrupt);
  EXPECT_TRUE(DecodeFileHeader(bytes, kChunkFileMagic, "c").ok());
}

// --- CRIU image header and names -----------------------------------------------------------

TEST(CriuFileTest, HeaderIsLittleEndian) {
  uint8_t out[criu_format::kHeaderSize];
  criu_format::EncodeHeader(0x0102030405060708ull, out);
  const uint8_t expected[] = {8, 7, 6, 5, 4, 3, 2, 1};
  EXPECT_TRUE(std::equal(out, out + 8, expected));
  EXPECT_EQ(criu_format::DecodeHeader(out), 0x0102030405060708ull);
  criu_format::EncodeHeader(5ull << 32, out);  // past 4 GiB
  EXPECT_EQ(criu_format::DecodeHeader(out), 5ull << 32);
}

TEST(CriuFileTest, Names) {
  EXPECT_EQ(criu_format::KfdImageName(12), "amdgpu-kfd-12.img");
  EXPECT_EQ(criu_format::PagesImageName(12, 0xab), "amdgpu-pages-12-00ab.img");
  EXPECT_EQ(criu_format::PagesImageName(1, 0x1c0de), "amdgpu-pages-1-1c0de.img");
  EXPECT_EQ(criu_format::RenderNodeImageName(3), "amdgpu-renderD-3.img");
}

TEST(CriuFileTest, ParseRejectsGarbage) {
  std::vector<uint8_t> garbage = {0xff, 0xff, 0xff};
  EXPECT_EQ(criu_format::ParseKfdProcess(garbage, "x").status().code(), Code::kCorrupt);
  EXPECT_EQ(criu_format::ParseRenderNode(garbage, "x").status().code(), Code::kCorrupt);
  // Empty: every required field is missing.
  EXPECT_EQ(criu_format::ParseKfdProcess({}, "x").status().code(), Code::kCorrupt);
}

namespace {
std::vector<uint8_t> Bytes(const google::protobuf::MessageLite& m, bool partial = false) {
  std::string s = partial ? m.SerializePartialAsString() : m.SerializeAsString();
  return {s.begin(), s.end()};
}
criu::RenderNode OneBoNode() {
  criu::RenderNode node;
  node.set_gpu_id(0xc0de);
  node.set_file_id(7);
  node.set_drm_render_minor(128);
  node.set_bo_count(1);
  criu::RenderBo* bo = node.add_bos();
  bo->set_gpu_va(0x100000);
  bo->set_size(8192);
  bo->set_mmap_offset(0x1000);
  bo->set_alloc_flags(0);
  bo->set_alignment(4096);
  bo->set_preferred_domains(criu_format::kGemDomainVram);
  bo->set_handle(1);
  bo->set_is_import(0);
  bo->set_mapping_count(1);
  criu::RenderBoMapping* m = bo->add_mappings();
  m->set_gpu_va(0x100000);
  m->set_size(8192);
  m->set_offset_in_bo(0);
  m->set_flags(0);
  return node;
}
}  // namespace

TEST(CriuFileTest, RenderNodeForms) {
  criu::RenderNode release;  // CRIU 4.x: gpu_id alone
  release.set_gpu_id(0xc0de);
  auto r = criu_format::ParseRenderNode(Bytes(release, true), "x");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->gpu_id(), 0xc0deu);
  EXPECT_EQ(r->bos_size(), 0);
  auto full = criu_format::ParseRenderNode(Bytes(OneBoNode()), "x");
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  EXPECT_EQ(full->bos(0).mappings(0).size(), 8192u);
  // Half of criu-dev's fields: neither form.
  criu::RenderNode half;
  half.set_gpu_id(1);
  half.set_file_id(2);
  EXPECT_EQ(criu_format::ParseRenderNode(Bytes(half, true), "x").status().code(), Code::kCorrupt);
  EXPECT_EQ(criu_format::ParseRenderNode({}, "x").status().code(), Code::kCorrupt);
}

TEST(CriuFileTest, RenderNodeBoTableIsChecked) {
  auto expect_corrupt = [](const criu::RenderNode& node, const char* why) {
    auto r = criu_format::ParseRenderNode(Bytes(node, true), "amdgpu-renderD-7.img");
    ASSERT_FALSE(r.ok()) << why;
    EXPECT_EQ(r.status().code(), Code::kCorrupt) << why;
    EXPECT_THAT(r.status().message(), ::testing::HasSubstr("amdgpu-renderD-7.img")) << why;
  };
  criu::RenderNode n = OneBoNode();
  n.set_bo_count(2);
  expect_corrupt(n, "BO count");
  n = OneBoNode();
  n.mutable_bos(0)->set_size(0);
  expect_corrupt(n, "zero size");
  n = OneBoNode();
  *n.add_bos() = n.bos(0);
  n.set_bo_count(2);
  expect_corrupt(n, "repeated handle");
  n = OneBoNode();
  n.mutable_bos(0)->set_mapping_count(3);
  expect_corrupt(n, "mapping count");
  n = OneBoNode();
  n.mutable_bos(0)->mutable_mappings(0)->set_offset_in_bo(4096);
  expect_corrupt(n, "mapping past the end");
  n = OneBoNode();
  n.mutable_bos(0)->mutable_mappings(0)->set_offset_in_bo(~0ull);
  expect_corrupt(n, "offset overflow");
  n = OneBoNode();
  n.mutable_bos(0)->mutable_mappings(0)->set_gpu_va(~0ull - 100);
  expect_corrupt(n, "VA wraps");
}

TEST(CriuFileTest, DrmPagesAndDmabufNames) {
  EXPECT_EQ(criu_format::DrmPagesImageName(3, 128, 10), "amdgpu-drm-pages-3-128-000a.img");
  criu::DmabufNode d;
  d.set_gem_handle(9);
  auto r = criu_format::ParseDmabufNode(Bytes(d), "x");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->gem_handle(), 9u);
  EXPECT_FALSE(criu_format::ParseDmabufNode({}, "x").ok());
}

// --- Sizes ---------------------------------------------------------------------------------

TEST(SizeTest, Accepts) {
  EXPECT_EQ(*ParseSize("12"), 12u);
  EXPECT_EQ(*ParseSize("4K"), 4096u);
  EXPECT_EQ(*ParseSize("4KiB"), 4096u);
  EXPECT_EQ(*ParseSize("4k"), 4096u);
  EXPECT_EQ(*ParseSize("512M"), 512ull << 20);
  EXPECT_EQ(*ParseSize("1.5G"), 3ull << 29);
  EXPECT_EQ(*ParseSize("2T"), 2ull << 40);
}

TEST(SizeTest, Rejects) {
  for (const char* text : {"", "M", "4X", "-1", "99999999999T", "1.2.3M", " 4K", "4 K"}) {
    auto r = ParseSize(text);
    EXPECT_FALSE(r.ok()) << "'" << text << "' parsed as " << (r.ok() ? *r : 0);
  }
  EXPECT_EQ(ParseSize("99999999999T").status().code(), Code::kOutOfRange);
}

TEST(SizeTest, Formats) {
  EXPECT_EQ(FormatSize(100), "100 B");
  EXPECT_EQ(FormatSize(512ull << 20), "512.0 MiB");
}

}  // namespace
}  // namespace gpulazy
