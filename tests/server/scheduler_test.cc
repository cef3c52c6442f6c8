// Unit tests of the page server's pure parts: the Scheduler (priorities, profile order,
// fairness, Have, re-requests, credit) and the ImageStore's path confinement.
#include "lazy-server/server/scheduler.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "lazy-server/image/synth.h"
#include "lazy-server/server/image_store.h"

namespace gpulazy::server {
namespace {

// bos[i] chunks of `chunk_size` bytes each; profile = pairs (bo, chunk); first hot entries hot.
manifest::Manifest MakeManifest(std::vector<uint32_t> bos, uint32_t chunk_size = 100,
                                std::vector<std::pair<uint32_t, uint32_t>> profile = {},
                                uint32_t hot = 0) {
  manifest::Manifest m;
  m.set_chunk_size(chunk_size);
  for (uint32_t count : bos) {
    manifest::Bo* bo = m.add_bos();
    bo->set_size(uint64_t{count} * chunk_size);
    for (uint32_t c = 0; c < count; ++c) {
      manifest::Chunk* chunk = bo->add_chunks();
      chunk->set_raw_length(chunk_size);
      chunk->set_stored_length(chunk_size);
    }
  }
  for (auto [b, c] : profile) {
    manifest::ChunkRef* ref = m.mutable_profile()->add_order();
    ref->set_bo(b);
    ref->set_chunk(c);
  }
  m.mutable_profile()->set_hot_count(hot);
  return m;
}

std::shared_ptr<const ImageLayout> Layout(const manifest::Manifest& m, bool lazy = false) {
  return std::make_shared<const ImageLayout>(ImageLayout::FromManifest(m, lazy));
}

google::protobuf::RepeatedPtrField<wire::ChunkRange> Ranges(
    std::vector<std::tuple<uint32_t, uint32_t, uint32_t>> ranges) {
  google::protobuf::RepeatedPtrField<wire::ChunkRange> out;
  for (auto [bo, first, count] : ranges) {
    wire::ChunkRange* r = out.Add();
    r->set_bo(bo);
    r->set_first_chunk(first);
    r->set_chunk_count(count);
  }
  return out;
}

// Picks until nothing is eligible, marking each sent at once. Returns (session, bo, chunk, prio).
struct Pick {
  SessionId session;
  uint32_t bo, chunk;
  wire::Priority priority;
  bool operator==(const Pick&) const = default;
};
std::vector<Pick> Drain(Scheduler& s, size_t max = 1000) {
  std::vector<Pick> out;
  while (out.size() < max) {
    std::optional<WorkItem> item = s.Next();
    if (!item) break;
    out.push_back({item->session, item->bo, item->chunk, item->priority});
    s.Done(*item, item->reserved_credit);
  }
  return out;
}

TEST(ImageLayoutTest, PlanFollowsProfileThenTableOrder) {
  ImageLayout layout = ImageLayout::FromManifest(
      MakeManifest({2, 3}, 100, {{1, 2}, {0, 1}, {1, 2}, {9, 9}}, 2), false);
  ASSERT_EQ(layout.plan().size(), 5u);
  EXPECT_EQ(layout.plan()[0].bo(), 1u);  // profile order, duplicates and bad entries dropped
  EXPECT_EQ(layout.plan()[0].chunk(), 2u);
  EXPECT_EQ(layout.plan()[1].bo(), 0u);
  EXPECT_EQ(layout.plan()[1].chunk(), 1u);
  EXPECT_EQ(layout.hot_end(), 2u);
  EXPECT_EQ(layout.plan()[2].bo(), 0u);  // then table order
  EXPECT_EQ(layout.plan()[2].chunk(), 0u);
  EXPECT_EQ(layout.plan()[3].chunk(), 0u);
  EXPECT_EQ(layout.plan()[4].chunk(), 1u);
}

TEST(ImageLayoutTest, CheckRangeRejectsOutOfRange) {
  ImageLayout layout = ImageLayout::FromManifest(MakeManifest({2, 3}), false);
  wire::ChunkRange r;
  r.set_bo(2);
  r.set_chunk_count(1);
  EXPECT_EQ(layout.CheckRange(r).code(), Code::kOutOfRange);
  r.set_bo(1);
  r.set_first_chunk(2);
  r.set_chunk_count(2);
  EXPECT_EQ(layout.CheckRange(r).code(), Code::kOutOfRange);
  r.set_first_chunk(0xffffffffu);
  r.set_chunk_count(0xffffffffu);  // no 32-bit wrap
  EXPECT_EQ(layout.CheckRange(r).code(), Code::kOutOfRange);
  r.set_first_chunk(0);
  r.set_chunk_count(0);
  EXPECT_EQ(layout.CheckRange(r).code(), Code::kOutOfRange);
  r.set_chunk_count(3);
  EXPECT_TRUE(layout.CheckRange(r).ok());
}

TEST(SchedulerTest, DemandBeforePrefetchBeforeBackground) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({4, 4}, 100, {{1, 3}}, 1)));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.StreamAll(1).ok());
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_BACKGROUND, Output::kStream, 7, Ranges({{0, 2, 1}}), Clock::now())
          .ok());
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 8, Ranges({{1, 1, 1}}), Clock::now())
          .ok());
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_PREFETCH, Output::kStream, 9, Ranges({{0, 3, 1}}), Clock::now())
          .ok());
  std::vector<Pick> picks = Drain(s);
  ASSERT_GE(picks.size(), 4u);
  EXPECT_EQ(picks[0], (Pick{1, 1, 1, wire::PRIORITY_DEMAND}));
  EXPECT_EQ(picks[1], (Pick{1, 0, 3, wire::PRIORITY_PREFETCH}));    // explicit prefetch
  EXPECT_EQ(picks[2], (Pick{1, 1, 3, wire::PRIORITY_PREFETCH}));    // hot set of the profile
  EXPECT_EQ(picks[3], (Pick{1, 0, 2, wire::PRIORITY_BACKGROUND}));  // explicit background
  EXPECT_EQ(picks[4], (Pick{1, 0, 0, wire::PRIORITY_BACKGROUND}));  // the rest, table order
  // Every chunk goes once: stream_all leaves out the 3 that requests sent.
  EXPECT_EQ(picks.size(), 8u);
  std::optional<StreamDoneInfo> done = s.TakeStreamDone(1);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->chunks, 5u);
  EXPECT_EQ(done->bytes, 500u);
  EXPECT_FALSE(s.TakeStreamDone(1).has_value());  // once
}

