// The image table codec of protocol version 2 (proto/image_table.h): what a server makes of a
// manifest, and the client's assembly of untrusted pieces.
#include "proto/image_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <span>
#include <string>

namespace gpulazy {
namespace {

using ::testing::HasSubstr;

std::span<const uint8_t> Span(const std::string& s, size_t offset = 0,
                              size_t length = std::string::npos) {
  const std::string_view view = std::string_view(s).substr(offset, length);
  return {reinterpret_cast<const uint8_t*>(view.data()), view.size()};
}

manifest::Manifest ManifestWithProfile() {
  manifest::Manifest m;
  for (uint32_t i = 0; i < 3; ++i) {
    manifest::Bo* bo = m.add_bos();
    bo->set_process_id(7);
    bo->set_bo_index(i);
    bo->set_gpu_id(0x1234);
    bo->set_gpu_va(0x7f0000000000 + i * 0x100000);
    bo->set_size(5000 * (i + 1));
    bo->set_alloc_flags(1);
    for (uint32_t c = 0; c <= i; ++c)
      bo->add_chunks();
  }
  for (uint32_t i = 0; i < 3; ++i) {
    manifest::ChunkRef* ref = m.mutable_profile()->add_order();
    ref->set_bo(2 - i);
    ref->set_chunk(0);
  }
  m.mutable_profile()->set_hot_count(2);
  m.mutable_profile()->set_source("recorded");
  return m;
}

TEST(ImageTable, ListsEveryBoAndCutsTheProfileToItsHotSet) {
  const wire::ImageTable table = MakeImageTable(ManifestWithProfile());
  ASSERT_EQ(table.bos_size(), 3);
  EXPECT_EQ(table.bos(2).bo_index(), 2u);
  EXPECT_EQ(table.bos(2).size(), 15000u);
  EXPECT_EQ(table.bos(2).chunk_count(), 3u);
  EXPECT_EQ(table.bos(1).gpu_va(), 0x7f0000100000u);
  EXPECT_EQ(table.bos(0).gpu_id(), 0x1234u);
  EXPECT_EQ(table.profile().hot_count(), 2u);
  ASSERT_EQ(table.profile().order_size(), 2);
  EXPECT_EQ(table.profile().order(0).bo(), 2u);
  EXPECT_EQ(table.profile().source(), "recorded");
  // A hot_count past the order keeps the whole order.
  manifest::Manifest m = ManifestWithProfile();
  m.mutable_profile()->set_hot_count(10);
  EXPECT_EQ(MakeImageTable(m).profile().order_size(), 3);
}

TEST(ImageTable, AssemblesPiecesOfAnySize) {
  const std::string bytes = MakeImageTable(ManifestWithProfile()).SerializeAsString();
  for (size_t first : {size_t{0}, size_t{1}, bytes.size()}) {
    SCOPED_TRACE(first);
    Result<TableAssembler> table = TableAssembler::Begin(bytes.size());
    ASSERT_TRUE(table.ok());
    ASSERT_TRUE(table->Add(Span(bytes, 0, first), false).ok());
    for (size_t offset = first; offset < bytes.size(); offset += 5)
      ASSERT_TRUE(table->Add(Span(bytes, offset, 5), true).ok());
    EXPECT_TRUE(table->complete());
    Result<wire::ImageTable> parsed = table->Finish();
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(parsed->SerializeAsString(), bytes);
  }
}

TEST(ImageTable, AnEmptyTableIsAnImageWithoutBos) {
  Result<TableAssembler> table = TableAssembler::Begin(0);
  ASSERT_TRUE(table.ok());
  ASSERT_TRUE(table->Add({}, false).ok());
  Result<wire::ImageTable> parsed = table->Finish();
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->bos_size(), 0);
}

TEST(ImageTable, UntrustedLengthsAreRefused) {
  // Over the limit: refused before anything is allocated.
  Result<TableAssembler> huge = TableAssembler::Begin(1ull << 40, 64u << 20);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), Code::kResourceExhausted);
  EXPECT_THAT(huge.status().message(), HasSubstr("over the limit"));

  const std::string bytes = MakeImageTable(ManifestWithProfile()).SerializeAsString();
  Result<TableAssembler> table = TableAssembler::Begin(bytes.size() - 1);
  ASSERT_TRUE(table.ok());
  Status past = table->Add(Span(bytes), false);  // one byte more than announced
  EXPECT_EQ(past.code(), Code::kCorrupt);
  EXPECT_THAT(past.message(), HasSubstr("announced bytes missing"));

  table = TableAssembler::Begin(bytes.size());
  ASSERT_TRUE(table->Add(Span(bytes, 0, 4), false).ok());
  Status empty = table->Add({}, true);  // no progress: a loop a server could keep us in
  EXPECT_EQ(empty.code(), Code::kCorrupt);
  Result<wire::ImageTable> early = table->Finish();
  ASSERT_FALSE(early.ok());
  EXPECT_THAT(early.status().message(), HasSubstr("incomplete"));

  const std::string garbage(64, '\xff');
  table = TableAssembler::Begin(garbage.size());
  ASSERT_TRUE(table->Add(Span(garbage), false).ok());
  Result<wire::ImageTable> parsed = table->Finish();
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), Code::kCorrupt);
}

}  // namespace
}  // namespace gpulazy
