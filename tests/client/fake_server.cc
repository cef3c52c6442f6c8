#include "tests/client/fake_server.h"

#include <lz4.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <random>

#include "proto/checksum.h"
#include "proto/frame.h"

namespace gpulazy::testing {
namespace {

bool WriteAll(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t size) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::recv(fd, p, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool WriteFrame(int fd, const wire::Header& header, std::span<const uint8_t> payload = {}) {
  FrameLimits limits;
  limits.max_payload = UINT32_MAX;
  Result<std::string> head = EncodeFrameHead(header, static_cast<uint32_t>(payload.size()), limits);
  if (!head.ok()) return false;
  std::string frame = *head;
  frame.append(reinterpret_cast<const char*>(payload.data()), payload.size());
  return WriteAll(fd, frame.data(), frame.size());
}

bool ReadFrame(int fd, wire::Header* header) {
  uint8_t prefix_bytes[kFramePrefixSize];
  if (!ReadAll(fd, prefix_bytes, sizeof prefix_bytes)) return false;
  Result<FramePrefix> prefix = DecodeFramePrefix(prefix_bytes, FrameLimits{});
  if (!prefix.ok()) return false;
  std::vector<uint8_t> bytes(prefix->header_length + prefix->payload_length);
  if (!ReadAll(fd, bytes.data(), bytes.size())) return false;
  Result<wire::Header> parsed =
      DecodeFrameHeader(std::span<const uint8_t>(bytes.data(), prefix->header_length));
  if (!parsed.ok()) return false;
  *header = std::move(*parsed);
  return true;
}

void SendError(int fd, wire::ErrorCode code, const std::string& message) {
  wire::Header header;
  header.mutable_error()->set_code(code);
  header.mutable_error()->set_message(message);
  WriteFrame(fd, header);
}

}  // namespace

FakeImage FakeImage::Make(const std::vector<uint64_t>& sizes, uint32_t chunk_size, uint32_t seed) {
  FakeImage image;
  image.chunk_size = chunk_size;
  std::mt19937 rng(seed);
  for (uint64_t size : sizes) {
    std::vector<uint8_t> bytes(size);
    for (uint64_t i = 0; i < size; ++i)
      bytes[i] = ((i / chunk_size) % 3 == 2) ? 0 : static_cast<uint8_t>(rng() % 7);  // compressible
    image.bos.push_back(std::move(bytes));
  }
  return image;
}

FakeImage FakeImage::Small() {
  FakeImage image = Make({64 * 1024, 40000, 1000}, 4096, 7);
  manifest::ChunkRef* ref = image.profile.add_order();
  ref->set_bo(1);
  ref->set_chunk(3);
  ref = image.profile.add_order();
  ref->set_bo(2);
  ref->set_chunk(0);
  image.profile.set_hot_count(2);
  return image;
}

uint32_t FakeImage::ChunkCount(uint32_t bo) const {
  return static_cast<uint32_t>((bos[bo].size() + chunk_size - 1) / chunk_size);
}

uint64_t FakeImage::TotalChunks() const {
  uint64_t total = 0;
  for (uint32_t bo = 0; bo < bos.size(); ++bo)
    total += ChunkCount(bo);
  return total;
}

FakeServer::FakeServer(FakeImage image, FakeServerOptions options)
    : image_(std::move(image)), options_(std::move(options)) {
  char templ[] = "/tmp/gpulazy-fake-XXXXXX";
  dir_ = ::mkdtemp(templ);
  path_ = dir_ + "/server.sock";
  Listen();
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

FakeServer::~FakeServer() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  acceptor_.join();
  CloseAll();
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mutex_);
    threads.swap(threads_);
  }
  for (std::thread& t : threads)
    t.join();
  std::filesystem::remove_all(dir_);
}

void FakeServer::Listen() {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path_.c_str(), sizeof addr.sun_path - 1);
  ::unlink(path_.c_str());
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 16) != 0)
    std::abort();
  std::lock_guard lock(mutex_);
  listen_fd_ = fd;
}