TEST(SchedulerTest, ProfileOrderThenTableOrder) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({3, 2}, 100, {{1, 1}, {0, 2}, {1, 0}}, 2)));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.StreamAll(1).ok());
  std::vector<Pick> picks = Drain(s);
  std::vector<Pick> want = {{1, 1, 1, wire::PRIORITY_PREFETCH},
                            {1, 0, 2, wire::PRIORITY_PREFETCH},
                            {1, 1, 0, wire::PRIORITY_BACKGROUND},
                            {1, 0, 0, wire::PRIORITY_BACKGROUND},
                            {1, 0, 1, wire::PRIORITY_BACKGROUND}};
  EXPECT_EQ(picks, want);
}

TEST(SchedulerTest, HaveExcludesChunksFromStreamAll) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({4})));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.Have(1, Ranges({{0, 1, 2}})).ok());
  ASSERT_TRUE(s.StreamAll(1).ok());
  std::vector<Pick> picks = Drain(s);
  ASSERT_EQ(picks.size(), 2u);
  EXPECT_EQ(picks[0].chunk, 0u);
  EXPECT_EQ(picks[1].chunk, 3u);
  EXPECT_EQ(s.TakeStreamDone(1)->chunks, 2u);
  // Out-of-range Have is refused as a whole.
  EXPECT_EQ(s.Have(1, Ranges({{0, 0, 1}, {5, 0, 1}})).code(), Code::kOutOfRange);
  // So is one naming more chunks than the image has (the same BO over and over: work under the
  // scheduler's lock for nothing); naming every chunk once is fine.
  EXPECT_EQ(s.Have(1, Ranges({{0, 0, 4}, {0, 0, 4}})).code(), Code::kInvalidArgument);
  EXPECT_EQ(s.Have(1, Ranges({{0, 0, 4}})).code(), Code::kOk);
}

