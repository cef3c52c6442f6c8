#include "proto/recent_values.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace gpulazy {
namespace {

TEST(RecentValues, KeepsEverythingUntilFullThenTheLatestOldestFirst) {
  RecentValues<int> recent(3);
  EXPECT_EQ(recent.size(), 0u);
  EXPECT_TRUE(recent.OldestFirst().empty());
  recent.Add(1);
  recent.Add(2);
  EXPECT_EQ(recent.OldestFirst(), (std::vector<int>{1, 2}));
  recent.Add(3);
  EXPECT_EQ(recent.OldestFirst(), (std::vector<int>{1, 2, 3}));
  // Every position of the wrap: the oldest is dropped, order stays oldest first.
  recent.Add(4);
  EXPECT_EQ(recent.OldestFirst(), (std::vector<int>{2, 3, 4}));
  recent.Add(5);
  EXPECT_EQ(recent.OldestFirst(), (std::vector<int>{3, 4, 5}));
  recent.Add(6);
  EXPECT_EQ(recent.OldestFirst(), (std::vector<int>{4, 5, 6}));
  recent.Add(7);
  EXPECT_EQ(recent.OldestFirst(), (std::vector<int>{5, 6, 7}));
  EXPECT_EQ(recent.size(), 3u);
  EXPECT_EQ(recent.capacity(), 3u);
}

TEST(RecentValues, UnorderedHoldsTheSameValues) {
  RecentValues<std::string> recent(2);
  for (const char* s : {"a", "b", "c"})
    recent.Add(s);
  std::vector<std::string> unordered = recent.Unordered();
  std::sort(unordered.begin(), unordered.end());
  EXPECT_EQ(unordered, (std::vector<std::string>{"b", "c"}));
}

}  // namespace
}  // namespace gpulazy