void FakeServer::CloseAll() {
  std::lock_guard lock(mutex_);
  for (int fd : open_fds_)
    ::shutdown(fd, SHUT_RDWR);
  cv_.notify_all();
}

void FakeServer::Resume() {
  std::lock_guard lock(mutex_);
  options_.paused = false;
  cv_.notify_all();
}

void FakeServer::Pause() {
  std::lock_guard lock(mutex_);
  options_.paused = true;
}

void FakeServer::AdmitDemandJoins() {
  std::lock_guard lock(mutex_);
  options_.hold_demand_joins = false;
  cv_.notify_all();
}

void FakeServer::AcceptLoop() {
  for (;;) {
    int listen_fd;
    {
      std::lock_guard lock(mutex_);
      if (stopping_) break;
      listen_fd = listen_fd_;
    }
    if (listen_fd < 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    pollfd pfd{listen_fd, POLLIN, 0};
    if (::poll(&pfd, 1, 20) <= 0) continue;
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::lock_guard lock(mutex_);
    open_fds_.insert(fd);
    threads_.emplace_back([this, fd] { Serve(fd); });
  }
  std::lock_guard lock(mutex_);
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

void FakeServer::Serve(int fd) {
  wire::Header header;
  if (ReadFrame(fd, &header) && header.has_hello()) {
    wire::Header reply;
    reply.mutable_hello_reply()->set_version(
        std::min(header.hello().max_version(), options_.version));
    reply.mutable_hello_reply()->set_server_name("fake");
    reply.mutable_hello_reply()->set_max_payload(options_.max_payload);
    reply.mutable_hello_reply()->set_max_lanes(options_.max_lanes);
    const uint64_t joins = header.hello().join_session();
    // (A join that wants the image files is no demand connection: this server passes none.)
    const bool held = header.hello().join_as_lane() ? options_.lanes_join_after_stream_done
                      : header.hello().want_files() ? false
                                                    : options_.demand_joins_after_stream_done;
    if (joins != 0 && held) {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] {
        return stopping_ || stream_done_chunks_.contains(joins) || !live_sessions_.contains(joins);
      });
    }
    if (joins != 0 && !header.hello().join_as_lane() && !header.hello().want_files()) {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !options_.hold_demand_joins; });
    }
    if (joins != 0 && header.hello().join_as_lane()) {
      ServeLane(fd, header.hello(), reply);
    } else if (joins != 0) {
      ServeDemand(fd, header.hello(), reply);
    } else if (WriteFrame(fd, reply)) {
      ServeStream(fd, header.hello());
    }
  }
  std::lock_guard lock(mutex_);
  open_fds_.erase(fd);
  // The number may be reused at once (by a new listening socket, say): nothing may shut it down
  // as this connection's later on.
  for (auto& [id, session] : live_sessions_)
    if (session.second == fd) session.second = -1;
  for (auto& [id, lanes] : lanes_)
    std::erase(lanes, fd);
  ::close(fd);
}