// A Have after the stream began (a client abandoning the BOs of a process that exited): chunks
// not picked yet are skipped, one already picked still goes, and a Have that leaves nothing more
// to send ends the stream once what is in flight is done.
TEST(SchedulerTest, HaveMidStreamSkipsWhatIsNotPickedYetAndCanEndTheStream) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({3, 4})));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.StreamAll(1).ok());
  std::optional<WorkItem> first = s.Next();  // BO 0 chunk 0, in flight
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->bo, 0u);
  ASSERT_TRUE(s.Have(1, Ranges({{1, 0, 4}})).ok());  // BO 1 is no longer wanted
  s.Done(*first, first->reserved_credit);
  std::vector<Pick> picks = Drain(s);
  ASSERT_EQ(picks.size(), 2u);
  EXPECT_EQ(picks[0].bo, 0u);
  EXPECT_EQ(picks[1].bo, 0u);
  std::optional<StreamDoneInfo> done = s.TakeStreamDone(1);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->chunks, 3u);

  // Everything left held while a chunk is in flight: the stream ends when that one is done.
  s.AddSession(2, Layout(MakeManifest({3, 4})));
  s.AddCredit(2, 1 << 20);
  ASSERT_TRUE(s.StreamAll(2).ok());
  std::optional<WorkItem> only = s.Next();
  ASSERT_TRUE(only.has_value());
  ASSERT_TRUE(s.Have(2, Ranges({{0, 1, 2}, {1, 0, 4}})).ok());
  EXPECT_FALSE(s.TakeStreamDone(2).has_value());  // one chunk still in flight
  s.Done(*only, only->reserved_credit);
  EXPECT_FALSE(s.Next().has_value());
  done = s.TakeStreamDone(2);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->chunks, 1u);
}

TEST(SchedulerTest, EverythingHeldFinishesAtOnce) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({2})));
  ASSERT_TRUE(s.Have(1, Ranges({{0, 0, 2}})).ok());
  ASSERT_TRUE(s.StreamAll(1).ok());
  EXPECT_FALSE(s.Next().has_value());
  std::optional<StreamDoneInfo> done = s.TakeStreamDone(1);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->chunks, 0u);
}

// stream_all is taken once per session: a second one would send again what is in flight (or was
// sent) and, with everything held, walk the whole plan under the dispatcher's lock each time.
TEST(SchedulerTest, ASecondStreamAllIsRefusedAndSendsNothingAgain) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({4})));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.StreamAll(1).ok());
  std::optional<WorkItem> first = s.Next();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(s.StreamAll(1).code(), Code::kInvalidArgument);
  s.Done(*first, first->reserved_credit);
  std::vector<Pick> picks = Drain(s);
  ASSERT_EQ(picks.size(), 3u);  // chunks 1-3: chunk 0 is not picked again
  for (uint32_t i = 0; i < picks.size(); ++i)
    EXPECT_EQ(picks[i].chunk, i + 1);
  std::optional<StreamDoneInfo> done = s.TakeStreamDone(1);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->chunks, 4u);
  // Nor after StreamDone.
  EXPECT_EQ(s.StreamAll(1).code(), Code::kInvalidArgument);
  EXPECT_FALSE(s.Next().has_value());
}

TEST(SchedulerTest, ReRequestSendsAgainEvenWhenHeld) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({2})));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.Have(1, Ranges({{0, 0, 2}})).ok());
  for (int i = 0; i < 2; ++i)
    ASSERT_TRUE(
        s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kStream, 5, Ranges({{0, 1, 1}}), Clock::now())
            .ok());
  std::vector<Pick> picks = Drain(s);
  ASSERT_EQ(picks.size(), 2u);
  EXPECT_EQ(picks[0], picks[1]);
}

