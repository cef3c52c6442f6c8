#include "lazy-server/server/scheduler.h"

#include <algorithm>
#include <cstddef>
#include <limits>

namespace gpulazy::server {

ImageLayout ImageLayout::FromManifest(const manifest::Manifest& manifest, bool lazy) {
  ImageLayout layout;
  layout.chunk_counts_.reserve(manifest.bos_size());
  layout.first_flat_.reserve(manifest.bos_size());
  uint64_t flat = 0;
  for (const manifest::Bo& bo : manifest.bos()) {
    layout.first_flat_.push_back(flat);
    layout.chunk_counts_.push_back(static_cast<uint32_t>(bo.chunks_size()));
    for (const manifest::Chunk& chunk : bo.chunks()) {
      uint32_t payload = chunk.raw_length();
      if (lazy) payload = chunk.codec() == manifest::CODEC_ZERO ? 0 : chunk.stored_length();
      layout.payload_lengths_.push_back(payload);
      layout.max_payload_ = std::max(layout.max_payload_, payload);
    }
    flat += static_cast<uint64_t>(bo.chunks_size());
  }

  // Profile entries first (valid and not seen before), then everything else in table order.
  std::vector<bool> seen(flat, false);
  const manifest::AccessProfile& profile = manifest.profile();
  const int hot_count = static_cast<int>(
      std::min<uint64_t>(profile.hot_count(), static_cast<uint64_t>(profile.order_size())));
  for (int i = 0; i < profile.order_size(); ++i) {
    const manifest::ChunkRef& ref = profile.order(i);
    if (!layout.Contains(ref.bo(), ref.chunk())) continue;
    uint64_t index = layout.FlatIndex(ref.bo(), ref.chunk());
    if (seen[index]) continue;
    seen[index] = true;
    layout.plan_.push_back(ref);
    if (i < hot_count) layout.hot_end_ = layout.plan_.size();
  }
  for (uint32_t bo = 0; bo < layout.bo_count(); ++bo) {
    for (uint32_t chunk = 0; chunk < layout.chunk_counts_[bo]; ++chunk) {
      if (seen[layout.FlatIndex(bo, chunk)]) continue;
      manifest::ChunkRef ref;
      ref.set_bo(bo);
      ref.set_chunk(chunk);
      layout.plan_.push_back(std::move(ref));
    }
  }
  return layout;
}

Status ImageLayout::CheckRange(const wire::ChunkRange& range) const {
  if (range.bo() >= bo_count())
    return OutOfRange("BO {} out of range (image has {} BOs)", range.bo(), bo_count());
  const uint64_t end = uint64_t{range.first_chunk()} + range.chunk_count();
  if (range.chunk_count() == 0 || end > chunk_counts_[range.bo()])
    return OutOfRange("chunks [{}, {}) of BO {} out of range (BO has {} chunks)",
                      range.first_chunk(), end, range.bo(), chunk_counts_[range.bo()]);
  return Status::Ok();
}

void Scheduler::AddSession(SessionId id, std::shared_ptr<const ImageLayout> layout) {
  SessionState state;
  state.have.assign(layout->total_chunks(), false);
  state.layout = std::move(layout);
  sessions_[id] = std::move(state);
}

void Scheduler::RemoveSession(SessionId id) {
  sessions_.erase(id);
}

Status Scheduler::Have(SessionId id,
                       const google::protobuf::RepeatedPtrField<wire::ChunkRange>& ranges) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFound("session {} is not open", id);
  SessionState& s = it->second;
  // Marking happens under the lock every session shares: a frame may name each chunk of the
  // image once at most (an honest client's runs never overlap), not the same whole BO thousands
  // of times over, and a run is marked a machine word at a time (std::fill on vector<bool>), so
  // a small frame naming a BO of a million chunks costs microseconds, not a million steps.
  uint64_t named = 0;
  for (const wire::ChunkRange& range : ranges) {
    GPULAZY_RETURN_IF_ERROR(s.layout->CheckRange(range));
    named += range.chunk_count();
  }
  if (named > s.have.size())
    return InvalidArgument("Have names {} chunks, more than the image's {}", named, s.have.size());
  for (const wire::ChunkRange& range : ranges) {
    const auto first = s.have.begin() + static_cast<std::ptrdiff_t>(
                                            s.layout->FlatIndex(range.bo(), range.first_chunk()));
    std::fill(first, first + range.chunk_count(), true);
  }
  return Status::Ok();
}