void FakeServer::SendChunk(int fd, uint32_t bo, uint32_t chunk, wire::Priority priority,
                           uint64_t request_id, uint64_t* payload_bytes,
                           const std::function<void(uint64_t)>& before_write) {
  const std::vector<uint8_t>& bytes = image_.bos[bo];
  uint64_t start = uint64_t{chunk} * image_.chunk_size;
  size_t length = std::min<uint64_t>(image_.chunk_size, bytes.size() - start);
  std::span<const uint8_t> raw(bytes.data() + start, length);
  wire::Header header;
  header.set_request_id(request_id);
  wire::ChunkData* data = header.mutable_chunk();
  data->set_bo(bo);
  data->set_chunk(chunk);
  data->set_raw_length(static_cast<uint32_t>(length));
  data->set_checksum(Checksum64(raw));
  data->set_priority(priority);
  std::vector<uint8_t> payload;
  bool corrupt = false;
  bool bad_zero = false;
  {
    std::lock_guard lock(mutex_);
    auto it = options_.corrupt_copies.find({bo, chunk});
    if (it != options_.corrupt_copies.end() && it->second > 0) {
      --it->second;
      corrupt = true;
    }
    auto zero = options_.bad_zero_checksums.find({bo, chunk});
    if (zero != options_.bad_zero_checksums.end() && zero->second > 0 && IsAllZero(raw)) {
      --zero->second;
      bad_zero = true;
    }
  }
  if (bad_zero) {
    data->set_codec(manifest::CODEC_ZERO);
    data->set_checksum(data->checksum() ^ 1);
  } else if (corrupt) {
    data->set_codec(manifest::CODEC_RAW);
    payload.assign(raw.begin(), raw.end());
    payload[length / 2] ^= 0x5a;
  } else if (options_.mixed_codecs && IsAllZero(raw)) {
    data->set_codec(manifest::CODEC_ZERO);
  } else if (options_.mixed_codecs && chunk % 2 == 1) {
    data->set_codec(manifest::CODEC_LZ4);
    payload.resize(LZ4_compressBound(static_cast<int>(length)));
    int n = LZ4_compress_default(reinterpret_cast<const char*>(raw.data()),
                                 reinterpret_cast<char*>(payload.data()), static_cast<int>(length),
                                 static_cast<int>(payload.size()));
    payload.resize(static_cast<size_t>(n));
  } else {
    data->set_codec(manifest::CODEC_RAW);
    payload.assign(raw.begin(), raw.end());
  }
  *payload_bytes = payload.size();
  if (before_write) before_write(payload.size());
  WriteFrame(fd, header, payload);
}

bool FakeServer::SendOpenImageReply(int fd, wire::Header reply, bool version2) {
  if (!version2) return WriteFrame(fd, reply);
  using Fault = FakeServerOptions::TableFault;
  wire::OpenImageReply* open = reply.mutable_open_image_reply();
  wire::ImageTable table;
  *table.mutable_bos() = open->bos();
  *table.mutable_profile() = open->profile();
  if (options_.table_fault != Fault::kBosInHeader) open->clear_bos();
  open->clear_profile();
  std::string bytes = table.SerializeAsString();
  if (options_.table_fault == Fault::kGarbage) bytes.assign(100, '\xff');
  open->set_table_bytes(bytes.size());
  if (options_.table_fault == Fault::kAnnouncesTooMuch) {
    open->set_table_bytes(1ull << 40);
    return WriteFrame(fd, reply);
  }
  if (options_.table_fault == Fault::kPieceOverruns) open->set_table_bytes(bytes.size() - 10);
  auto piece = [&](size_t offset) {
    const size_t length = std::min<size_t>(options_.table_piece, bytes.size() - offset);
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()) + offset,
                                    length);
  };
  const bool empty_first = options_.table_fault == Fault::kEmptyPart;
  std::span<const uint8_t> first = empty_first ? std::span<const uint8_t>() : piece(0);
  if (!WriteFrame(fd, reply, first)) return false;
  wire::Header part;
  part.mutable_image_table_part();
  if (empty_first) return WriteFrame(fd, part);
  if (options_.table_fault == Fault::kOtherFrameBetween && first.size() < bytes.size()) {
    wire::Header done;
    done.mutable_stream_done();
    return WriteFrame(fd, done);
  }
  for (size_t offset = first.size(); offset < bytes.size(); offset += options_.table_piece)
    if (!WriteFrame(fd, part, piece(offset))) return false;
  return true;
}