// A chunk demanded ahead of the plan's cursor (a fault, a resuming task's BOs) crosses the wire
// once: the plan skips it while its demand copy is in flight and after it was written. One
// whose demand copy was dropped unwritten (the demand connection closed) before the cursor came
// is streamed after all; the cursor does not wait for an undecided one.
TEST(SchedulerTest, StreamSkipsChunksSentOrInFlightForARequest) {
  Scheduler s(SchedulerLimits{1, 8, 256, 1 << 20});  // one stream chunk in flight at a time
  s.AddSession(1, Layout(MakeManifest({6})));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.StreamAll(1).ok());
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 1, Ranges({{0, 2, 3}}), Clock::now())
          .ok());
  std::optional<WorkItem> written = s.Next(Scheduler::Pick::kDemandOnly);    // chunk 2
  std::optional<WorkItem> in_flight = s.Next(Scheduler::Pick::kDemandOnly);  // chunk 3
  std::optional<WorkItem> dropped = s.Next(Scheduler::Pick::kDemandOnly);    // chunk 4
  ASSERT_TRUE(written && in_flight && dropped);
  ASSERT_EQ(dropped->chunk, 4u);
  s.Done(*written, written->reserved_credit);
  s.Done(*dropped, std::nullopt);
  std::vector<uint32_t> streamed;
  for (;;) {
    std::optional<WorkItem> item = s.Next(Scheduler::Pick::kNoDemand);
    if (!item) break;
    streamed.push_back(item->chunk);
    s.Done(*item, item->reserved_credit);
  }
  EXPECT_EQ(streamed, (std::vector<uint32_t>{0, 1, 4, 5}));
  // The stream is done only once nothing of its own is in flight; the demand copy of chunk 3
  // is the demand connection's business.
  std::optional<StreamDoneInfo> done = s.TakeStreamDone(1);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->chunks, 4u);
  s.Done(*in_flight, in_flight->reserved_credit);
  // Asked for again, a chunk sent before is sent again (a client re-fetching a bad copy).
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 2, Ranges({{0, 2, 1}}), Clock::now())
          .ok());
  std::optional<WorkItem> again = s.Next(Scheduler::Pick::kDemandOnly);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->chunk, 2u);
}

// Read-ahead hints follow what the plan will really send.
TEST(SchedulerTest, UpcomingLeavesOutChunksSentForARequest) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({4})));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.StreamAll(1).ok());
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 1, Ranges({{0, 1, 1}}), Clock::now())
          .ok());
  std::optional<WorkItem> demand = s.Next(Scheduler::Pick::kDemandOnly);
  ASSERT_TRUE(demand.has_value());
  std::vector<manifest::ChunkRef> next = s.Upcoming(1, 8);
  ASSERT_EQ(next.size(), 3u);
  EXPECT_EQ(next[0].chunk(), 0u);
  EXPECT_EQ(next[1].chunk(), 2u);
  EXPECT_EQ(next[2].chunk(), 3u);
}

TEST(SchedulerTest, RoundRobinAcrossSessions) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({100})));
  s.AddSession(2, Layout(MakeManifest({3})));
  s.AddSession(3, Layout(MakeManifest({3})));
  for (SessionId id : {1, 2, 3}) {
    s.AddCredit(id, 1 << 20);
    ASSERT_TRUE(s.StreamAll(id).ok());
  }
  std::vector<Pick> picks = Drain(s, 9);
  std::vector<SessionId> order;
  for (const Pick& p : picks)
    order.push_back(p.session);
  EXPECT_EQ(order, (std::vector<SessionId>{1, 2, 3, 1, 2, 3, 1, 2, 3}));
  // Once the small ones are done the big one gets everything.
  picks = Drain(s);
  EXPECT_EQ(picks.size(), 97u);
  for (const Pick& p : picks)
    EXPECT_EQ(p.session, 1u);
}

TEST(SchedulerTest, CreditGatesTheStreamButNotTheDemandConnection) {
  Scheduler s(SchedulerLimits{4, 8, 256, 1 << 20});
  s.AddSession(1, Layout(MakeManifest({10})));
  ASSERT_TRUE(s.StreamAll(1).ok());
  EXPECT_FALSE(s.Next().has_value());  // zero credit
  s.AddCredit(1, 250);
  std::vector<Pick> picks = Drain(s);
  EXPECT_EQ(picks.size(), 2u);  // 2 x 100 bytes; 50 left is not enough for the next
  EXPECT_EQ(s.Counters(1)->credit, 50u);
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 3, Ranges({{0, 9, 1}}), Clock::now())
          .ok());
  picks = Drain(s);
  ASSERT_EQ(picks.size(), 1u);
  EXPECT_EQ(picks[0].chunk, 9u);
  s.AddCredit(1, 50);
  EXPECT_EQ(Drain(s).size(), 1u);
}

