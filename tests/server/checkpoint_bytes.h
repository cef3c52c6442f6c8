// A gtest helper for tests that restore a test image into a host engine: every BO the session
// restored is byte for byte the checkpoint's contents (LoadCriuContents).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <span>
#include <vector>

#include "page-client/host_engine.h"
#include "page-client/restore_session.h"
#include "tests/server/test_support.h"

namespace gpulazy::server::testing {

inline void ExpectRestoredBytes(const client::RestoreSession& session,
                                const client::HostCopyEngine& host,
                                const std::map<BoKey, std::vector<uint8_t>>& expected) {
  for (uint32_t i = 0; i < session.bos().size(); ++i) {
    auto want = expected.find(BoKey{session.bos()[i].process_id, session.bos()[i].bo_index});
    ASSERT_NE(want, expected.end());
    Result<std::span<uint8_t>> got = host.Mapping(i);
    ASSERT_TRUE(got.ok());
    EXPECT_TRUE(std::ranges::equal(*got, want->second)) << "BO " << i;
  }
}

}  // namespace gpulazy::server::testing