Status Scheduler::StreamAll(SessionId id, Delivery delivery) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFound("session {} is not open", id);
  SessionState& s = it->second;
  if (s.stream_all_taken)
    return InvalidArgument("stream_all was already requested in session {}", id);
  s.stream_all_taken = true;
  s.streaming = true;
  s.stream_delivery = delivery;
  return Status::Ok();
}

Status Scheduler::Enqueue(SessionId id, wire::Priority priority, Output output, uint64_t request_id,
                          const google::protobuf::RepeatedPtrField<wire::ChunkRange>& ranges,
                          Clock::time_point now, Delivery delivery, uint64_t asked_on) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFound("session {} is not open", id);
  SessionState& s = it->second;
  if (output == Output::kDemand) priority = wire::PRIORITY_DEMAND;
  uint64_t total = 0;
  for (const wire::ChunkRange& range : ranges) {
    GPULAZY_RETURN_IF_ERROR(s.layout->CheckRange(range));
    total += range.chunk_count();
  }
  if (priority == wire::PRIORITY_DEMAND) {
    if (s.demand_outstanding + total > limits_.max_demand)
      return ResourceExhausted("{} demand chunks requested, {} outstanding, limit {}", total,
                               s.demand_outstanding, limits_.max_demand);
  } else if (s.prefetch.size() + s.background.size() + total > limits_.max_queued) {
    return ResourceExhausted("{} prefetch/background chunks requested, {} queued, limit {}", total,
                             s.prefetch.size() + s.background.size(), limits_.max_queued);
  }

  std::deque<WorkItem>* queue = &s.background;
  if (priority == wire::PRIORITY_DEMAND)
    queue = output == Output::kDemand ? &s.demand_to_demand : &s.demand_to_stream;
  else if (priority == wire::PRIORITY_PREFETCH)
    queue = &s.prefetch;
  for (const wire::ChunkRange& range : ranges) {
    for (uint32_t i = 0; i < range.chunk_count(); ++i) {
      WorkItem item;
      item.session = id;
      item.bo = range.bo();
      item.chunk = range.first_chunk() + i;
      item.priority = priority;
      item.output = output;
      item.request_id = request_id;
      if (output == Output::kDemand) item.asked_on = asked_on;
      item.received = now;
      item.by_reference = delivery == Delivery::kByReference;
      item.placed = delivery == Delivery::kPlaced;
      queue->push_back(item);
    }
  }
  if (priority == wire::PRIORITY_DEMAND) s.demand_outstanding += static_cast<uint32_t>(total);
  return Status::Ok();
}

void Scheduler::AddCredit(SessionId id, uint64_t bytes) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  uint64_t& credit = it->second.credit;
  // Saturate: a client granting 2^64-1 twice must not wrap to a small window.
  credit = bytes > std::numeric_limits<uint64_t>::max() - credit
               ? std::numeric_limits<uint64_t>::max()
               : credit + bytes;
}

bool Scheduler::TakeCredit(SessionId id, uint64_t bytes) {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.credit < bytes) return false;
  it->second.credit -= bytes;
  return true;
}

bool Scheduler::Settled(const SessionState& s, uint32_t bo, uint32_t chunk) {
  const uint64_t flat = s.layout->FlatIndex(bo, chunk);
  return s.have[flat] || s.requests_in_flight.contains(flat);
}

void Scheduler::SkipHeld(SessionState& s) {
  const auto& plan = s.layout->plan();
  while (s.cursor < plan.size() && Settled(s, plan[s.cursor].bo(), plan[s.cursor].chunk()))
    ++s.cursor;
}

void Scheduler::NoteRequestPicked(SessionState& s, const WorkItem& item) {
  ++s.requests_in_flight[s.layout->FlatIndex(item.bo, item.chunk)];
}

void Scheduler::NoteRequestDone(SessionState& s, const WorkItem& item, bool written) {
  const uint64_t flat = s.layout->FlatIndex(item.bo, item.chunk);
  if (auto in_flight = s.requests_in_flight.find(flat);
      in_flight != s.requests_in_flight.end() && --in_flight->second == 0)
    s.requests_in_flight.erase(in_flight);
  if (written) s.have[flat] = true;
}