// The Dispatcher's bulk lane picks with kNoDemand and may hold every read slot it has; the
// demand lane (kDemandOnly) must still get a session's demand item at once.
TEST(SchedulerTest, DemandOnlyPicksDemandWhileBulkPicksHoldTheStreamWindow) {
  Scheduler s(SchedulerLimits{2, 8, 256, 1 << 20});
  s.AddSession(1, Layout(MakeManifest({10})));
  s.AddSession(2, Layout(MakeManifest({10})));
  for (SessionId id : {1, 2}) {
    ASSERT_TRUE(s.StreamAll(id).ok());
    s.AddCredit(id, 1 << 20);
  }
  // Nothing but background work: kDemandOnly finds nothing, kNoDemand fills both windows.
  EXPECT_FALSE(s.Next(Scheduler::Pick::kDemandOnly).has_value());
  std::vector<WorkItem> bulk;
  while (auto item = s.Next(Scheduler::Pick::kNoDemand))
    bulk.push_back(*item);
  ASSERT_EQ(bulk.size(), 4u);  // 2 sessions x stream window 2
  for (const WorkItem& item : bulk)
    EXPECT_EQ(item.priority, wire::PRIORITY_BACKGROUND);

  // Demand on both outputs while every bulk slot is taken.
  ASSERT_TRUE(
      s.Enqueue(2, wire::PRIORITY_DEMAND, Output::kDemand, 7, Ranges({{0, 8, 1}}), Clock::now())
          .ok());
  EXPECT_FALSE(s.Next(Scheduler::Pick::kNoDemand).has_value()) << "bulk lane took a demand item";
  std::optional<WorkItem> demand = s.Next(Scheduler::Pick::kDemandOnly);
  ASSERT_TRUE(demand.has_value());
  EXPECT_EQ(demand->session, 2u);
  EXPECT_EQ(demand->chunk, 8u);
  EXPECT_EQ(demand->priority, wire::PRIORITY_DEMAND);
  EXPECT_EQ(demand->output, Output::kDemand);
  EXPECT_FALSE(s.Next(Scheduler::Pick::kDemandOnly).has_value());

  // A demand item for the stream output goes in the demand lane once the window has room, and
  // the bulk lane does not overtake it meanwhile (same output, higher priority first).
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kStream, 9, Ranges({{0, 9, 1}}), Clock::now())
          .ok());
  EXPECT_FALSE(s.Next(Scheduler::Pick::kDemandOnly).has_value());  // window of 2 is full
  s.Done(bulk[0], bulk[0].reserved_credit);                        // a session-1 chunk
  ASSERT_EQ(bulk[0].session, 1u);
  EXPECT_FALSE(s.Next(Scheduler::Pick::kNoDemand).has_value()) << "background overtook demand";
  demand = s.Next(Scheduler::Pick::kDemandOnly);
  ASSERT_TRUE(demand.has_value());
  EXPECT_EQ(demand->session, 1u);
  EXPECT_EQ(demand->chunk, 9u);
  EXPECT_EQ(demand->output, Output::kStream);
  EXPECT_GT(demand->reserved_credit, 0u);  // the stream output's credit still applies
}

// kAny (what tests and single-lane callers use) is unchanged: demand first, then the rest.
TEST(SchedulerTest, PickAnyStillMixesDemandAndBulk) {
  Scheduler s(SchedulerLimits{4, 8, 256, 1 << 20});
  s.AddSession(1, Layout(MakeManifest({4})));
  ASSERT_TRUE(s.StreamAll(1).ok());
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 1, Ranges({{0, 3, 1}}), Clock::now())
          .ok());
  std::vector<Pick> picks = Drain(s);
  ASSERT_EQ(picks.size(), 4u);  // the demanded chunk is not streamed again
  EXPECT_EQ(picks[0].priority, wire::PRIORITY_DEMAND);
  EXPECT_EQ(picks[0].chunk, 3u);
}

