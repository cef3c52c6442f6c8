// A placed restore whose connections all break at once mid-stream, for a placement backend's
// tests (memfd in tests/server, cuda in tests/cuda): the client reconnects and its new session
// names the broken one, which the server ends before it places again (docs/protocol.md,
// "Placement", 6).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <thread>

#include "page-client/restore_session.h"
#include "tests/server/test_support.h"
#include "tests/support/unix_relay.h"

namespace gpulazy::server::testing {

// The stream connection and three lanes: lanes come on any host, whatever its CPUs.
inline constexpr uint32_t kCutBulkConnections = 4;

// A session through `relay_socket` that reconnects at once, many times over.
inline client::SessionOptions CutSessionOptions(const std::filesystem::path& relay_socket,
                                                const std::string& image) {
  client::SessionOptions options;
  options.endpoint = "unix:" + relay_socket.string();
  options.image = image;
  options.reconnect.max_attempts = 20;
  options.reconnect.initial_backoff = std::chrono::milliseconds(10);
  options.reconnect.max_backoff = std::chrono::milliseconds(50);
  options.lanes = kCutBulkConnections;
  return options;
}

// Cuts every connection of the started `session` once the server has placed a chunk, and waits
// for the restore to complete: reconnected, every byte placed, the server's log clean of failed
// closes, and, where the server did not see the break, the old session superseded by the new.
// Terminates `server`. The caller checks the bytes.
inline void CutMidStreamAndFinish(client::RestoreSession& session,
                                  gpulazy::testing::UnixRelay& relay, ServerProcess& server,
                                  bool server_notices) {
  // Only once every connection is through the relay: one that joined after the cut would be
  // closed by the client in the open, and the server would end the session itself, as when it
  // sees the break.
  auto all_joined = [&] {
    const client::Progress progress = session.progress();
    return progress.placed_chunks > 0 && progress.lanes == kCutBulkConnections - 1 &&
           relay.connections() == kCutBulkConnections + 1;  // and the demand connection
  };
  for (int i = 0; i < 5000 && !all_joined(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(all_joined()) << relay.connections() << " connections through the relay, "
                            << session.progress().lanes << " lanes joined";
  relay.Cut(server_notices);
  const client::Progress at_cut = session.progress();
  ASSERT_LT(at_cut.placed_chunks, at_cut.total_chunks) << "not cut mid-stream";
  Status complete = session.WaitComplete(std::chrono::seconds(60));
  ASSERT_TRUE(complete.ok()) << complete.ToString() << server.Log().substr(0, 20000);
  EXPECT_GE(session.progress().reconnects, 1u);
  EXPECT_EQ(session.progress().placed_bytes, session.progress().total_bytes);
  EXPECT_EQ(server.Terminate(), 0) << server.Log().substr(0, 20000);
  const std::string log = server.Log();
  if (!server_notices) {
    EXPECT_NE(log.find("superseded; its placements ended"), std::string::npos)
        << log.substr(0, 20000);
  }
  EXPECT_EQ(log.find("closing a destination"), std::string::npos) << log.substr(0, 20000);
}

}  // namespace gpulazy::server::testing
