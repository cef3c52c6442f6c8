// The line splitter behind the operator's text files (--token-file, --image-access-file): what
// each line holds and the number an error message will quote for it.
#include "lazy-server/image/io.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gpulazy::image {
namespace {

std::vector<std::pair<size_t, std::string>> Lines(std::string_view text) {
  std::vector<std::pair<size_t, std::string>> out;
  for (const NumberedLine& line : SplitLines(text))
    out.emplace_back(line.number, std::string(line.text));
  return out;
}

using LineList = std::vector<std::pair<size_t, std::string>>;

TEST(SplitLinesTest, NumbersEveryLineFromOneBlankOnesIncluded) {
  EXPECT_EQ(Lines("a\n\n# c\nd\n"), (LineList{{1, "a"}, {2, ""}, {3, "# c"}, {4, "d"}}));
}

TEST(SplitLinesTest, ALastLineWithoutANewlineIsALine) {
  EXPECT_EQ(Lines("a\nb"), (LineList{{1, "a"}, {2, "b"}}));
  EXPECT_EQ(Lines("only"), (LineList{{1, "only"}}));
}

TEST(SplitLinesTest, EmptyTextHasNoLinesAndALoneNewlineOneEmptyLine) {
  EXPECT_TRUE(Lines("").empty());
  EXPECT_EQ(Lines("\n"), (LineList{{1, ""}}));
}

// A file edited on Windows: the '\r' before each '\n' is not part of the line, one elsewhere is.
TEST(SplitLinesTest, CarriageReturnsEndLinesOnlyBeforeANewlineOrTheEnd) {
  EXPECT_EQ(Lines("a\r\nb\r\n"), (LineList{{1, "a"}, {2, "b"}}));
  EXPECT_EQ(Lines("a\rb\nc\r"), (LineList{{1, "a\rb"}, {2, "c"}}));
  EXPECT_EQ(Lines("\r\n"), (LineList{{1, ""}}));
}

}  // namespace
}  // namespace gpulazy::image