TEST(SchedulerTest, StreamWindowBoundsChunksInFlight) {
  Scheduler s(SchedulerLimits{2, 8, 256, 1 << 20});
  s.AddSession(1, Layout(MakeManifest({10})));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.StreamAll(1).ok());
  std::optional<WorkItem> a = s.Next();
  std::optional<WorkItem> b = s.Next();
  ASSERT_TRUE(a && b);
  EXPECT_FALSE(s.Next().has_value());
  // A demand request on the stream connection waits only for a slot, not for the plan.
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kStream, 4, Ranges({{0, 8, 1}}), Clock::now())
          .ok());
  s.Done(*a, a->reserved_credit);
  std::optional<WorkItem> c = s.Next();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->chunk, 8u);
  EXPECT_EQ(c->priority, wire::PRIORITY_DEMAND);
  EXPECT_EQ(c->request_id, 4u);
}

TEST(SchedulerTest, LanesDealTheStreamRoundRobinEachInItsOwnOrder) {
  Scheduler s(SchedulerLimits{2, 8, 256, 1 << 20});
  s.AddSession(1, Layout(MakeManifest({12})));
  s.AddCredit(1, 1 << 20);
  s.SetLanes(1, 3);
  s.SetLanes(1, 2);  // never shrinks
  ASSERT_TRUE(s.StreamAll(1).ok());
  // The window is per bulk connection: three connections, two chunks each in flight.
  std::vector<WorkItem> picked;
  while (std::optional<WorkItem> item = s.Next())
    picked.push_back(*item);
  ASSERT_EQ(picked.size(), 6u);
  for (uint32_t i = 0; i < picked.size(); ++i) {
    EXPECT_EQ(picked[i].chunk, i);
    EXPECT_EQ(picked[i].lane, i % 3) << "pick " << i;
    EXPECT_EQ(picked[i].stream_seq, i / 3) << "pick " << i;  // numbered per lane
  }
  // A demand chunk for the stream output keeps to the stream connection, where the client
  // counts what it asked for, and takes the next number there.
  ASSERT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kStream, 4, Ranges({{0, 11, 1}}), Clock::now())
          .ok());
  s.Done(picked[0], picked[0].reserved_credit);
  std::optional<WorkItem> demand = s.Next();
  ASSERT_TRUE(demand.has_value());
  EXPECT_EQ(demand->priority, wire::PRIORITY_DEMAND);
  EXPECT_EQ(demand->lane, 0u);
  EXPECT_EQ(demand->stream_seq, 2u);
  s.Done(picked[1], picked[1].reserved_credit);
  std::optional<WorkItem> next = s.Next();
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->chunk, 6u);
  EXPECT_EQ(next->lane, 0u);  // the deal goes on where it stopped
  EXPECT_EQ(next->stream_seq, 3u);
}

TEST(SchedulerTest, DroppedItemsReturnCredit) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({3})));
  s.AddCredit(1, 300);
  ASSERT_TRUE(s.StreamAll(1).ok());
  std::optional<WorkItem> item = s.Next();
  ASSERT_TRUE(item.has_value());
  EXPECT_EQ(s.Counters(1)->credit, 200u);
  s.Done(*item, std::nullopt);
  EXPECT_EQ(s.Counters(1)->credit, 300u);
}

TEST(SchedulerTest, DemandLimit) {
  Scheduler s(SchedulerLimits{4, 8, 5, 1 << 20});
  s.AddSession(1, Layout(MakeManifest({10})));
  EXPECT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 1, Ranges({{0, 0, 5}}), Clock::now())
          .ok());
  EXPECT_EQ(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 2, Ranges({{0, 5, 1}}), Clock::now())
          .code(),
      Code::kResourceExhausted);
  s.DropDemandAskedOn(1, 0);
  EXPECT_TRUE(
      s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 3, Ranges({{0, 5, 5}}), Clock::now())
          .ok());
  EXPECT_EQ(s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 4, Ranges({{0, 0, 1}, {3, 0, 1}}),
                      Clock::now())
                .code(),
            Code::kOutOfRange);
}

