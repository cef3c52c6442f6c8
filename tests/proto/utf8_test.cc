// proto/utf8.h against protobuf itself: a string is valid for us exactly when a proto3 string
// field holding it survives serialization and parsing, so text we send is never a corrupt frame
// to its reader, and we replace nothing protobuf would have taken.
#include "proto/utf8.h"

#include <google/protobuf/stubs/logging.h>
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "proto/wire.pb.h"

namespace gpulazy {
namespace {

bool ProtobufTakes(const std::string& text) {
  google::protobuf::LogSilencer quiet;  // it logs every refusal
  wire::Error error;
  error.set_message(text);
  wire::Error parsed;
  return parsed.ParseFromString(error.SerializeAsString()) && parsed.message() == text;
}

std::string Bytes(std::initializer_list<int> bytes) {
  std::string s;
  for (int b : bytes)
    s.push_back(static_cast<char>(b));
  return s;
}

TEST(Utf8Test, EdgesOfEachLength) {
  for (const std::string& valid :
       {std::string(), std::string("plain"), Bytes({0x7F}), Bytes({0xC2, 0x80}),
        Bytes({0xDF, 0xBF}), Bytes({0xE0, 0xA0, 0x80}), Bytes({0xED, 0x9F, 0xBF}),
        Bytes({0xEE, 0x80, 0x80}), Bytes({0xEF, 0xBF, 0xBF}), Bytes({0xF0, 0x90, 0x80, 0x80}),
        Bytes({0xF4, 0x8F, 0xBF, 0xBF})}) {
    EXPECT_TRUE(IsValidUtf8(valid)) << testing::PrintToString(valid);
    EXPECT_TRUE(ProtobufTakes(valid)) << testing::PrintToString(valid);
  }
  for (const std::string& invalid :
       {Bytes({0x80}), Bytes({0xC0, 0x80}), Bytes({0xC1, 0xBF}), Bytes({0xE0, 0x9F, 0xBF}),
        Bytes({0xED, 0xA0, 0x80}), Bytes({0xF0, 0x8F, 0xBF, 0xBF}), Bytes({0xF4, 0x90, 0x80, 0x80}),
        Bytes({0xF5, 0x80, 0x80, 0x80}), Bytes({0xFF}), Bytes({0xE2, 0x82}), Bytes({'a', 0xC3})}) {
    EXPECT_FALSE(IsValidUtf8(invalid)) << testing::PrintToString(invalid);
    EXPECT_FALSE(ProtobufTakes(invalid)) << testing::PrintToString(invalid);
  }
}

TEST(Utf8Test, AgreesWithProtobufOnEveryTwoByteStringAndRandomLongerOnes) {
  for (int a = 0; a < 256; ++a) {
    for (int b = 0; b < 256; ++b) {
      const std::string s = Bytes({a, b});
      ASSERT_EQ(IsValidUtf8(s), ProtobufTakes(s)) << testing::PrintToString(s);
    }
  }
  // Longer strings drawn so that about half start a multi-byte character.
  std::mt19937 random(7);
  for (int i = 0; i < 100000; ++i) {
    std::string s;
    const int length = 3 + static_cast<int>(random() % 6);
    for (int j = 0; j < length; ++j)
      s.push_back(static_cast<char>(random() % 2 ? 0x80 + random() % 0x80 : random() % 0x100));
    ASSERT_EQ(IsValidUtf8(s), ProtobufTakes(s)) << testing::PrintToString(s);
  }
}

TEST(Utf8Test, CutStopsAtACharactersEdge) {
  const std::string euro = "\u20ac";  // three bytes
  const std::string text = "ab" + euro + "c";
  EXPECT_EQ(CutUtf8(text, 100), text);
  EXPECT_EQ(CutUtf8(text, 6), text);
  EXPECT_EQ(CutUtf8(text, 5), "ab" + euro);
  EXPECT_EQ(CutUtf8(text, 4), "ab");
  EXPECT_EQ(CutUtf8(text, 3), "ab");
  EXPECT_EQ(CutUtf8(text, 2), "ab");
  EXPECT_EQ(CutUtf8(text, 0), "");
  // A byte that starts nothing valid counts as one byte (ToValidUtf8 replaces it later).
  EXPECT_EQ(CutUtf8(Bytes({'a', 0xFF, 'b', 'c'}), 3), Bytes({'a', 0xFF, 'b'}));
  for (size_t max = 0; max <= text.size(); ++max)
    EXPECT_TRUE(IsValidUtf8(CutUtf8(text, max)));
}

TEST(Utf8Test, ToValidReplacesOnlyWhatIsInvalid) {
  EXPECT_EQ(ToValidUtf8("caf\u00e9"), "caf\u00e9");
  EXPECT_EQ(ToValidUtf8(Bytes({'a', 0xFF, 'b'})), "a\ufffdb");
  EXPECT_EQ(ToValidUtf8(Bytes({0xE2, 0x82})), "\ufffd\ufffd");              // a cut-off euro sign
  EXPECT_EQ(ToValidUtf8(Bytes({0xED, 0xA0, 0x80})), "\ufffd\ufffd\ufffd");  // a surrogate
  std::mt19937 random(11);
  for (int i = 0; i < 10000; ++i) {
    std::string s;
    for (int j = 0; j < 12; ++j)
      s.push_back(static_cast<char>(random()));
    const std::string valid = ToValidUtf8(s);
    ASSERT_TRUE(IsValidUtf8(valid));
    ASSERT_TRUE(ProtobufTakes(valid));
    if (IsValidUtf8(s)) {
      ASSERT_EQ(valid, s);
    }
  }
}

}  // namespace
}  // namespace gpulazy