// The stream connection: a reader thread takes Have, Credit and Request frames; this thread
// sends chunks under credit.
void FakeServer::ServeStream(int fd, const wire::Hello& hello) {
  wire::Header header;
  int session_index;
  uint64_t session_id;
  for (;;) {
    if (!ReadFrame(fd, &header)) return;
    if (!header.has_open_image()) return;
    if (header.open_image().image() != options_.image_name) {
      SendError(fd, wire::ERROR_NOT_FOUND, "no image named '" + header.open_image().image() + "'");
      continue;  // request-level error: the connection stays open
    }
    break;
  }
  wire::Header reply;
  wire::OpenImageReply* open = reply.mutable_open_image_reply();
  {
    std::lock_guard lock(mutex_);
    session_index = sessions_++;
    session_id = 1000 + static_cast<uint64_t>(session_index);
    live_sessions_[session_id] = {"secret-" + std::to_string(session_id), -1};
    haves_.emplace_back();
    stream_sent_.emplace_back();
  }
  open->set_session(session_id);
  open->set_session_secret("secret-" + std::to_string(session_id));
  open->set_chunk_size(image_.chunk_size);
  for (uint32_t bo = 0; bo < image_.bos.size(); ++bo) {
    wire::BoInfo* info = open->add_bos();
    info->set_process_id(1);
    info->set_bo_index(bo);
    info->set_gpu_id(0xc0de);
    info->set_size(image_.bos[bo].size());
    info->set_chunk_count(image_.ChunkCount(bo));
    if (bo == 0 && session_index > 0 && options_.different_image_after_first) {
      info->set_size(info->size() + image_.chunk_size);
      info->set_chunk_count(info->chunk_count() + 1);
    }
  }
  *open->mutable_profile() = image_.profile;
  if (!SendOpenImageReply(fd, std::move(reply), hello.max_version() >= 2 && options_.version >= 2))
    return;
  if (options_.drop_every_stream_after_open) {
    ::shutdown(fd, SHUT_RDWR);
    return;
  }

  // Shared with the reader thread under mutex_.
  struct State {
    uint64_t credit = 0;
    uint64_t granted = 0;
    uint64_t sent = 0;
    bool stream_all = false;
    bool closed = false;
    std::set<ChunkKey> have;
    std::deque<std::pair<ChunkKey, uint64_t>> demand;  // demand requests on this connection
  } state;
  std::thread reader([&] {
    wire::Header in;
    while (ReadFrame(fd, &in)) {
      std::lock_guard lock(mutex_);
      if (in.has_credit()) {
        state.credit += in.credit().bytes();
        state.granted += in.credit().bytes();
        max_outstanding_ = std::max(max_outstanding_, state.granted - state.sent);
      } else if (in.has_have()) {
        for (const wire::ChunkRange& range : in.have().ranges()) {
          haves_[session_index].push_back(range);
          for (uint32_t i = 0; i < range.chunk_count(); ++i)
            state.have.insert({range.bo(), range.first_chunk() + i});
        }
      } else if (in.has_request()) {
        if (in.request().stream_all()) state.stream_all = true;
        for (const wire::ChunkRange& range : in.request().ranges())
          for (uint32_t i = 0; i < range.chunk_count(); ++i)
            state.demand.push_back({{range.bo(), range.first_chunk() + i}, in.request_id()});
      }
      cv_.notify_all();
    }
    std::lock_guard lock(mutex_);
    state.closed = true;
    cv_.notify_all();
  });

  // Schedule: hot set (profile order), then everything else in table order, minus Have.
  std::vector<ChunkKey> order;
  std::set<ChunkKey> seen;
  for (int i = 0; i < image_.profile.order_size(); ++i) {
    ChunkKey key{image_.profile.order(i).bo(), image_.profile.order(i).chunk()};
    if (seen.insert(key).second) order.push_back(key);
  }
  for (uint32_t bo = 0; bo < image_.bos.size(); ++bo)
    for (uint32_t c = 0; c < image_.ChunkCount(bo); ++c)
      if (seen.insert({bo, c}).second) order.push_back({bo, c});

  size_t next = 0;
  size_t lane_cursor = 0;
  bool done_sent = false;
  for (;;) {
    ChunkKey key;
    uint64_t request_id = 0;
    wire::Priority priority = wire::PRIORITY_BACKGROUND;
    {
      std::unique_lock lock(mutex_);
      auto ready = [&] {
        if (stopping_ || state.closed) return true;
        if (!state.demand.empty()) return true;
        if (!state.stream_all || options_.paused) return false;
        while (next < order.size() && state.have.contains(order[next]))
          ++next;
        return next < order.size() || !done_sent;
      };
      cv_.wait(lock, ready);
      if (stopping_ || state.closed) break;
      if (!state.demand.empty()) {
        key = state.demand.front().first;
        request_id = state.demand.front().second;
        state.demand.pop_front();
        priority = wire::PRIORITY_DEMAND;
      } else if (next < order.size()) {
        key = order[next++];
      } else {
        // Under the lock that registers lanes: a lane joining from here on is sent StreamDone
        // by ServeLane, every earlier one below.
        const std::vector<int> lanes = lanes_[session_id];
        stream_done_chunks_[session_id] = order.size();
        cv_.notify_all();
        lock.unlock();
        wire::Header done;
        done.mutable_stream_done()->set_chunks(order.size());
        WriteFrame(fd, done);
        for (int lane : lanes)
          WriteFrame(lane, done);
        done_sent = true;
        continue;
      }
      // Credit: wait for enough for the worst case (a raw chunk) to keep this simple.
      uint64_t need = std::min<uint64_t>(image_.chunk_size, image_.bos[key.first].size());
      cv_.wait(lock, [&] { return stopping_ || state.closed || state.credit >= need; });
      if (stopping_ || state.closed) break;
    }
    // Background chunks are dealt over the stream connection and its lanes; demand keeps to it.
    int target = fd;
    bool on_lane = false;
    {
      std::lock_guard lock(mutex_);
      const std::vector<int>& lanes = lanes_[session_id];
      if (priority != wire::PRIORITY_DEMAND && !lanes.empty()) {
        const size_t pick = lane_cursor++ % (lanes.size() + 1);
        if (pick > 0) {
          target = lanes[pick - 1];
          on_lane = true;
        }
      }
    }
    uint64_t payload_bytes = 0;
    SendChunk(target, key.first, key.second, priority, request_id, &payload_bytes,
              [&](uint64_t bytes) {
                std::lock_guard lock(mutex_);
                if (bytes > state.credit) credit_violated_ = true;
                state.credit -= std::min(state.credit, bytes);
                state.sent += bytes;
              });
    bool drop = false;
    int lane_drop = -1;
    {
      std::lock_guard lock(mutex_);
      stream_sent_[session_index].insert(key);
      ++stream_chunks_sent_;
      if (on_lane) {
        ++lane_chunks_sent_;
        if (!lane_dropped_ && options_.drop_lane_after_chunks >= 0 &&
            lane_chunks_sent_ >= static_cast<uint64_t>(options_.drop_lane_after_chunks)) {
          lane_dropped_ = true;
          lane_drop = target;
        }
      }
      if (!dropped_ && options_.drop_after_chunks >= 0 &&
          stream_chunks_sent_ >= options_.drop_after_chunks) {
        dropped_ = true;
        drop = true;
      }
    }
    if (lane_drop >= 0) {
      // A session does not outlive its lanes: the stream connection goes too.
      ::shutdown(lane_drop, SHUT_RDWR);
      ::shutdown(fd, SHUT_RDWR);
      break;
    }
    if (drop) {
      if (options_.restart_on_drop) {
        // Stop listening (connections are refused), drop every connection, listen again later.
        {
          std::lock_guard lock(mutex_);
          ::close(listen_fd_);
          listen_fd_ = -1;
          ::unlink(path_.c_str());
        }
        CloseAll();
        std::this_thread::sleep_for(std::chrono::milliseconds(options_.restart_downtime_ms));
        Listen();
      }
      ::shutdown(fd, SHUT_RDWR);
      break;
    }
  }
  ::shutdown(fd, SHUT_RDWR);
  reader.join();
  // Sessions do not outlive their stream connection: drop the demand connection too.
  std::lock_guard lock(mutex_);
  auto it = live_sessions_.find(session_id);
  if (it != live_sessions_.end()) {
    if (it->second.second >= 0) ::shutdown(it->second.second, SHUT_RDWR);
    live_sessions_.erase(it);
  }
  for (int lane : lanes_[session_id])
    ::shutdown(lane, SHUT_RDWR);
  lanes_.erase(session_id);
  stream_done_chunks_.erase(session_id);
  cv_.notify_all();
}