// Only what the closed or replaced demand connection asked for is dropped (and stops counting
// against the demand limit); a newer connection's requests stay queued.
TEST(SchedulerTest, DemandDroppedForOneConnectionOnly) {
  Scheduler s(SchedulerLimits{4, 8, 5, 1 << 20});
  s.AddSession(1, Layout(MakeManifest({10})));
  const auto now = Clock::now();
  ASSERT_TRUE(s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 1, Ranges({{0, 0, 3}}), now,
                        Delivery::kBytes, /*asked_on=*/7)
                  .ok());
  ASSERT_TRUE(s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 2, Ranges({{0, 3, 2}}), now,
                        Delivery::kBytes, /*asked_on=*/8)
                  .ok());
  EXPECT_EQ(s.Counters(1)->demand_outstanding, 5u);
  s.DropDemandAskedOn(1, 7);
  EXPECT_EQ(s.Counters(1)->demand_outstanding, 2u);
  // Room for three more now: the limit counts what is left.
  EXPECT_TRUE(s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 3, Ranges({{0, 5, 3}}), now,
                        Delivery::kBytes, 8)
                  .ok());
  std::vector<uint32_t> picked;
  while (std::optional<WorkItem> item = s.Next(Scheduler::Pick::kDemandOnly)) {
    EXPECT_EQ(item->asked_on, 8u) << "chunk " << item->chunk;
    picked.push_back(item->chunk);
    s.Done(*item, 0);
  }
  EXPECT_EQ(picked, (std::vector<uint32_t>{3, 4, 5, 6, 7}));
}

TEST(SchedulerTest, UpcomingFollowsPickOrder) {
  Scheduler s;
  s.AddSession(1, Layout(MakeManifest({6}, 100, {{0, 4}}, 1)));
  s.AddCredit(1, 1 << 20);
  ASSERT_TRUE(s.Have(1, Ranges({{0, 0, 1}})).ok());
  ASSERT_TRUE(s.StreamAll(1).ok());
  std::vector<manifest::ChunkRef> next = s.Upcoming(1, 3);
  ASSERT_EQ(next.size(), 3u);
  EXPECT_EQ(next[0].chunk(), 4u);
  EXPECT_EQ(next[1].chunk(), 1u);
  EXPECT_EQ(next[2].chunk(), 2u);
}

TEST(SchedulerTest, LazyPayloadsUseStoredLengths) {
  manifest::Manifest m = MakeManifest({2});
  m.mutable_bos(0)->mutable_chunks(0)->set_codec(manifest::CODEC_ZERO);
  m.mutable_bos(0)->mutable_chunks(1)->set_codec(manifest::CODEC_LZ4);
  m.mutable_bos(0)->mutable_chunks(1)->set_stored_length(40);
  ImageLayout layout = ImageLayout::FromManifest(m, true);
  EXPECT_EQ(layout.payload_length(0, 0), 0u);
  EXPECT_EQ(layout.payload_length(0, 1), 40u);
}

// ---------------------------------------------------------------------------------------------

class ImageStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/glstore-XXXXXX";
    base_ = ::mkdtemp(pattern);
    root_ = base_ / "root";
    std::filesystem::create_directories(root_ / "a" / "img");
    std::filesystem::create_directories(base_ / "outside" / "img");
    std::filesystem::create_directory_symlink(base_ / "outside", root_ / "escape");
    std::filesystem::create_directory_symlink("a/img", root_ / "inside");
  }
  void TearDown() override { std::filesystem::remove_all(base_); }
  std::filesystem::path base_, root_;
};

TEST_F(ImageStoreTest, ValidateNameRejectsDangerousNames) {
  EXPECT_EQ(ImageStore::ValidateName("").code(), Code::kNotFound);
  EXPECT_EQ(ImageStore::ValidateName("/etc").code(), Code::kNotFound);
  EXPECT_EQ(ImageStore::ValidateName("..").code(), Code::kNotFound);
  EXPECT_EQ(ImageStore::ValidateName("../x").code(), Code::kNotFound);
  EXPECT_EQ(ImageStore::ValidateName("a/../../x").code(), Code::kNotFound);
  EXPECT_EQ(ImageStore::ValidateName("a/..").code(), Code::kNotFound);
  EXPECT_EQ(ImageStore::ValidateName(std::string("a\0b", 3)).code(), Code::kNotFound);
  EXPECT_EQ(ImageStore::ValidateName(std::string(5000, 'a')).code(), Code::kNotFound);
  EXPECT_TRUE(ImageStore::ValidateName("a/img").ok());
  EXPECT_TRUE(ImageStore::ValidateName("a/..b/c..").ok());
}

