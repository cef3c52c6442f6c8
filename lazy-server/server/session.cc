#include "lazy-server/server/session.h"

#include <spdlog/spdlog.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <iterator>

#include "page-client/net/fd_passing.h"
#include "proto/frame.h"
#include "proto/image_table.h"
#include "proto/utf8.h"

namespace gpulazy::server {
namespace asio = boost::asio;
using boost::system::error_code;

namespace {

constexpr auto kLinger = std::chrono::seconds(1);
// How long a peer on a TLS listener that sent less than a frame prefix has to send the rest
// before it is judged on what it sent.
constexpr auto kShortPrefixWait = std::chrono::milliseconds(200);

// A TLS client opens with a handshake record (type 22, version 3.x, a 16-bit length) holding a
// ClientHello (message type 1). A gpulazy Hello's prefix can start with 22 too (a 22-byte
// header), but its next bytes are zeros. Fewer bytes than it takes to tell are given the benefit
// of the doubt: the handshake then decides.
bool MayBeClientHello(std::span<const uint8_t> first) {
  return first[0] == 0x16 && (first.size() < 2 || first[1] == 0x03) &&
         (first.size() < 3 || first[2] <= 0x04) && (first.size() < 6 || first[5] == 0x01);
}

std::string RandomSecret() {
  std::string secret(16, '\0');
  size_t got = 0;
  while (got < secret.size()) {
    ssize_t n = ::getrandom(secret.data() + got, secret.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // cannot happen on Linux >= 3.17 with a 16-byte request
    got += static_cast<size_t>(n);
  }
  return secret;
}

wire::ErrorCode ToWire(Code code) {
  switch (code) {
    case Code::kOk:
      return wire::ERROR_NONE;
    case Code::kInvalidArgument:
      return wire::ERROR_BAD_REQUEST;
    case Code::kNotFound:
    case Code::kPermissionDenied:
      return wire::ERROR_NOT_FOUND;  // never say what exists
    case Code::kCorrupt:
    case Code::kUnsupported:
      return wire::ERROR_CORRUPT;
    case Code::kIoError:
      return wire::ERROR_IO;
    case Code::kOutOfRange:
      return wire::ERROR_OUT_OF_RANGE;
    case Code::kResourceExhausted:
      return wire::ERROR_LIMIT;
    case Code::kAborted:
      return wire::ERROR_SHUTTING_DOWN;
    default:
      return wire::ERROR_INTERNAL;
  }
}

wire::Header StreamDoneFrame(const StreamDoneInfo& info) {
  wire::Header header;
  wire::StreamDone* body = header.mutable_stream_done();
  body->set_chunks(info.chunks);
  body->set_bytes(info.bytes);
  return header;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Session

Session::Session(ServerContext& ctx, SessionId id, std::string secret,
                 std::shared_ptr<const OpenedImage> image)
    : ctx_(ctx),
      id_(id),
      secret_(std::move(secret)),
      image_(std::move(image)),
      opened_at_(Clock::now()) {}

void Session::SetStream(const std::shared_ptr<Connection>& connection) {
  std::lock_guard lock(mu_);
  stream_ = connection;
}

Status Session::AttachDemand(const std::shared_ptr<Connection>& connection) {
  std::shared_ptr<Connection> previous;
  {
    std::lock_guard lock(mu_);
    if (closed_) return Aborted("session {} has closed", id_);
    previous = demand_.lock();
    demand_ = connection;
  }
  if (previous && previous != connection) {
    spdlog::info("session {}: demand connection {} replaces {}", id_, connection->id(),
                 previous->id());
    // What it asked for and was not sent goes nowhere now (TargetLocked): dropped here, so it
    // does not count against --max-demand when the client asks again on this connection.
    const uint64_t replaced = previous->id();
    ctx_.dispatcher.Update([&](Scheduler& s) { s.DropDemandAskedOn(id_, replaced); });
    previous->Shutdown(wire::ERROR_NONE, "replaced by a newer demand connection");
  }
  return Status::Ok();
}

void Session::DetachDemand(const Connection* connection) {
  {
    std::lock_guard lock(mu_);
    if (demand_.lock().get() == connection) demand_.reset();
  }
  // Its queued demand chunks have nowhere to go (replaced or not); the client re-sends them on a
  // new connection.
  const uint64_t closed = connection->id();
  ctx_.dispatcher.Update([&](Scheduler& s) { s.DropDemandAskedOn(id_, closed); });
}

Result<Session::LaneJoin> Session::AddLane(const std::shared_ptr<Connection>& connection,
                                           uint32_t max_lanes) {
  LaneJoin join;
  {
    std::lock_guard lock(mu_);
    if (closed_) return Aborted("session {} has closed", id_);
    if (lanes_.size() >= max_lanes)
      return ResourceExhausted("session {} has {} lane(s), this server's limit (--max-lanes)", id_,
                               lanes_.size());
    lanes_.push_back(connection);
    join.lane = static_cast<uint32_t>(lanes_.size());
    join.done = stream_done_;
  }
  // Outside mu_ (the dispatcher's lock is never taken under it). Lanes joining at once may
  // arrive here in either order: SetLanes only grows, and each lane is in lanes_ already.
  ctx_.dispatcher.Update([&](Scheduler& s) { s.SetLanes(id_, join.lane + 1); });
  return join;
}

void Session::BroadcastStreamDone(const StreamDoneInfo& info) {
  std::vector<std::shared_ptr<Connection>> targets;
  {
    std::lock_guard lock(mu_);
    stream_done_ = info;
    if (auto stream = stream_.lock()) targets.push_back(std::move(stream));
    for (const std::weak_ptr<Connection>& weak : lanes_)
      if (auto lane = weak.lock()) targets.push_back(std::move(lane));
  }
  stats_.stream_done.fetch_add(1);
  const wire::Header header = StreamDoneFrame(info);
  for (const std::shared_ptr<Connection>& target : targets)
    target->PostControl(header);
}

std::shared_ptr<Connection> Session::TargetLocked(const WorkItem& item) const {
  if (item.output == Output::kDemand) {
    std::shared_ptr<Connection> demand = demand_.lock();
    return demand && demand->id() == item.asked_on ? demand : nullptr;
  }
  if (item.lane == 0) return stream_.lock();
  return item.lane <= lanes_.size() ? lanes_[item.lane - 1].lock() : nullptr;
}

void Session::Close(const Connection* by) {
  std::vector<std::shared_ptr<Connection>> others;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
    for (std::weak_ptr<Connection>* weak : {&demand_, &stream_})
      if (auto connection = weak->lock()) others.push_back(std::move(connection));
    for (const std::weak_ptr<Connection>& weak : lanes_)
      if (auto lane = weak.lock()) others.push_back(std::move(lane));
    demand_.reset();
    stream_.reset();
    lanes_.clear();
  }
  ctx_.RemoveSession(id_);
  ctx_.dispatcher.RemoveSession(id_);
  ctx_.totals.sessions_open.fetch_sub(1);
  const Latency latency = DemandLatency();
  spdlog::info(
      "session {} (image '{}') closed after {:.1f} s: {} bytes, chunks demand/prefetch/"
      "background {}/{}/{}, demand p50 {:.0f} us p99 {:.0f} us",
      id_, image_->name, std::chrono::duration<double>(Clock::now() - opened_at_).count(),
      stats_.bytes_sent.load(), stats_.chunks_sent[wire::PRIORITY_DEMAND].load(),
      stats_.chunks_sent[wire::PRIORITY_PREFETCH].load(),
      stats_.chunks_sent[wire::PRIORITY_BACKGROUND].load(), latency.p50_us, latency.p99_us);
  // Sessions do not outlive their stream connection, nor any lane (docs/protocol.md).
  for (const std::shared_ptr<Connection>& connection : others)
    if (connection.get() != by) connection->Shutdown(wire::ERROR_NONE, "session closed");
  // However it ended (a reset, an error frame, a shutdown), nothing more is placed; a chunk
  // read meanwhile goes nowhere. Whoever must wait for the end waits with a release of its own.
  ReleasePlacement([] {});
}

void Session::RecordDemandLatency(Clock::duration queued, Clock::duration write) {
  auto micros = [](Clock::duration d) {
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(d).count();
    return static_cast<uint32_t>(std::clamp<int64_t>(us, 0, UINT32_MAX / 2));
  };
  const LatencySample sample{micros(queued), micros(write)};
  std::lock_guard lock(mu_);
  latency_us_.Add(sample);
  ++latency_count_;
}

Session::Latency Session::DemandLatency() const {
  std::vector<LatencySample> samples;
  Latency out;
  {
    std::lock_guard lock(mu_);
    samples = latency_us_.Unordered();
    out.count = latency_count_;
  }
  if (samples.empty()) return out;
  std::vector<uint32_t> total, queued, write;
  for (const LatencySample& s : samples) {
    total.push_back(s.queued_us + s.write_us);
    queued.push_back(s.queued_us);
    write.push_back(s.write_us);
  }
  for (std::vector<uint32_t>* values : {&total, &queued, &write})
    std::sort(values->begin(), values->end());
  auto at = [](const std::vector<uint32_t>& sorted, double q) {
    return static_cast<double>(sorted[static_cast<size_t>(q * double(sorted.size() - 1))]);
  };
  out.p50_us = at(total, 0.50);
  out.p99_us = at(total, 0.99);
  out.max_us = total.back();
  out.queued_p50_us = at(queued, 0.50);
  out.queued_p99_us = at(queued, 0.99);
  out.write_p50_us = at(write, 0.50);
  out.write_p99_us = at(write, 0.99);
  return out;
}

void Session::OnChunkRead(const WorkItem& item, Result<LoadedChunk> chunk) {
  std::shared_ptr<Connection> target;
  {
    std::lock_guard lock(mu_);
    target = TargetLocked(item);
  }
  if (!target) {
    ctx_.dispatcher.Done(item, std::nullopt);
    return;
  }
  target->PostChunk(item, std::move(chunk));
}

bool Session::SendsFromFiles(const WorkItem& item) const {
  if (!ctx_.config.send_from_files) return false;
  std::shared_ptr<Connection> target;
  {
    std::lock_guard lock(mu_);
    target = TargetLocked(item);
  }
  return target && target->can_send_from_files();
}

Status Session::AddPlacementTargets(std::vector<PlacementTargetEntry> entries) {
  bool start_opener = false;
  bool register_placing = false;
  {
    std::lock_guard lock(placement_mu_);
    const size_t bos = static_cast<size_t>(image_->layout->bo_count());
    for (const PlacementTargetEntry& entry : entries) {
      if (entry.bo >= bos) return OutOfRange("BO {} is not in the image ({} BOs)", entry.bo, bos);
      if (!entry.accepted) return Internal("BO {}: no destination", entry.bo);
      if (entry.bo < destinations_.size() &&
          destinations_[entry.bo].state != DestinationState::kNone)
        return InvalidArgument("BO {} has a destination already", entry.bo);
    }
    if (placement_released_) return Aborted("the session has ended");
    register_placing = destinations_.empty();
    if (destinations_.empty()) {
      destinations_.resize(bos);
      place_state_.assign(image_->layout->total_chunks(), PlaceState::kNone);
    }
    for (PlacementTargetEntry& entry : entries) {
      Destination& destination = destinations_[entry.bo];
      destination.state = DestinationState::kOpening;
      destination.size = entry.size;
      destination.accepted = std::move(entry.accepted);
      to_open_.push_back(entry.bo);
    }
    start_opener = !opener_running_ && !to_open_.empty();
    if (start_opener) opener_running_ = true;
  }
  if (register_placing) ctx_.AddPlacingSession(shared_from_this());
  if (start_opener)
    boost::asio::post(ctx_.dispatcher.pool(),
                      [self = shared_from_this()] { self->OpenDestinations(); });
  return Status::Ok();
}

void Session::OpenDestinations() {
  for (;;) {
    uint32_t bo = 0;
    std::unique_ptr<AcceptedTarget> accepted;
    {
      std::lock_guard lock(placement_mu_);
      if (to_open_.empty() || placement_released_) {
        opener_running_ = false;
        return;
      }
      bo = to_open_.front();
      to_open_.pop_front();
      accepted = std::move(destinations_[bo].accepted);
      opening_ = true;
    }
    bool closed = ctx_.shutting_down.load();
    {
      std::lock_guard lock(mu_);
      closed = closed || closed_;
    }
    Result<PlacementTargetRef> opened =
        closed ? Result<PlacementTargetRef>(Aborted("the session closed")) : accepted->Open();
    accepted.reset();
    std::vector<PendingPlacement> waiting;
    PlacementTargetRef released;  // opened after the client let its destinations go
    std::optional<PlaceCall> call;
    {
      std::lock_guard lock(placement_mu_);
      opening_ = false;
      if (placement_released_ && opened.ok()) {
        released = std::move(*opened);
        opened = Result<PlacementTargetRef>(Aborted("the client released its destinations"));
        closed = true;  // not a failure worth a warning
      }
      Destination& destination = destinations_[bo];
      destination.state = opened.ok() ? DestinationState::kOpen : DestinationState::kFailed;
      if (opened.ok()) {
        destination.target = *opened;
        call.emplace(*this, std::move(*opened));  // this thread's reference, counted
      }
      waiting.swap(destination.waiting);
    }
    released.reset();
    if (!call) {
      if (!closed) {
        ctx_.totals.destination_open_failures.fetch_add(1);
        spdlog::warn(
            "session {} (image '{}'): the destination of BO {} did not open ({}); its "
            "chunks go as bytes",
            id_, image_->name, bo, opened.status().ToString());
      }
      const Status failed = opened.status().Context(fmt::format("the destination of BO {}", bo));
      for (PendingPlacement& placement : waiting)
        FinishPlacement(placement.flat, failed, placement.done);
      FinishReleaseIfDone();  // the opening may have been all a release waited for
      continue;
    }
    for (const PendingPlacement& placement : waiting) {
      // Queued or not, each one's `done` runs: nobody else would send it as bytes.
      if (Status queued = SubmitPlacement(call->target(), placement);
          !queued.ok() && placement.done)
        placement.done(queued);
    }
  }
}

Session::PlaceCall::PlaceCall(Session& session, PlacementTargetRef target)
    : session_(session), target_(std::move(target)) {
  ++session_.place_calls_;  // under placement_mu_
}

Session::PlaceCall::~PlaceCall() {
  target_.reset();
  {
    std::lock_guard lock(session_.placement_mu_);
    --session_.place_calls_;
  }
  session_.FinishReleaseIfDone();
}

bool Session::HasPlacementTarget(uint32_t bo) const {
  std::lock_guard lock(placement_mu_);
  return bo < destinations_.size() && destinations_[bo].state != DestinationState::kNone;
}

size_t Session::placement_targets() const {
  std::lock_guard lock(placement_mu_);
  return static_cast<size_t>(
      std::count_if(destinations_.begin(), destinations_.end(),
                    [](const Destination& d) { return d.state != DestinationState::kNone; }));
}

Status Session::PlaceChunk(const WorkItem& item, const image::DiskRange& from,
                           std::optional<uint64_t> checksum, PlacementDone done) {
  if (!ctx_.placement) return Unsupported("this server does not place chunks");
  const ImageLayout& layout = *image_->layout;
  if (!layout.Contains(item.bo, item.chunk))
    return OutOfRange("BO {} chunk {} is not in the image", item.bo, item.chunk);
  const uint64_t flat = layout.FlatIndex(item.bo, item.chunk);
  const uint64_t offset = uint64_t{item.chunk} * image_->source->chunk_size();
  std::optional<PlaceCall> call;
  {
    std::lock_guard lock(placement_mu_);
    if (placement_released_) return Aborted("the client released its destinations");
    if (item.bo >= destinations_.size() || destinations_[item.bo].state == DestinationState::kNone)
      return NotFound("BO {} has no destination", item.bo);
    Destination& destination = destinations_[item.bo];
    if (destination.state == DestinationState::kFailed)
      return NotFound("BO {}'s destination did not open", item.bo);
    const PlaceState state = place_state_[flat];
    if (state == PlaceState::kInFlight) {
      place_waiting_[flat].push_back(std::move(done));
      return Status::Ok();
    }
    if (state == PlaceState::kFailed)
      return Aborted("BO {} chunk {} could not be placed before", item.bo, item.chunk);
    if (state == PlaceState::kNone) {
      if (offset > destination.size || from.length > destination.size - offset)
        return OutOfRange("BO {} chunk {} lies past its destination's {} bytes", item.bo,
                          item.chunk, destination.size);
      place_state_[flat] = PlaceState::kInFlight;
      ++placements_in_flight_;
      if (destination.state == DestinationState::kOpening) {
        // BOs that chunks wait for open first, in the order the first chunk of each began to
        // wait: a fault's BO goes before the BOs the stream has not reached.
        if (destination.waiting.empty()) {
          auto queued = std::find(to_open_.begin(), to_open_.end(), item.bo);
          if (queued != to_open_.end()) {
            to_open_.erase(queued);
            auto after_waited = std::find_if(to_open_.begin(), to_open_.end(), [&](uint32_t bo) {
              return destinations_[bo].waiting.empty();
            });
            to_open_.insert(after_waited, item.bo);
          }
        }
        destination.waiting.push_back({flat, from, checksum, offset, std::move(done)});
        ctx_.totals.placements_deferred.fetch_add(1);
        return Status::Ok();
      }
      call.emplace(*this, destination.target);
    }
  }
  if (!call) {
    done(Status::Ok());  // placed before: the client is told again and ignores it
    return Status::Ok();
  }
  return SubmitPlacement(call->target(), {flat, from, checksum, offset, std::move(done)});
}

Status Session::SubmitPlacement(const PlacementTargetRef& target,
                                const PendingPlacement& placement) {
  const auto& files = image_->source->files();
  // Both branches string_view: a ?: of std::string and "?" would make a temporary string.
  const std::string_view file_name = placement.from.file < files.size()
                                         ? std::string_view(files[placement.from.file].name)
                                         : std::string_view("?");
  std::shared_ptr<Session> self = shared_from_this();
  const uint64_t flat = placement.flat;
  Status queued =
      ctx_.placement->Place(placement.from, file_name, placement.checksum, target, placement.offset,
                            [self, flat, done = placement.done](const Status& status) {
                              self->FinishPlacement(flat, status, done);
                            });
  if (!queued.ok()) {
    // Nothing was queued: this item goes as bytes, and so do those that started waiting on it.
    FinishPlacement(flat, queued, nullptr);
    return queued;
  }
  return Status::Ok();
}

void Session::FinishPlacement(uint64_t flat, const Status& status, const PlacementDone& done) {
  std::vector<PlacementDone> waiting;
  {
    std::lock_guard lock(placement_mu_);
    place_state_[flat] = status.ok() ? PlaceState::kPlaced : PlaceState::kFailed;
    --placements_in_flight_;
    auto it = place_waiting_.find(flat);
    if (it != place_waiting_.end()) {
      waiting = std::move(it->second);
      place_waiting_.erase(it);
    }
  }
  if (done) done(status);
  for (const PlacementDone& waiter : waiting)
    waiter(status);
  FinishReleaseIfDone();
}

void Session::ReleasePlacement(std::function<void()> released) {
  std::vector<PendingPlacement> abandoned;
  {
    std::unique_lock lock(placement_mu_);
    if (placement_released_) {
      // Asked again (the session's end releases first; a stream connection or a superseding
      // session then waits with a release of its own): answered with the first, or at once.
      if (on_released_) {
        on_released_ = [first = std::move(on_released_), released = std::move(released)] {
          first();
          released();
        };
      } else {
        lock.unlock();
        released();
      }
      return;
    }
    placement_released_ = true;
    on_released_ = std::move(released);
    to_open_.clear();  // nothing more opens
    // Chunks waiting for a destination nobody is opening now never go there. (The one being
    // opened, if any, is the opener's: it sees the release when its opening returns.)
    for (Destination& destination : destinations_) {
      if (destination.state != DestinationState::kOpening || !destination.accepted) continue;
      destination.state = DestinationState::kFailed;
      std::move(destination.waiting.begin(), destination.waiting.end(),
                std::back_inserter(abandoned));
      destination.waiting.clear();
    }
  }
  const Status status = Aborted("the client released its destinations");
  for (const PendingPlacement& placement : abandoned)
    FinishPlacement(placement.flat, status, placement.done);
  FinishReleaseIfDone();
}

void Session::FinishReleaseIfDone() {
  std::function<void()> released;
  std::vector<PlacementTargetRef> targets;
  std::vector<std::unique_ptr<AcceptedTarget>> accepted;
  {
    std::lock_guard lock(placement_mu_);
    if (!placement_released_ || !on_released_ || placements_in_flight_ > 0 || opening_ ||
        place_calls_ > 0)
      return;
    for (Destination& destination : destinations_) {
      if (destination.target) targets.push_back(std::move(destination.target));
      if (destination.accepted) accepted.push_back(std::move(destination.accepted));
      if (destination.state != DestinationState::kNone)
        destination.state = DestinationState::kFailed;
    }
    released = std::move(on_released_);
    on_released_ = nullptr;
  }
  // The last references (no placement, and no thread calling one, holds one now): a backend
  // closes each here.
  targets.clear();
  accepted.clear();
  ctx_.RemovePlacingSession(id_);
  released();
}

// ---------------------------------------------------------------------------------------------
// Connection

Connection::Connection(ServerContext& ctx, net::Stream stream, uint64_t id, std::string peer,
                       PeerIdentity identity)
    : ctx_(ctx),
      socket_(std::move(stream)),
      id_(id),
      peer_(std::move(peer)),
      identity_(std::move(identity)),
      wake_(socket_.get_executor()),
      writer_exit_(socket_.get_executor()),
      watchdog_(socket_.get_executor()),
      deadline_(Clock::now() + ctx.config.hello_timeout),
      reader_resume_(socket_.get_executor()),
      release_wait_(socket_.get_executor()) {}

Connection::~Connection() {
  if (demand_loop_ != nullptr) demand_loop_->connections.fetch_sub(1);
}

std::string Connection::Tag() const {
  if (!session_) return fmt::format("conn {} ({})", id_, peer_);
  return fmt::format("conn {} ({}, {} of session {}, image '{}')", id_, peer_,
                     role_ == Role::kDemand  ? "demand"
                     : role_ == Role::kFiles ? "files"
                     : role_ == Role::kLane  ? "lane"
                                             : "stream",
                     session_->id(), session_->image().name);
}

void Connection::Start(wire::ErrorCode refuse_code, std::string refuse_message) {
  ctx_.totals.connections_open.fetch_add(1);
  ctx_.totals.connections_accepted.fetch_add(1);
  ctx_.AddConnection(id_, shared_from_this());
  refuse_code_ = refuse_code;
  refuse_message_ = std::move(refuse_message);
  asio::co_spawn(
      socket_.get_executor(),
      [self = shared_from_this()]() -> net::Awaitable<void> { co_await self->Run(); },
      asio::detached);
}

net::Awaitable<void> Connection::Run() {
  auto self = shared_from_this();
  auto executor = socket_.get_executor();
  asio::co_spawn(
      executor, [self]() -> net::Awaitable<void> { co_await self->WriteLoop(); }, asio::detached);
  asio::co_spawn(
      executor, [self]() -> net::Awaitable<void> { co_await self->Watchdog(); }, asio::detached);
  spdlog::debug("{}: connected", Tag());
  try {
    // TLS first, even for a connection about to be refused: the refusal must travel inside
    // TLS to be readable. The Hello deadline bounds the handshake.
    if (socket_.is_tls() && co_await RefusedAsNotTls()) co_return;
    Status tls = co_await socket_.Handshake();
    if (!tls.ok()) {
      spdlog::info("{}: {}; closing", Tag(), tls.message());
      Close("TLS handshake failed");
      co_return;
    }
    if (socket_.is_tls()) identity_.common_name = socket_.PeerCommonName();
    transport_ready_ = true;
    Wake();
    if (refuse_code_ != wire::ERROR_NONE) {
      Fail(refuse_code_, refuse_message_);
    } else {
      co_await ReadLoop();
    }
  } catch (const std::exception& e) {
    // No exception leaves a connection: one broken client never disturbs the others.
    spdlog::error("{}: internal error: {}", Tag(), e.what());
  }
  if (role_ == Role::kStream && session_ && session_->placement_targets() > 0 && !closed_)
    co_await ReleasePlacement();

  // Let the writer flush what is queued for the client (an error, a reply), then close.
  draining_ = true;
  Wake();
  error_code ec;
  if (!writer_done_) {
    writer_exit_.expires_at(Clock::time_point::max());
    co_await writer_exit_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  if (!closed_ && !moved_away_) co_await LingerBeforeClose(/*below_tls=*/false);
  Close("connection finished");
}

net::Awaitable<void> Connection::ReleasePlacement() {
  // The client may free or reuse its destinations once it sees this connection close, so the
  // session's placements end first: none in flight, every destination let go of
  // (docs/protocol.md, "Placement", 5). The session ends now: nothing new is scheduled for it.
  session_->Close(this);
  const auto began = Clock::now();
  co_await AwaitPlacementRelease(*session_, Clock::time_point::max());
  spdlog::debug(
      "{}: placement released after {} us", Tag(),
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - began).count());
}

net::Awaitable<bool> Connection::AwaitPlacementRelease(Session& session,
                                                       Clock::time_point deadline) {
  auto released = std::make_shared<bool>(false);  // this connection's strand only
  session.ReleasePlacement([weak = weak_from_this(), released] {
    auto self = weak.lock();
    if (!self) return;
    asio::post(self->socket_.get_executor(), [self, released] {
      *released = true;
      self->release_wait_.cancel();
    });
  });
  error_code ec;
  // Close (the watchdog's, a shutdown) cancels the timer too.
  while (!*released && !closed_ && Clock::now() < deadline) {
    release_wait_.expires_at(deadline);
    co_await release_wait_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  co_return *released;
}

net::Awaitable<Status> Connection::AwaitSuperseded(SessionId id, const std::string& secret) {
  std::shared_ptr<Session> old = ctx_.FindSessionToSupersede(id);
  if (!old) co_return Status::Ok();  // gone, and every placement of it with it
  if (!net::ConstantTimeEqual(old->secret(), secret)) {
    ctx_.totals.supersede_refusals.fetch_add(1);
    co_return PermissionDenied("the session {} to supersede: wrong secret", id);
  }
  // Its connections broke on the client's side; the server may not have noticed yet.
  old->Close();
  const auto began = Clock::now();
  const bool released = co_await AwaitPlacementRelease(*old, began + kSupersedeTimeout);
  // The caller answers nothing on a closed connection.
  if (closed_) co_return Unavailable("the connection closed while session {} ended", id);
  if (!released) {
    ctx_.totals.supersede_refusals.fetch_add(1);
    co_return Unavailable(
        "the session {} this one supersedes still writes into the client's memory after {} s", id,
        std::chrono::duration_cast<std::chrono::seconds>(kSupersedeTimeout).count());
  }
  ctx_.totals.sessions_superseded.fetch_add(1);
  spdlog::info("{}: session {} superseded; its placements ended after {} us", Tag(), id,
               std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - began).count());
  co_return Status::Ok();
}

net::Awaitable<void> Connection::LingerBeforeClose(bool below_tls) {
  error_code ec;
  socket_.shutdown(asio::socket_base::shutdown_send, ec);
  ec.clear();  // a peer already gone fails the first read below
  SetDeadline(std::min(deadline_, Clock::now() + kLinger));
  std::array<uint8_t, 4096> discard;
  while (!closed_ && !ec) {
    if (below_tls)
      co_await socket_.socket().async_receive(asio::buffer(discard),
                                              asio::redirect_error(asio::use_awaitable, ec));
    else
      co_await socket_.async_read_some(asio::buffer(discard),
                                       asio::redirect_error(asio::use_awaitable, ec));
  }
}

net::Awaitable<bool> Connection::RefusedAsNotTls() {
  // Peeked, not read: a TLS client's bytes stay for OpenSSL. Both kinds of client write their
  // first 8 bytes or more at once (a ClientHello's record, a Hello's prefix and header), but a
  // path may cut them: fewer are given a moment to grow before they are judged.
  std::array<uint8_t, kFramePrefixSize> first{};
  error_code ec;
  size_t got = 0;
  const auto judge_by = Clock::now() + kShortPrefixWait;
  for (;;) {
    got = co_await socket_.socket().async_receive(asio::buffer(first),
                                                  asio::socket_base::message_peek,
                                                  asio::redirect_error(asio::use_awaitable, ec));
    if (ec == asio::error::eof || (!ec && got == 0)) {
      // The peer ended its side before a single byte (a port probe, a health check). Closed here:
      // a read after this peek would wait for readiness the socket has already reported (Asio's
      // edge-triggered reactor takes an empty read as "exhausted"), until the Hello deadline.
      spdlog::debug("{}: closed by the peer before any byte", Tag());
      Close("closed by the peer before a TLS handshake");
      co_return true;
    }
    if (ec) co_return false;  // reset or cancelled: the handshake reports it
    if (got == first.size() || Clock::now() >= judge_by) break;
    asio::steady_timer pause(socket_.socket().get_executor(), std::chrono::milliseconds(5));
    co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (closed_) co_return false;
  }
  const std::span<const uint8_t> seen(first.data(), got);
  if (MayBeClientHello(seen)) co_return false;

  const bool gpulazy_client = DecodeFramePrefix(seen, FrameLimits{}).ok();
  std::string what =
      gpulazy_client
          ? "a plain-text gpulazy client"
          : std::string(ForeignProtocol(seen).value_or("a peer that does not speak TLS"));
  spdlog::info("{}: {} on a TLS listener; closing", Tag(), what);
  if (gpulazy_client) {
    // Its Hello is unread, so it would not understand TLS: answer in its own framing, which
    // carries nothing but this fixed text.
    wire::Header header;
    wire::Error* error = header.mutable_error();
    error->set_code(wire::ERROR_UNAUTHENTICATED);
    error->set_message(
        "this listener speaks TLS: connect with a CA file (gpulazy-client --tls-ca, the CRIU "
        "plugin's tls_ca)");
    Result<std::string> frame = EncodeFrameHead(header, 0, FrameLimits{});
    if (frame.ok()) {
      co_await asio::async_write(socket_.socket(), asio::buffer(*frame),
                                 asio::redirect_error(asio::use_awaitable, ec));
      ctx_.totals.errors_sent.fetch_add(1);
      // The client's Hello is still unread, below TLS.
      if (!ec) co_await LingerBeforeClose(/*below_tls=*/true);
    }
  }
  Close("not a TLS client");
  co_return true;
}

net::Awaitable<void> Connection::ReadLoop() {
  while (!closed_ && !draining_) {
    error_code ec;
    while (control_.size() >= kMaxQueuedControl && !closed_ && !draining_) {
      reader_paused_ = true;
      reader_resume_.expires_at(Clock::time_point::max());
      co_await reader_resume_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    reader_paused_ = false;
    if (closed_ || draining_) co_return;
    // Until its Hello is accepted (and its token checked) a client may not make the server hold
    // a payload buffer: no Hello carries one.
    const FrameLimits hello_limits{.max_header = ctx_.limits.max_header, .max_payload = 0};
    Result<wire::Header> frame = co_await net::ReadFrame(
        socket_, role_ == Role::kNew ? hello_limits : ctx_.limits, &payload_);
    if (!frame.ok()) {
      const Status& status = frame.status();
      if (draining_ || closed_) co_return;
      if (status.code() == Code::kResourceExhausted) {
        Fail(wire::ERROR_LIMIT, status.message());
      } else if (status.code() == Code::kCorrupt) {
        Fail(wire::ERROR_BAD_REQUEST, status.message());
      } else {
        spdlog::debug("{}: {}", Tag(), status.ToString());
      }
      co_return;
    }
    // Clients send no payloads; do not keep a large buffer around for one that did.
    if (payload_.capacity() > 65536) std::vector<uint8_t>().swap(payload_);
    ctx_.totals.frames_received.fetch_add(1);
    Touch();
    if (role_ == Role::kNew) {
      co_await HandleHello(*frame);
    } else {
      co_await HandleFrame(*frame);
    }
  }
}

net::Awaitable<void> Connection::HandleHello(const wire::Header& frame) {
  const uint64_t rid = frame.request_id();
  if (frame.body_case() != wire::Header::kHello) {
    Fail(wire::ERROR_BAD_REQUEST, "the first frame on a connection must be Hello", rid);
    co_return;
  }
  const wire::Hello& hello = frame.hello();
  // The highest version both speak.
  const uint32_t version = std::min(hello.max_version(), kProtocolVersion);
  if (version < std::max(hello.min_version(), kMinProtocolVersion)) {
    Fail(wire::ERROR_UNSUPPORTED_VERSION,
         fmt::format("server speaks protocol versions {}..{}; client offers {}..{}",
                     kMinProtocolVersion, kProtocolVersion, hello.min_version(),
                     hello.max_version()),
         rid);
    co_return;
  }
  version_ = version;
  if (!ctx_.TokenAccepted(hello.token())) {
    spdlog::warn("{}: bad token", Tag());
    Fail(wire::ERROR_UNAUTHENTICATED, "bad or missing token", rid);
    co_return;
  }
  grant_ = GrantFor(*ctx_.AccessPolicy(), identity_);
  if (hello.join_session() != 0 || !hello.join_secret().empty()) {
    std::shared_ptr<Session> session = ctx_.FindSession(hello.join_session());
    if (!session || !net::ConstantTimeEqual(session->secret(), hello.join_secret())) {
      spdlog::warn("{}: demand connection for unknown session {} or wrong secret", Tag(),
                   hello.join_session());
      Fail(wire::ERROR_NOT_FOUND, "unknown session or wrong secret", rid);
      co_return;
    }
    // Checked against the rules in place now, not those the session opened under: a reload that
    // withdrew the image's grant lets the open connections finish but no new one join them.
    if (!MayOpen(grant_, session->image().relative)) {
      spdlog::info(
          "{}: joining session {}, whose image ({} below its root) is outside the "
          "client's --image-access grant",
          Tag(), session->id(), session->image().relative);
      Fail(wire::ERROR_NOT_FOUND, "unknown session or wrong secret", rid);  // as for a bad secret
      co_return;
    }
    session_ = std::move(session);
    if (hello.want_files()) {
      role_ = Role::kFiles;
      // From here the idle timeout bounds it, not what is left of the Hello timeout: building a
      // large chunk table on a busy disk thread and writing it may take longer than that.
      Touch();
      if (SendImageFiles(rid) && hello.want_chunk_table() && version_ >= 2)
        co_await SendChunkTable(rid);
      // Whatever happened, this connection has done its one job (the writer flushes what is
      // queued, then it closes).
      draining_ = true;
      co_return;
    }
    if (hello.join_as_lane()) {
      Result<Session::LaneJoin> join = session_->AddLane(shared_from_this(), ctx_.config.max_lanes);
      if (!join.ok()) {
        Fail(ToWire(join.status().code()), join.status().message(), rid);
        co_return;
      }
      role_ = Role::kLane;
      lane_done_ = join->done;
    } else {
      role_ = Role::kDemand;
    }
  } else if (hello.want_files() || hello.join_as_lane()) {
    Fail(wire::ERROR_BAD_REQUEST,
         fmt::format("{} needs join_session and join_secret",
                     hello.want_files() ? "want_files" : "join_as_lane"),
         rid);
    co_return;
  } else {
    role_ = Role::kStream;
  }
  // Past the administrator's socket-buffer caps only for a peer let in (docs/server.md).
  net::ForceSocketBuffers(socket_.socket());
  wire::Header reply;
  reply.set_request_id(rid);
  wire::HelloReply* body = reply.mutable_hello_reply();
  body->set_version(version_);
  body->set_server_name(ctx_.config.server_name);
  body->set_max_payload(ctx_.limits.max_payload);
  body->set_max_lanes(ctx_.config.max_lanes);
  // Placement writes into the peer's memory on this host: Unix peers only.
  if (ctx_.placement && identity_.pid) {
    body->mutable_placement()->set_kind(std::string(ctx_.placement->kind()));
    body->mutable_placement()->set_device(ctx_.placement->device());
  }
  // Before a demand connection moves: the log line names the connection it arrived on.
  spdlog::debug("{}: hello from '{}' ({}), {} over {}", Tag(), hello.client_name().substr(0, 64),
                identity_.ToString(),
                role_ == Role::kDemand ? "demand connection"
                : role_ == Role::kLane ? "lane"
                                       : "stream connection",
                socket_.is_tls() ? "TLS" : "a plain socket");
  if (role_ == Role::kDemand) {
    if (MoveToDemandThreads(reply)) co_return;
    if (Status attached = session_->AttachDemand(shared_from_this()); !attached.ok()) {
      Fail(ToWire(attached.code()), attached.message(), rid);
      co_return;
    }
  }
  Enqueue(std::move(reply));
  // A lane that joined after the stream ended gets its StreamDone here, after the reply.
  if (lane_done_) EnqueueStreamDone(*lane_done_);
  Touch();
  co_return;
}

bool Connection::MoveToDemandThreads(const wire::Header& reply) {
  if (ctx_.demand_loops.empty() || socket_.is_tls() || draining_ || ctx_.shutting_down)
    return false;
  net::Socket& socket = socket_.socket();
  error_code ec;
  const net::Socket::protocol_type protocol = socket.local_endpoint(ec).protocol();
  if (ec) return false;
  ServerContext::DemandLoop* loop = ctx_.ClaimLeastBusyDemandLoop();
  // Nothing is pending on the socket here (the reader is in this call, the writer and the
  // watchdog wait on timers), so releasing it cancels nothing.
  const int fd = socket.release(ec);
  if (ec) {
    loop->connections.fetch_sub(1);
    spdlog::warn("{}: staying on the shared network threads: {}", Tag(), ec.message());
    return false;
  }
  net::Socket moved(asio::make_strand(*loop->io));
  moved.assign(protocol, fd, ec);
  if (ec) {
    loop->connections.fetch_sub(1);
    ::close(fd);
    spdlog::warn("{}: moving to the demand network threads failed: {}; closing", Tag(),
                 ec.message());
    Close("move failed");
    return true;
  }
  auto successor =
      std::make_shared<Connection>(ctx_, net::Stream(std::move(moved)), id_, peer_, identity_);
  successor->role_ = role_;
  successor->version_ = version_;
  successor->grant_ = grant_;
  successor->session_ = session_;
  successor->demand_loop_ = loop;  // its destructor gives the claim back
  successor_ = successor;
  moved_away_ = true;
  draining_ = true;  // this one's reader and writer end now
  // Counted before the successor runs: its client may ask for stats as soon as it is answered.
  ctx_.totals.demand_connections_moved.fetch_add(1);
  // Posted before the successor is registered: a shutdown that finds it in the registry posts
  // behind this on the same strand, so the client gets its HelloReply first.
  asio::post(successor->socket_.get_executor(), [successor, reply] {
    // The session may have closed since the Hello (its stream connection went): its close
    // could not reach a connection not yet attached, so this one ends itself.
    if (Status attached = successor->session_->AttachDemand(successor); !attached.ok()) {
      successor->Fail(ToWire(attached.code()), attached.message(), reply.request_id());
    } else {
      successor->Enqueue(reply);
    }
    successor->Touch();
    asio::co_spawn(
        successor->socket_.get_executor(),
        [successor]() -> net::Awaitable<void> { co_await successor->Run(); }, asio::detached);
  });
  ctx_.AddConnection(id_, successor);  // replaces this one: a shutdown reaches the successor
  spdlog::debug("{}: moved to the demand network threads", Tag());
  return true;
}

net::Awaitable<void> Connection::HandleFrame(const wire::Header& frame) {
  const uint64_t rid = frame.request_id();
  if (role_ == Role::kLane && frame.body_case() != wire::Header::kGoodbye &&
      frame.body_case() != wire::Header::kCredit) {
    // A lane only carries chunks to the client; requests, Have and credit go on the stream
    // connection (credit here is ignored, as on a demand connection).
    SendError(wire::ERROR_BAD_REQUEST,
              fmt::format("message {} belongs on the stream connection, not a lane",
                          int(frame.body_case())),
              rid);
    co_return;
  }
  switch (frame.body_case()) {
    case wire::Header::kOpenImage:
      if (role_ != Role::kStream) {
        SendError(wire::ERROR_BAD_REQUEST, "OpenImage belongs on a stream connection", rid);
      } else if (session_) {
        SendError(wire::ERROR_BAD_REQUEST, "this connection has opened an image already", rid);
      } else {
        co_await HandleOpenImage(frame);
      }
      break;
    case wire::Header::kRequest:
      HandleRequest(frame);
      break;
    case wire::Header::kPlaceInto:
      co_await HandlePlaceInto(frame);
      break;
    case wire::Header::kCredit:
      if (role_ == Role::kDemand || role_ == Role::kLane) break;  // they need no credit
      if (!session_) {
        // Pipelined before OpenImage's reply: keep it for the session.
        pending_credit_ = std::min<uint64_t>(
            pending_credit_ + std::min<uint64_t>(frame.credit().bytes(), UINT64_MAX / 2),
            UINT64_MAX / 2);
        break;
      }
      ctx_.dispatcher.Update(
          [&](Scheduler& s) { s.AddCredit(session_->id(), frame.credit().bytes()); });
      break;
    case wire::Header::kHave: {
      if (!session_) {
        SendError(wire::ERROR_BAD_REQUEST, "Have before OpenImage", rid);
        break;
      }
      const SessionId id = session_->id();
      auto [status, done] = ctx_.dispatcher.Update([&](Scheduler& s) {
        Status st = s.Have(id, frame.have().ranges());
        return std::make_pair(st, s.TakeStreamDone(id));
      });
      if (!status.ok()) SendError(ToWire(status.code()), status.message(), rid);
      if (done) SendStreamDone(*done);
      break;
    }
    case wire::Header::kStatsRequest:
      SendStatsReply(rid);
      break;
    case wire::Header::kGoodbye:
      spdlog::debug("{}: goodbye", Tag());
      draining_ = true;
      break;
    case wire::Header::kHello:
      SendError(wire::ERROR_BAD_REQUEST, "Hello was received already", rid);
      break;
    default:
      SendError(wire::ERROR_BAD_REQUEST,
                fmt::format("a client may not send message {}", int(frame.body_case())), rid);
      break;
  }
  co_return;
}

net::Awaitable<void> Connection::HandleOpenImage(const wire::Header& frame) {
  const uint64_t rid = frame.request_id();
  const std::string name = frame.open_image().image();
  if (ctx_.shutting_down) {
    SendError(wire::ERROR_SHUTTING_DOWN, "server is shutting down", rid);
    co_return;
  }
  if (const wire::OpenImage& open = frame.open_image(); open.supersedes_session() != 0) {
    Status superseded =
        co_await AwaitSuperseded(open.supersedes_session(), open.supersedes_secret());
    if (closed_ || draining_) co_return;
    if (!superseded.ok()) {
      spdlog::warn("{}: OpenImage '{}' refused: {}", Tag(), name.substr(0, 256),
                   superseded.ToString());
      SendError(superseded.code() == Code::kPermissionDenied ? wire::ERROR_UNAUTHENTICATED
                                                             : ToWire(superseded.code()),
                superseded.message(), rid);
      co_return;
    }
  }
  // Opening reads the manifest (or scans a CRIU directory): a disk thread does it.
  ImageStore& store = ctx_.store;
  auto open = [&store, name, grant = grant_] { return store.Open(name, grant); };
  Result<std::shared_ptr<const OpenedImage>> opened =
      co_await OnDiskThread<Result<std::shared_ptr<const OpenedImage>>>(std::move(open));
  if (closed_ || draining_) co_return;
  if (!opened.ok()) {
    spdlog::info("{}: OpenImage '{}' refused: {}", Tag(), name.substr(0, 256),
                 opened.status().ToString());
    SendError(ToWire(opened.status().code()), opened.status().message(), rid);
    co_return;
  }
  const OpenedImage& image = **opened;
  if (image.layout->max_payload() > ctx_.limits.max_payload) {
    SendError(wire::ERROR_LIMIT,
              fmt::format("image '{}' has chunks of {} bytes, over this server's frame limit {}",
                          name, image.layout->max_payload(), ctx_.limits.max_payload),
              rid);
    co_return;
  }

  wire::Header reply;
  reply.set_request_id(rid);
  wire::OpenImageReply* body = reply.mutable_open_image_reply();
  const manifest::Manifest& manifest = image.source->manifest();
  body->set_chunk_size(manifest.chunk_size());
  body->set_lazy_image(image.source->is_lazy());
  const SessionId id = ctx_.NextSessionId();
  body->set_session(id);
  std::string secret = RandomSecret();
  body->set_session_secret(secret);
  if (version_ >= 2) {
    body->set_table_bytes(image.table->size());
  } else {
    // Version 1: the table travels in the reply's header (64 KiB at most). A long profile is
    // cut to its hot set, which is all a client needs (docs/protocol.md, OpenImage).
    wire::ImageTable table = MakeImageTable(manifest);
    body->mutable_bos()->Swap(table.mutable_bos());
    *body->mutable_profile() = manifest.profile();
    if (reply.ByteSizeLong() > ctx_.limits.max_header)
      body->mutable_profile()->Swap(table.mutable_profile());  // the hot set alone
    if (reply.ByteSizeLong() > ctx_.limits.max_header) {
      SendError(wire::ERROR_LIMIT,
                fmt::format("image '{}' has too many BOs ({}) or too large a hot set for a "
                            "protocol version 1 OpenImageReply; a version 2 client has no limit",
                            name, manifest.bos_size()),
                rid);
      co_return;
    }
  }

  auto session = std::make_shared<Session>(ctx_, id, std::move(secret), *opened);
  if (!ctx_.AddSession(session)) {
    SendError(wire::ERROR_LIMIT,
              fmt::format("server has {} sessions open, its limit", ctx_.config.max_sessions), rid);
    co_return;
  }
  ctx_.totals.sessions_opened.fetch_add(1);
  ctx_.totals.sessions_open.fetch_add(1);
  session->SetStream(shared_from_this());
  session_ = session;
  ctx_.dispatcher.AddSession(id, image.layout, std::weak_ptr<ChunkSink>(session));
  if (pending_credit_ > 0) {
    const uint64_t credit = std::exchange(pending_credit_, 0);
    ctx_.dispatcher.Update([&](Scheduler& s) { s.AddCredit(id, credit); });
  }
  if (version_ >= 2) {
    EnqueueWithTable(std::move(reply), image.table);
  } else {
    Enqueue(std::move(reply));
  }
  spdlog::info("{}: session {} opened image '{}' ({} BOs, {} chunks, hot set {})", Tag(), id, name,
               image.layout->bo_count(), image.layout->total_chunks(), image.layout->hot_end());
}

bool Connection::SendImageFiles(uint64_t request_id) {
  const image::ImageSource& source = *session_->image().source;
  boost::system::error_code ec;
  const auto local = socket_.socket().local_endpoint(ec);
  if (!ctx_.config.pass_files) {
    Fail(wire::ERROR_BAD_REQUEST, "this server does not pass image files (--no-pass-files)",
         request_id);
    return false;
  }
  if (ec || socket_.is_tls() || local.protocol().family() != AF_UNIX) {
    Fail(wire::ERROR_BAD_REQUEST, "image files are passed only over Unix sockets", request_id);
    return false;
  }
  if (source.files().size() > net::kMaxPassedFds) {
    Fail(wire::ERROR_LIMIT,
         fmt::format("image has {} stored files, more than one message can pass ({})",
                     source.files().size(), net::kMaxPassedFds),
         request_id);
    return false;
  }
  // New open file descriptions, not ours: a client that changes its descriptor's flags
  // (O_DIRECT, say) must not change how the server reads. ReopenFile also checks each is still
  // the file the image was opened with.
  std::vector<UniqueFd> fds;
  std::vector<int> raw;
  wire::Header header;
  header.set_request_id(request_id);
  wire::ImageFiles* body = header.mutable_image_files();
  for (uint32_t i = 0; i < source.files().size(); ++i) {
    Result<UniqueFd> fd = source.ReopenFile(i);
    if (!fd.ok()) {
      spdlog::warn("{}: cannot pass image files: {}", Tag(), fd.status().ToString());
      Fail(ToWire(fd.status().code()),
           fmt::format("image file {} cannot be passed", source.files()[i].name), request_id);
      return false;
    }
    raw.push_back(fd->get());
    fds.push_back(std::move(fd).value());
    wire::ImageFile* file = body->add_files();
    file->set_name(ToValidUtf8(source.files()[i].name));
    file->set_size(source.files()[i].size);
  }
  // Before the send: the client may ask by_reference on its stream connection (another strand)
  // the moment the files arrive. A client whose files never arrive does not ask.
  session_->MarkFilesPassed();
  // Nothing else has been written on this connection, and the frame is small: it goes out in
  // one sendmsg, beside the writer (whose queue is empty), which then finds nothing to send.
  Status sent = net::SendFrameWithFds(socket_.socket().native_handle(), header, raw, ctx_.limits);
  if (!sent.ok()) {
    spdlog::warn("{}: passing {} image files failed: {}", Tag(), raw.size(), sent.ToString());
    Close("passing the image files failed");
    return false;
  }
  spdlog::info("{}: passed {} image file(s) of image '{}'", Tag(), raw.size(),
               session_->image().name);
  return true;
}

namespace {

// What a by-reference ChunkData would say of each chunk, all at once: the client reads a chunk
// it waits for without a round trip to us (docs/protocol.md, "The chunk table").
struct BuiltChunkTable {
  std::shared_ptr<const std::string> bytes;
  bool every_checksum = true;
};

Result<BuiltChunkTable> BuildChunkTable(const image::ImageSource& source) {
  wire::ChunkLocations table;
  bool every_checksum = true;
  for (uint32_t bo = 0; bo < static_cast<uint32_t>(source.manifest().bos_size()); ++bo) {
    const uint32_t chunks =
        static_cast<uint32_t>(source.manifest().bos(static_cast<int>(bo)).chunks_size());
    for (uint32_t chunk = 0; chunk < chunks; ++chunk) {
      Result<image::StoredChunk> located = source.LocateStoredChunk(bo, chunk);
      if (!located.ok()) return located.status();
      if (!located->in_file) return Internal("BO {} chunk {} is in no file", bo, chunk);
      table.add_file(located->in_file->file);
      table.add_offset(located->in_file->offset);
      table.add_stored_length(static_cast<uint32_t>(located->in_file->length));
      table.add_codec(located->codec);
      table.add_checksum(located->has_checksum ? located->checksum : 0);
      table.add_has_checksum(located->has_checksum);
      every_checksum = every_checksum && located->has_checksum;
    }
  }
  return BuiltChunkTable{std::make_shared<const std::string>(table.SerializeAsString()),
                         every_checksum};
}

}  // namespace

net::Awaitable<void> Connection::SendChunkTable(uint64_t request_id) {
  // A disk thread builds it: an image of millions of chunks takes long enough to stall the
  // other connections of this network thread.
  const Clock::time_point start = Clock::now();
  auto build = [session = session_,
                totals = &ctx_.totals]() -> Result<std::shared_ptr<const std::string>> {
    OpenedImage::ChunkTableCache& cache = *session->image().chunk_table;
    std::lock_guard lock(cache.mu);  // others asking meanwhile wait for this one build
    const Clock::time_point now = Clock::now();
    if (!cache.table || (!cache.every_checksum && now - cache.built >= std::chrono::seconds(1))) {
      GPULAZY_ASSIGN_OR_RETURN(BuiltChunkTable built, BuildChunkTable(*session->image().source));
      cache.table = std::move(built.bytes);
      cache.every_checksum = built.every_checksum;
      cache.built = now;
      totals->chunk_tables_built.fetch_add(1);
    }
    return cache.table;
  };
  Result<std::shared_ptr<const std::string>> table =
      co_await OnDiskThread<Result<std::shared_ptr<const std::string>>>(std::move(build));
  if (closed_) co_return;
  if (!table.ok()) {
    // The client then asks us for what it cannot read itself.
    spdlog::warn("{}: no chunk table: {}", Tag(), table.status().ToString());
    Fail(wire::ERROR_INTERNAL, fmt::format("no chunk table: {}", table.status().message()),
         request_id);
    co_return;
  }
  spdlog::debug("{}: chunk table of {} bytes built in {:.1f} ms", Tag(), (*table)->size(),
                std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  wire::Header header;
  header.set_request_id(request_id);
  header.mutable_chunk_table()->set_table_bytes((*table)->size());
  EnqueueWithTable(std::move(header), *table);
}

template <typename T, typename Work>
net::Awaitable<T> Connection::OnDiskThread(Work work) {
  // A timer on this strand wakes us when the result is back. (GCC 12 mishandles capturing
  // lambdas inside co_await expressions, so the hand-over is spelled out.)
  struct Pending {
    explicit Pending(const asio::any_io_executor& executor) : done(executor) {}
    asio::steady_timer done;
    std::optional<T> result;
  };
  auto pending = std::make_shared<Pending>(socket_.get_executor());
  asio::post(ctx_.dispatcher.pool(), [pending, work = std::move(work)]() mutable {
    T result = work();
    asio::post(pending->done.get_executor(), [pending, result = std::move(result)]() mutable {
      pending->result.emplace(std::move(result));
      pending->done.cancel();
    });
  });
  error_code ec;
  while (!pending->result) {
    pending->done.expires_at(Clock::time_point::max());
    co_await pending->done.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  co_return std::move(*pending->result);
}

net::Awaitable<void> Connection::HandlePlaceInto(const wire::Header& frame) {
  const uint64_t rid = frame.request_id();
  const wire::PlaceInto& place = frame.place_into();
  if (!ctx_.placement || !identity_.pid) {
    SendError(wire::ERROR_BAD_REQUEST,
              ctx_.placement ? "placement is only offered on Unix sockets"
                             : "this server does not place chunks (gpulazy-server --placement)",
              rid);
    co_return;
  }
  if (role_ != Role::kStream || !session_) {
    SendError(wire::ERROR_BAD_REQUEST, "PlaceInto belongs on a stream connection after OpenImage",
              rid);
    co_return;
  }
  PlacementBackend& backend = *ctx_.placement;
  if (place.kind() != backend.kind() || place.device() != backend.device()) {
    SendError(wire::ERROR_BAD_REQUEST,
              fmt::format("this server places into {} memory{}, not the destinations offered",
                          backend.kind(), backend.device().empty() ? "" : " of its own GPU"),
              rid);
    co_return;
  }
  if (static_cast<size_t>(place.targets_size()) > kMaxTargetsPerPlaceInto) {
    SendError(wire::ERROR_BAD_REQUEST,
              fmt::format("PlaceInto: {} destinations in one frame, at most {}",
                          place.targets_size(), kMaxTargetsPerPlaceInto),
              rid);
    co_return;
  }
  const manifest::Manifest& manifest = session_->image().source->manifest();
  std::vector<Session::PlacementTargetEntry> entries;
  std::set<uint32_t> named;
  for (const wire::PlacementTarget& target : place.targets()) {
    std::string problem;
    if (target.bo() >= static_cast<uint32_t>(manifest.bos_size()))
      problem = fmt::format("BO {} is not in the image ({} BOs)", target.bo(), manifest.bos_size());
    else if (!named.insert(target.bo()).second || session_->HasPlacementTarget(target.bo()))
      problem = fmt::format("BO {} is named twice", target.bo());
    else if (target.size() < manifest.bos(static_cast<int>(target.bo())).size())
      problem = fmt::format("the destination of BO {} holds {} bytes, the BO {}", target.bo(),
                            target.size(), manifest.bos(static_cast<int>(target.bo())).size());
    if (!problem.empty()) {
      SendError(wire::ERROR_BAD_REQUEST, "PlaceInto: " + problem, rid);
      co_return;
    }
    entries.push_back({target.bo(), target.handle(), target.size(), nullptr});
  }
  // Taking a memfd from the client's process is system calls: a disk thread does it. All or
  // nothing: one refused leaves the session as it was. The costly part, opening, comes after
  // the reply (Session::AddPlacementTargets), so the stream need not wait for every BO's.
  auto accept = [&backend, entries = std::move(entries),
                 peer = identity_]() mutable -> Result<std::vector<Session::PlacementTargetEntry>> {
    for (Session::PlacementTargetEntry& entry : entries) {
      Result<std::unique_ptr<AcceptedTarget>> accepted =
          backend.Accept(entry.handle, entry.size, peer);
      if (!accepted.ok())
        return accepted.status().Context(fmt::format("the destination of BO {}", entry.bo));
      entry.accepted = std::move(*accepted);
    }
    return std::move(entries);
  };
  Result<std::vector<Session::PlacementTargetEntry>> opened =
      co_await OnDiskThread<Result<std::vector<Session::PlacementTargetEntry>>>(std::move(accept));
  if (closed_ || draining_) co_return;
  if (!opened.ok()) {
    spdlog::info("{}: PlaceInto refused: {}", Tag(), opened.status().ToString());
    // The client's own memory is what was refused: nothing about images to keep quiet about
    // (ToWire says ERROR_NOT_FOUND for a denial), and the message says why.
    SendError(
        opened.status().code() == Code::kInternal ? wire::ERROR_INTERNAL : wire::ERROR_BAD_REQUEST,
        "PlaceInto: " + opened.status().message(), rid);
    co_return;
  }
  Status added = session_->AddPlacementTargets(std::move(*opened));
  if (!added.ok()) {
    SendError(wire::ERROR_BAD_REQUEST, "PlaceInto: " + added.message(), rid);
    co_return;
  }
  wire::Header reply;
  reply.set_request_id(rid);
  reply.mutable_place_into_reply()->set_targets(
      static_cast<uint32_t>(session_->placement_targets()));
  spdlog::debug("{}: {} placement destination(s)", Tag(), session_->placement_targets());
  Enqueue(std::move(reply));
}

void Connection::HandleRequest(const wire::Header& frame) {
  const uint64_t rid = frame.request_id();
  if (!session_) {
    SendError(wire::ERROR_BAD_REQUEST, "Request before OpenImage", rid);
    return;
  }
  const wire::Request& request = frame.request();
  const SessionId id = session_->id();
  if (request.by_reference() && !session_->files_passed()) {
    SendError(wire::ERROR_BAD_REQUEST,
              "by_reference needs the image files first (a Hello with want_files)", rid);
    return;
  }
  if (request.placed() && request.by_reference()) {
    SendError(wire::ERROR_BAD_REQUEST, "a Request is either placed or by_reference, not both", rid);
    return;
  }
  if (request.placed() && session_->placement_targets() == 0) {
    SendError(wire::ERROR_BAD_REQUEST, "placed needs destinations first (PlaceInto)", rid);
    return;
  }
  const Delivery delivery = request.placed()         ? Delivery::kPlaced
                            : request.by_reference() ? Delivery::kByReference
                                                     : Delivery::kBytes;
  if (request.stream_all()) {
    if (role_ == Role::kDemand) {
      SendError(wire::ERROR_BAD_REQUEST, "stream_all belongs on the stream connection", rid);
      return;
    }
    Status started;
    auto done = ctx_.dispatcher.Update([&](Scheduler& s) -> std::optional<StreamDoneInfo> {
      started = s.StreamAll(id, delivery);
      if (!started.ok()) return std::nullopt;
      return s.TakeStreamDone(id);
    });
    if (!started.ok()) {
      SendError(ToWire(started.code()), started.message(), rid);
      return;
    }
    spdlog::debug("{}: stream_all", Tag());
    if (done) SendStreamDone(*done);
    return;
  }
  if (!wire::Priority_IsValid(request.priority())) {
    SendError(wire::ERROR_BAD_REQUEST, fmt::format("unknown priority {}", int(request.priority())),
              rid);
    return;
  }
  const Output output = role_ == Role::kDemand ? Output::kDemand : Output::kStream;
  const auto now = Clock::now();
  Status status = ctx_.dispatcher.Update([&](Scheduler& s) {
    return s.Enqueue(id, request.priority(), output, rid, request.ranges(), now, delivery, id_);
  });
  if (!status.ok()) {
    spdlog::info("{}: request {} refused: {}", Tag(), rid, status.ToString());
    SendError(ToWire(status.code()), status.message(), rid);
  }
}

void Connection::SendStatsReply(uint64_t request_id) {
  wire::Header reply;
  reply.set_request_id(request_id);
  std::optional<SessionId> own;
  if (session_) own = session_->id();
  reply.mutable_stats_reply()->set_json(ctx_.StatsJson(own, ctx_.limits.max_header - 1024, grant_));
  Enqueue(std::move(reply));
}

void Connection::SendStreamDone(const StreamDoneInfo& info) {
  spdlog::info("{}: stream done, {} chunks, {} bytes", Tag(), info.chunks, info.bytes);
  if (session_) session_->BroadcastStreamDone(info);
}

void Connection::EnqueueStreamDone(const StreamDoneInfo& info) {
  Enqueue(StreamDoneFrame(info));
}

void Connection::Enqueue(wire::Header header, std::shared_ptr<const std::string> payload,
                         std::string_view payload_bytes) {
  if (closed_) return;
  const size_t bytes = header.ByteSizeLong();
  if (control_bytes_ + bytes > kMaxQueuedControlBytes) {
    DropUnreadReplies();
    return;
  }
  control_bytes_ += bytes;
  control_.push_back(ControlFrame{std::move(header), std::move(payload), payload_bytes});
  NoteControlQueue();
  Wake();
}

void Connection::EnqueueWithTable(wire::Header header,
                                  const std::shared_ptr<const std::string>& table) {
  const uint64_t request_id = header.request_id();
  const std::string_view all(*table);
  const size_t piece = ctx_.limits.max_payload;
  std::string_view first = all.substr(0, piece);
  Enqueue(std::move(header), table, first);
  for (size_t offset = first.size(); offset < all.size(); offset += piece) {
    wire::Header part;
    part.set_request_id(request_id);
    part.mutable_image_table_part();
    Enqueue(std::move(part), table, all.substr(offset, piece));
  }
}

void Connection::NoteControlQueue() {
  const uint64_t frames = control_.size();
  const uint64_t bytes = control_bytes_;
  queued_reply_frames_.store(frames, std::memory_order_relaxed);
  queued_reply_bytes_.store(bytes, std::memory_order_relaxed);
  auto raise = [](std::atomic<uint64_t>& peak, uint64_t value) {
    uint64_t seen = peak.load(std::memory_order_relaxed);
    while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
  };
  raise(ctx_.totals.reply_frames_queued_peak, frames);
  raise(ctx_.totals.reply_bytes_queued_peak, bytes);
}

void Connection::DropUnreadReplies() {
  if (draining_) return;  // cut off already; its last word is queued
  spdlog::warn("{}: {} bytes of replies queued that the client does not read; closing", Tag(),
               control_bytes_);
  control_.clear();
  wire::Header header;
  wire::Error* error = header.mutable_error();
  error->set_code(wire::ERROR_LIMIT);
  error->set_message(
      fmt::format("client does not read its replies ({} bytes queued, limit {}); closing",
                  control_bytes_, kMaxQueuedControlBytes));
  ctx_.totals.errors_sent.fetch_add(1);
  control_bytes_ = header.ByteSizeLong();
  control_.push_back(ControlFrame{std::move(header), nullptr, {}});
  NoteControlQueue();
  ctx_.totals.reply_cutoffs.fetch_add(1);
  // Stop reading (wakes a pending read with end-of-file) and give the client the shutdown grace
  // to read the error; the watchdog closes the socket if it does not.
  draining_ = true;
  error_code ec;
  socket_.shutdown(asio::socket_base::shutdown_receive, ec);
  SetDeadline(std::min(deadline_, Clock::now() + ctx_.config.shutdown_grace));
  Wake();
}

void Connection::SendError(wire::ErrorCode code, std::string message, uint64_t in_reply_to) {
  wire::Header header;
  header.set_request_id(in_reply_to);
  wire::Error* error = header.mutable_error();
  error->set_code(code);
  // Messages quote what clients and disks hold; the reader could not parse invalid UTF-8.
  error->set_message(ToValidUtf8(std::move(message)));
  error->set_in_reply_to(in_reply_to);
  ctx_.totals.errors_sent.fetch_add(1);
  if (session_) session_->stats().errors_sent.fetch_add(1);
  Enqueue(std::move(header));
}

void Connection::Fail(wire::ErrorCode code, std::string message, uint64_t in_reply_to) {
  spdlog::info("{}: closing after error {}: {}", Tag(), wire::ErrorCode_Name(code), message);
  SendError(code, std::move(message), in_reply_to);
  draining_ = true;
}

void Connection::Shutdown(wire::ErrorCode code, std::string message) {
  asio::post(socket_.get_executor(), [self = shared_from_this(), code,
                                      message = std::move(message)]() mutable {
    if (self->moved_away_) {
      if (std::shared_ptr<Connection> successor = self->successor_.lock())
        successor->Shutdown(code, std::move(message));
      return;
    }
    if (self->closed_) return;
    if (self->draining_) {
      // Already ending (an error sent, or a files connection writing its chunk table, whose
      // deadline is the idle timeout): it gets the grace and no more, like every connection.
      self->SetDeadline(std::min(self->deadline_, Clock::now() + self->ctx_.config.shutdown_grace));
      return;
    }
    if (code != wire::ERROR_NONE) {
      self->SendError(code, std::move(message), 0);
    } else {
      wire::Header bye;
      bye.mutable_goodbye();
      self->Enqueue(std::move(bye));
    }
    self->draining_ = true;
    // Wakes the pending read with end-of-file; the write in flight goes on.
    error_code ec;
    self->socket_.shutdown(asio::socket_base::shutdown_receive, ec);
    self->SetDeadline(std::min(self->deadline_, Clock::now() + self->ctx_.config.shutdown_grace));
    self->Wake();
  });
}

void Connection::PostChunk(WorkItem item, Result<LoadedChunk> chunk) {
  asio::post(socket_.get_executor(),
             [self = shared_from_this(), item, chunk = std::move(chunk)]() mutable {
               self->DeliverChunk(item, std::move(chunk));
             });
}

void Connection::PostControl(wire::Header header) {
  asio::post(socket_.get_executor(),
             [self = shared_from_this(), header = std::move(header)]() mutable {
               self->Enqueue(std::move(header));
             });
}

void Connection::DeliverChunk(WorkItem item, Result<LoadedChunk> chunk) {
  if (closed_ || draining_) {
    ctx_.dispatcher.Done(item, std::nullopt);
    return;
  }
  if (!chunk.ok()) {
    // Read errors may name files by absolute path; say only what the client named.
    const std::string message =
        session_ ? NameInsteadOfDir(chunk.status().message(), session_->image().dir.string(),
                                    session_->image().name)
                 : chunk.status().message();
    spdlog::warn("{}: BO {} chunk {}: read failed: {}", Tag(), item.bo, item.chunk,
                 chunk.status().ToString());
    SendError(ToWire(chunk.status().code()),
              fmt::format("BO {} chunk {}: {}", item.bo, item.chunk, message), item.request_id);
    std::optional<StreamDoneInfo> done = ctx_.dispatcher.Done(item, std::nullopt);
    if (done) SendStreamDone(*done);
    MarkStreamSeq(item);
    return;
  }
  chunks_.push_back(ReadyChunk{item, std::move(*chunk)});
  Wake();
}

net::Awaitable<void> Connection::WriteLoop() {
  error_code ec;
  while (!closed_) {
    if (!transport_ready_) {
      // Nothing may be written into a TLS stream before its handshake (a shutdown notice that
      // arrives meanwhile waits; a failed handshake closes the connection, which ends us).
      if (draining_) break;
      wake_.expires_at(Clock::time_point::max());
      co_await wake_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      continue;
    }
    if (!control_.empty()) {
      ControlFrame frame = std::move(control_.front());
      control_.pop_front();
      control_bytes_ -= std::min(control_bytes_, frame.header.ByteSizeLong());
      NoteControlQueue();
      if (reader_paused_ && control_.size() < kMaxQueuedControl) reader_resume_.cancel();
      BeginWrite();
      const std::span<const uint8_t> payload(
          reinterpret_cast<const uint8_t*>(frame.payload_bytes.data()), frame.payload_bytes.size());
      Status status = co_await net::WriteFrame(socket_, frame.header, payload, ctx_.limits);
      EndWrite();
      if (!status.ok()) {
        Close(fmt::format("write failed: {}", status.ToString()));
        break;
      }
      Touch();
      continue;
    }
    if (!draining_) {
      auto pick = NextSendable();
      if (pick != chunks_.end()) {
        ReadyChunk ready = std::move(*pick);
        chunks_.erase(pick);
        const WorkItem item = ready.item;
        co_await WriteChunk(ready);
        MarkStreamSeq(item);
        continue;
      }
    }
    if (draining_) break;
    wake_.expires_at(Clock::time_point::max());
    co_await wake_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  for (ReadyChunk& ready : chunks_)
    ctx_.dispatcher.Done(ready.item, std::nullopt);
  chunks_.clear();
  writer_done_ = true;
  writer_exit_.cancel();
}

std::deque<Connection::ReadyChunk>::iterator Connection::NextSendable() {
  // A demand chunk that is ready goes before the stream chunks ready ahead of it.
  auto pick = std::find_if(chunks_.begin(), chunks_.end(), [](const ReadyChunk& r) {
    return r.item.priority == wire::PRIORITY_DEMAND;
  });
  if (pick != chunks_.end()) return pick;
  return std::find_if(chunks_.begin(), chunks_.end(), [this](const ReadyChunk& r) {
    return r.item.output == Output::kStream && r.item.stream_seq == next_stream_seq_;
  });
}

void Connection::MarkStreamSeq(const WorkItem& item) {
  if (item.output != Output::kStream) return;
  if (item.stream_seq != next_stream_seq_) {
    stream_seq_done_.insert(item.stream_seq);
    return;
  }
  ++next_stream_seq_;
  for (auto it = stream_seq_done_.begin(); it != stream_seq_done_.end() && *it == next_stream_seq_;
       it = stream_seq_done_.erase(it))
    ++next_stream_seq_;
  Wake();
}

net::Awaitable<void> Connection::WriteChunk(ReadyChunk& ready) {
  const WorkItem& item = ready.item;
  const LoadedChunk& chunk = ready.chunk;
  const uint64_t payload = chunk.in_file || chunk.placed ? 0 : chunk.info.stored_length;
  // Credit counts the stored bytes the client takes on, whether they travel, it reads them or
  // they were placed (RAW: the raw length).
  const uint64_t charged = chunk.in_file  ? chunk.in_file->length
                           : chunk.placed ? chunk.info.raw_length
                                          : payload;
  if (payload > ctx_.limits.max_payload || payload > UINT32_MAX) {
    SendError(wire::ERROR_LIMIT,
              fmt::format("BO {} chunk {}: {} stored bytes exceed the frame limit", item.bo,
                          item.chunk, payload),
              item.request_id);
    auto done = ctx_.dispatcher.Done(item, std::nullopt);
    if (done) SendStreamDone(*done);
    co_return;
  }
  // Credit was reserved from the manifest's length; a longer payload must find the rest, so
  // the stream never carries more than the client granted.
  if (item.output == Output::kStream && charged > item.reserved_credit &&
      !ctx_.dispatcher.TakeCredit(item.session, charged - item.reserved_credit)) {
    SendError(wire::ERROR_INTERNAL,
              fmt::format("BO {} chunk {}: {} stored bytes where the manifest says {}", item.bo,
                          item.chunk, charged, item.reserved_credit),
              item.request_id);
    auto done = ctx_.dispatcher.Done(item, std::nullopt);
    if (done) SendStreamDone(*done);
    co_return;
  }

  wire::Header header;
  header.set_request_id(item.request_id);
  wire::ChunkData* body = header.mutable_chunk();
  body->set_bo(item.bo);
  body->set_chunk(item.chunk);
  body->set_codec(chunk.info.codec);
  body->set_raw_length(chunk.info.raw_length);
  body->set_checksum(chunk.info.checksum);
  body->set_priority(item.priority);
  if (chunk.in_file) {
    wire::FileRange* where = body->mutable_in_file();
    where->set_file(chunk.in_file->file);
    where->set_offset(chunk.in_file->offset);
    where->set_length(static_cast<uint32_t>(chunk.in_file->length));
    body->set_no_checksum(!chunk.has_checksum);
  }
  if (chunk.placed) {
    body->set_placed(true);
    body->set_no_checksum(!chunk.has_checksum);
  }
  BeginWrite();
  const auto write_started = Clock::now();
  // Not one ?: of two co_awaits: GCC 12 destroys the unused branch's temporary Status.
  Status status;
  if (chunk.from_file)
    status = co_await net::WriteFrameFromFile(
        socket_, header, chunk.from_file->fd, chunk.from_file->offset,
        static_cast<uint32_t>(chunk.from_file->length), ctx_.limits);
  else
    status = co_await net::WriteFrame(socket_, header, chunk.bytes(), ctx_.limits);
  EndWrite();
  if (!status.ok()) {
    ctx_.dispatcher.Done(item, std::nullopt);
    Close(
        fmt::format("write of BO {} chunk {} failed: {}", item.bo, item.chunk, status.ToString()));
    co_return;
  }
  const auto sent_at = Clock::now();
  const int priority = std::clamp<int>(item.priority, 0, 2);
  ctx_.totals.bytes_sent.fetch_add(payload);
  if (chunk.from_file) ctx_.totals.bytes_sendfile.fetch_add(payload);
  ctx_.totals.chunks_sent[priority].fetch_add(1);
  if (session_) {
    session_->stats().bytes_sent.fetch_add(payload);
    if (chunk.in_file) session_->stats().bytes_by_reference.fetch_add(charged);
    if (chunk.placed) session_->stats().bytes_placed.fetch_add(charged);
    if (chunk.from_file) session_->stats().bytes_sendfile.fetch_add(payload);
    session_->stats().chunks_sent[priority].fetch_add(1);
    if (item.priority == wire::PRIORITY_DEMAND)
      session_->RecordDemandLatency(write_started - item.received, sent_at - write_started);
  }
  spdlog::trace("{}: sent BO {} chunk {} ({} bytes, {})", Tag(), item.bo, item.chunk, payload,
                wire::Priority_Name(item.priority));
  Touch();
  std::optional<StreamDoneInfo> done = ctx_.dispatcher.Done(item, static_cast<uint32_t>(charged));
  if (done) SendStreamDone(*done);
}

net::Awaitable<void> Connection::Watchdog() {
  error_code ec;
  while (!closed_) {
    watchdog_.expires_at(std::min(deadline_, write_deadline_));
    co_await watchdog_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (closed_) break;
    const Clock::time_point now = Clock::now();
    if (now >= write_deadline_) {
      spdlog::warn(
          "{}: a frame write made no progress for {} ms (the client stopped reading); "
          "closing",
          Tag(), ctx_.config.write_timeout.count());
      Close("write timed out");
      break;
    }
    if (now < deadline_) continue;  // moved later meanwhile (or re-armed)
    if (role_ == Role::kNew && !draining_) {
      spdlog::info("{}: no Hello within {} ms; closing", Tag(), ctx_.config.hello_timeout.count());
    } else if (!draining_) {
      spdlog::info("{}: idle for {} ms; closing", Tag(), ctx_.config.idle_timeout.count());
    }
    Close("deadline passed");
    break;
  }
}

void Connection::Wake() {
  wake_.cancel();
}

void Connection::Touch() {
  if (draining_ || role_ == Role::kNew) return;
  deadline_ = ctx_.config.idle_timeout.count() > 0 ? Clock::now() + ctx_.config.idle_timeout
                                                   : Clock::time_point::max();
  // The first Touch after Hello may bring the deadline before the Hello deadline the watchdog
  // sleeps towards (an idle timeout shorter than the Hello timeout): wake it to re-arm.
  if (deadline_ < watchdog_.expiry()) watchdog_.cancel();
}

void Connection::BeginWrite() {
  if (ctx_.config.write_timeout.count() == 0) return;
  write_deadline_ = Clock::now() + ctx_.config.write_timeout;
  // The watchdog sleeps until the earlier of its deadlines; wake it only when this one is
  // earlier than what it waits for (after the first write it rarely is).
  if (write_deadline_ < watchdog_.expiry()) watchdog_.cancel();
}

void Connection::EndWrite() {
  write_deadline_ = Clock::time_point::max();
}

void Connection::SetDeadline(Clock::time_point deadline) {
  deadline_ = deadline;
  watchdog_.cancel();
}

void Connection::Close(std::string_view why) {
  if (closed_) return;
  closed_ = true;
  draining_ = true;
  if (moved_away_) {
    // The socket, the registry entry and the count of open connections are the successor's.
    wake_.cancel();
    watchdog_.cancel();
    reader_resume_.cancel();
    release_wait_.cancel();
    return;
  }
  error_code ec;
  socket_.shutdown(asio::socket_base::shutdown_both, ec);
  socket_.close(ec);
  wake_.cancel();
  watchdog_.cancel();
  reader_resume_.cancel();
  release_wait_.cancel();
  for (ReadyChunk& ready : chunks_)
    ctx_.dispatcher.Done(ready.item, std::nullopt);
  chunks_.clear();
  control_.clear();
  control_bytes_ = 0;
  NoteControlQueue();
  if (session_) {
    if (role_ == Role::kStream || role_ == Role::kLane) {
      session_->Close(this);
    } else {
      session_->DetachDemand(this);
    }
  }
  ctx_.RemoveConnection(id_);
  ctx_.totals.connections_open.fetch_sub(1);
  spdlog::debug("{}: closed ({})", Tag(), why);
}

}  // namespace gpulazy::server