bool Scheduler::StreamMayTake(const SessionState& s, uint32_t payload) const {
  const uint64_t in_flight_limit = uint64_t{limits_.stream_in_flight} * s.lane_seq.size();
  return s.stream_in_flight < in_flight_limit && s.credit >= payload;
}

void Scheduler::AssignLane(SessionState& s, WorkItem& item) {
  uint32_t lane = 0;
  if (item.priority != wire::PRIORITY_DEMAND && s.lane_seq.size() > 1) {
    lane = s.lane_cursor;
    s.lane_cursor = static_cast<uint32_t>((s.lane_cursor + 1) % s.lane_seq.size());
  }
  item.lane = lane;
  item.stream_seq = s.lane_seq[lane]++;
}

void Scheduler::SetLanes(SessionId id, uint32_t count) {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || count <= it->second.lane_seq.size()) return;
  it->second.lane_seq.resize(count, 0);
}

std::optional<WorkItem> Scheduler::TakeQueued(SessionState& s, std::deque<WorkItem>& queue) {
  WorkItem& front = queue.front();
  const uint32_t payload = s.layout->payload_length(front.bo, front.chunk);
  if (!StreamMayTake(s, payload)) return std::nullopt;
  WorkItem item = front;
  queue.pop_front();
  NoteRequestPicked(s, item);
  item.reserved_credit = payload;
  AssignLane(s, item);
  s.credit -= payload;
  ++s.stream_in_flight;
  return item;
}

std::optional<WorkItem> Scheduler::PickFrom(SessionId id, SessionState& s, Pick pick) {
  if (pick != Pick::kNoDemand && !s.demand_to_demand.empty() &&
      s.demand_in_flight < limits_.demand_in_flight) {
    WorkItem item = s.demand_to_demand.front();
    s.demand_to_demand.pop_front();
    NoteRequestPicked(s, item);
    ++s.demand_in_flight;
    return item;
  }

  // The stream output takes its best item or nothing: a lower priority never overtakes a
  // higher one that waits for credit.
  if (!s.demand_to_stream.empty())
    return pick == Pick::kNoDemand ? std::nullopt : TakeQueued(s, s.demand_to_stream);
  if (pick == Pick::kDemandOnly) return std::nullopt;

  auto take_plan = [&](wire::Priority priority) -> std::optional<WorkItem> {
    const manifest::ChunkRef& ref = s.layout->plan()[s.cursor];
    const uint32_t payload = s.layout->payload_length(ref.bo(), ref.chunk());
    if (!StreamMayTake(s, payload)) return std::nullopt;
    WorkItem item;
    item.session = id;
    item.bo = ref.bo();
    item.chunk = ref.chunk();
    item.priority = priority;
    item.output = Output::kStream;
    item.from_stream_all = true;
    item.by_reference = s.stream_delivery == Delivery::kByReference;
    item.placed = s.stream_delivery == Delivery::kPlaced;
    item.reserved_credit = payload;
    AssignLane(s, item);
    ++s.cursor;
    s.credit -= payload;
    ++s.stream_in_flight;
    ++s.stream_in_flight_all;
    return item;
  };

  // While the session waits for demand chunks, its background and prefetch reads shrink to one
  // in flight: on a small machine they compete with the demand read (disk threads, CPU) and
  // with the client's install of the demand chunk. One keeps the stream moving.
  if ((s.demand_in_flight > 0 || !s.demand_to_demand.empty()) && s.stream_in_flight >= 1)
    return std::nullopt;
  if (!s.prefetch.empty()) return TakeQueued(s, s.prefetch);
  if (s.streaming) SkipHeld(s);
  const bool plan_left = s.streaming && s.cursor < s.layout->plan().size();
  if (plan_left && s.cursor < s.layout->hot_end()) return take_plan(wire::PRIORITY_PREFETCH);
  if (!s.background.empty()) return TakeQueued(s, s.background);
  if (plan_left) return take_plan(wire::PRIORITY_BACKGROUND);
  return std::nullopt;
}