TEST_F(ImageStoreTest, ResolveStaysBeneathTheRoot) {
  ImageStore store({root_}, 1 << 20, 4);
  Result<ImageStore::Resolved> ok = store.Resolve("a/img");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->dir, std::filesystem::canonical(root_ / "a" / "img"));
  EXPECT_EQ(ok->relative, "a/img");
  // A symlink that stays inside is fine; one that leaves is not found.
  EXPECT_TRUE(store.Resolve("inside").ok());
  Result<ImageStore::Resolved> escape = store.Resolve("escape/img");
  EXPECT_EQ(escape.status().code(), Code::kNotFound);
  EXPECT_EQ(escape.status().message().find(base_.string()), std::string::npos);
  EXPECT_EQ(store.Resolve("missing").status().code(), Code::kNotFound);
  EXPECT_EQ(store.Resolve("../outside/img").status().code(), Code::kNotFound);
  EXPECT_EQ(store.Resolve((base_ / "outside" / "img").string()).status().code(), Code::kNotFound);
  // A plain file is not an image directory.
  std::ofstream(root_ / "file") << "x";
  EXPECT_EQ(store.Resolve("file").status().code(), Code::kNotFound);
}

TEST_F(ImageStoreTest, OpenOfNonImageSaysNotFoundWithoutRoot) {
  ImageStore store({root_}, 1 << 20, 4);
  Result<std::shared_ptr<const OpenedImage>> opened = store.Open("a/img");
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().message().find(root_.string()), std::string::npos)
      << opened.status().message();
}

// An opened image is cached until its files change: a checkpoint whose pages file is rewritten
// in place (same name and inode, new bytes) is opened afresh, so checksums cached for the old
// bytes are never served for the new ones. Unchanged, the cached image is reused.
TEST_F(ImageStoreTest, PagesFileRewrittenInPlaceReopensTheImage) {
  image::SynthOptions synth;
  synth.out = root_ / "ckpt";
  synth.gpus = 1;
  synth.bos = 4;
  synth.total_bytes = 1 << 20;
  ASSERT_TRUE(image::SynthesizeCheckpoint(synth).ok());
  ImageStore store({root_}, 1 << 20, 4);
  Result<std::shared_ptr<const OpenedImage>> first = store.Open("ckpt");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  Result<std::shared_ptr<const OpenedImage>> again = store.Open("ckpt");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(first->get(), again->get()) << "an unchanged image is opened from the cache";

  std::filesystem::path pages;
  for (const auto& entry : std::filesystem::directory_iterator(root_ / "ckpt"))
    if (entry.path().filename().string().starts_with("amdgpu-pages-")) pages = entry.path();
  ASSERT_FALSE(pages.empty());
  auto inode_of = [](const std::filesystem::path& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 ? st.st_ino : 0;
  };
  const ino_t inode = inode_of(pages);
  // File times tick with the kernel's coarse clock: let one tick pass, as any real rewrite does.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  {
    // The last byte: BO contents (the file starts with a header).
    std::fstream file(pages, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-1, std::ios::end);
    char byte = 0;
    file.read(&byte, 1);
    file.seekp(-1, std::ios::end);
    byte = static_cast<char>(byte ^ 0x5a);
    file.write(&byte, 1);
  }
  ASSERT_EQ(inode_of(pages), inode) << "rewritten in place, not replaced";
  Result<std::shared_ptr<const OpenedImage>> rewritten = store.Open("ckpt");
  ASSERT_TRUE(rewritten.ok()) << rewritten.status().ToString();
  EXPECT_NE(first->get(), rewritten->get()) << "a rewritten pages file kept the cached image";
}

}  // namespace
}  // namespace gpulazy::server