bool FakeServer::JoinsLiveSessionLocked(int fd, const wire::Hello& hello) {
  auto it = live_sessions_.find(hello.join_session());
  if (it != live_sessions_.end() && it->second.first == hello.join_secret()) return true;
  SendError(fd, wire::ERROR_NOT_FOUND, "no such session");
  return false;
}

// A lane: the stream thread writes chunks to it; this thread reads until the client or the
// session closes it. As in the real server, a lane is registered by the time the client reads
// its HelloReply: the reply is written under the lock the stream thread deals chunks under, so
// no chunk can overtake it.
void FakeServer::ServeLane(int fd, const wire::Hello& hello, const wire::Header& reply) {
  {
    std::lock_guard lock(mutex_);
    // Refusals instead of the HelloReply, as from the real server.
    if (!JoinsLiveSessionLocked(fd, hello)) return;
    if (lanes_[hello.join_session()].size() >= options_.max_lanes) {
      SendError(fd, wire::ERROR_LIMIT, "too many lanes");
      return;
    }
    if (!WriteFrame(fd, reply)) return;
    lanes_[hello.join_session()].push_back(fd);
    ++lanes_joined_;
    // A lane that joins after the stream ended is told so at once, as the real server does;
    // the stream thread sends nothing more on it.
    if (auto done = stream_done_chunks_.find(hello.join_session());
        done != stream_done_chunks_.end()) {
      wire::Header frame;
      frame.mutable_stream_done()->set_chunks(done->second);
      WriteFrame(fd, frame);
    }
  }
  wire::Header header;
  while (ReadFrame(fd, &header)) {
  }
  // The stream thread may still write to this fd: keep it open until its session ended.
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return stopping_ || !live_sessions_.contains(hello.join_session()); });
}