std::optional<WorkItem> Scheduler::Next(Pick pick) {
  if (sessions_.empty()) return std::nullopt;
  SessionId& last = pick == Pick::kDemandOnly ? last_demand_served_ : last_served_;
  // Start after the session served last, wrap around once.
  auto it = sessions_.upper_bound(last);
  for (size_t visited = 0; visited < sessions_.size(); ++visited) {
    if (it == sessions_.end()) it = sessions_.begin();
    std::optional<WorkItem> item = PickFrom(it->first, it->second, pick);
    if (item) {
      last = it->first;
      return item;
    }
    ++it;
  }
  return std::nullopt;
}

std::vector<manifest::ChunkRef> Scheduler::Upcoming(SessionId id, size_t count) const {
  std::vector<manifest::ChunkRef> out;
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return out;
  const SessionState& s = it->second;
  auto add = [&](uint32_t bo, uint32_t chunk) {
    if (out.size() >= count) return;
    manifest::ChunkRef ref;
    ref.set_bo(bo);
    ref.set_chunk(chunk);
    out.push_back(std::move(ref));
  };
  auto add_queue = [&](const std::deque<WorkItem>& queue) {
    for (size_t i = 0; i < queue.size() && out.size() < count; ++i)
      add(queue[i].bo, queue[i].chunk);
  };
  auto add_plan = [&](size_t from, size_t to) {
    const auto& plan = s.layout->plan();
    for (size_t i = from; i < to && out.size() < count; ++i) {
      if (Settled(s, plan[i].bo(), plan[i].chunk())) continue;
      add(plan[i].bo(), plan[i].chunk());
    }
  };
  add_queue(s.demand_to_demand);
  add_queue(s.demand_to_stream);
  add_queue(s.prefetch);
  const size_t plan_size = s.streaming ? s.layout->plan().size() : 0;
  const size_t hot_end = std::min(s.layout->hot_end(), plan_size);
  if (s.cursor < hot_end) add_plan(s.cursor, hot_end);
  add_queue(s.background);
  add_plan(std::max(s.cursor, hot_end), plan_size);
  return out;
}

void Scheduler::Done(const WorkItem& item, std::optional<uint32_t> sent_payload) {
  auto it = sessions_.find(item.session);
  if (it == sessions_.end()) return;
  SessionState& s = it->second;
  if (item.output == Output::kStream) {
    if (s.stream_in_flight > 0) --s.stream_in_flight;
    // Unused reservation comes back; a larger payload took its extra with TakeCredit.
    const uint32_t used = sent_payload ? std::min(*sent_payload, item.reserved_credit) : 0;
    AddCredit(item.session, item.reserved_credit - used);
  } else if (s.demand_in_flight > 0) {
    --s.demand_in_flight;
  }
  if (item.priority == wire::PRIORITY_DEMAND && s.demand_outstanding > 0) --s.demand_outstanding;
  if (item.from_stream_all) {
    if (s.stream_in_flight_all > 0) --s.stream_in_flight_all;
    if (sent_payload) {
      ++s.stream_sent_chunks;
      s.stream_sent_bytes += *sent_payload;
    }
  } else {
    NoteRequestDone(s, item, sent_payload.has_value());
  }
}

void Scheduler::DropDemandAskedOn(SessionId id, uint64_t asked_on) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  SessionState& s = it->second;
  const auto dropped = static_cast<uint32_t>(std::erase_if(
      s.demand_to_demand, [asked_on](const WorkItem& item) { return item.asked_on == asked_on; }));
  s.demand_outstanding -= std::min(dropped, s.demand_outstanding);
}

std::optional<StreamDoneInfo> Scheduler::TakeStreamDone(SessionId id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return std::nullopt;
  SessionState& s = it->second;
  if (!s.streaming) return std::nullopt;
  SkipHeld(s);
  if (s.cursor < s.layout->plan().size() || s.stream_in_flight_all > 0) return std::nullopt;
  s.streaming = false;
  return StreamDoneInfo{s.stream_sent_chunks, s.stream_sent_bytes};
}

std::optional<Scheduler::SessionCounters> Scheduler::Counters(SessionId id) const {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return std::nullopt;
  const SessionState& s = it->second;
  SessionCounters c;
  c.credit = s.credit;
  c.queued = s.demand_to_demand.size() + s.demand_to_stream.size() + s.prefetch.size() +
             s.background.size() + (s.streaming ? s.layout->plan().size() - s.cursor : 0);
  c.stream_in_flight = s.stream_in_flight;
  c.demand_outstanding = s.demand_outstanding;
  return c;
}

}  // namespace gpulazy::server