// The demand connection: answers each request at once, in order.
void FakeServer::ServeDemand(int fd, const wire::Hello& hello, const wire::Header& reply) {
  {
    // As the real server: a join for a session that ended (its stream connection closed) is
    // answered ERROR_NOT_FOUND instead of a HelloReply.
    std::lock_guard lock(mutex_);
    if (!JoinsLiveSessionLocked(fd, hello) || !WriteFrame(fd, reply)) return;
    live_sessions_[hello.join_session()].second = fd;
  }
  wire::Header header;
  while (ReadFrame(fd, &header)) {
    if (!header.has_request()) continue;
    {
      std::unique_lock lock(mutex_);
      demand_requests_.push_back(header.request());
      cv_.wait(lock, [&] { return stopping_ || !options_.hold_demand || !options_.paused; });
      if (stopping_) return;
    }
    for (const wire::ChunkRange& range : header.request().ranges()) {
      for (uint32_t i = 0; i < range.chunk_count(); ++i) {
        uint32_t chunk = range.first_chunk() + i;
        if (range.bo() >= image_.bos.size() || chunk >= image_.ChunkCount(range.bo())) {
          wire::Header error;
          error.mutable_error()->set_code(wire::ERROR_OUT_OF_RANGE);
          error.mutable_error()->set_in_reply_to(header.request_id());
          WriteFrame(fd, error);
          continue;
        }
        uint64_t ignored;
        SendChunk(fd, range.bo(), chunk, wire::PRIORITY_DEMAND, header.request_id(), &ignored);
      }
    }
  }
}

int FakeServer::sessions() const {
  std::lock_guard lock(mutex_);
  return sessions_;
}
std::vector<std::vector<wire::ChunkRange>> FakeServer::haves() const {
  std::lock_guard lock(mutex_);
  return haves_;
}
std::vector<wire::Request> FakeServer::demand_requests() const {
  std::lock_guard lock(mutex_);
  return demand_requests_;
}
std::vector<std::set<ChunkKey>> FakeServer::stream_sent() const {
  std::lock_guard lock(mutex_);
  return stream_sent_;
}
uint64_t FakeServer::lane_chunks_sent() const {
  std::lock_guard lock(mutex_);
  return lane_chunks_sent_;
}
uint64_t FakeServer::lanes_joined() const {
  std::lock_guard lock(mutex_);
  return lanes_joined_;
}
uint64_t FakeServer::max_outstanding_credit() const {
  std::lock_guard lock(mutex_);
  return max_outstanding_;
}
bool FakeServer::credit_violated() const {
  std::lock_guard lock(mutex_);
  return credit_violated_;
}

}  // namespace gpulazy::testing
