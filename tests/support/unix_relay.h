// A relay between a client and a server on Unix sockets that breaks the connections on request:
// the hard breaks (a reset, a link cut at once) a client must survive. Each connection to
// `listen_at` is forwarded to `server` by two threads, one a direction. Tests only.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace gpulazy::testing {

class UnixRelay {
 public:
  UnixRelay(const std::filesystem::path& listen_at, const std::filesystem::path& server)
      : server_(server) {
    std::filesystem::remove(listen_at);  // an earlier relay's
    listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_un address = Address(listen_at);
    if (listener_ < 0 ||
        ::bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 ||
        ::listen(listener_, 64) != 0)
      throw std::runtime_error("relay: cannot listen at " + listen_at.string() + ": " +
                               std::strerror(errno));
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }
  ~UnixRelay() {
    stopping_.store(true);
    ::shutdown(listener_, SHUT_RDWR);  // wakes the acceptor's poll
    acceptor_.join();
    ::close(listener_);
    std::vector<std::shared_ptr<Pair>> pairs;
    {
      std::lock_guard lock(mu_);
      pairs.swap(pairs_);
    }
    for (const auto& pair : pairs) {
      ::shutdown(pair->client, SHUT_RDWR);
      ::shutdown(pair->server, SHUT_RDWR);
    }
    for (const auto& pair : pairs)
      pair->Join();
  }
  UnixRelay(const UnixRelay&) = delete;
  UnixRelay& operator=(const UnixRelay&) = delete;

  // Ends every connection relayed so far on the client's side at once. With
  // `server_notices` false the server's side stays open and what it sends is read and dropped,
  // as when the server has not noticed the break yet.
  void Cut(bool server_notices) {
    std::lock_guard lock(mu_);
    // Every pair is told first: the client closes its other connections as soon as it sees the
    // first one end, and a pair not yet told would pass that close on to the server.
    for (const auto& pair : pairs_) {
      pair->keep_server_side.store(!server_notices);
      pair->cut.store(true);
    }
    for (const auto& pair : pairs_) {
      ::shutdown(pair->client, SHUT_RDWR);
      if (server_notices) ::shutdown(pair->server, SHUT_RDWR);
    }
  }
  size_t connections() const {
    std::lock_guard lock(mu_);
    return accepted_;
  }

 private:
  struct Pair {
    int client = -1;
    int server = -1;
    std::atomic<bool> cut{false};
    std::atomic<bool> keep_server_side{false};
    std::thread upstream;    // client -> server
    std::thread downstream;  // server -> client
    void Join() {
      if (upstream.joinable()) upstream.join();
      if (downstream.joinable()) downstream.join();
      ::close(client);
      ::close(server);
    }
  };

  static sockaddr_un Address(const std::filesystem::path& path) {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    return address;
  }

  void AcceptLoop() {
    while (!stopping_.load()) {
      pollfd ready{listener_, POLLIN, 0};
      if (::poll(&ready, 1, 100) <= 0) continue;
      const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) continue;
      const int server = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const sockaddr_un address = Address(server_);
      if (server < 0 ||
          ::connect(server, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
        ::close(client);
        if (server >= 0) ::close(server);
        continue;
      }
      auto pair = std::make_shared<Pair>();
      pair->client = client;
      pair->server = server;
      pair->upstream = std::thread([pair] {
        Pump(pair->client, pair->server, [&] { return false; });
        // The client's side ended: pass that on, unless the server is not to notice.
        if (!pair->keep_server_side.load()) ::shutdown(pair->server, SHUT_WR);
      });
      pair->downstream = std::thread([pair] {
        Pump(pair->server, pair->client, [&] { return pair->keep_server_side.load(); });
        ::shutdown(pair->client, SHUT_WR);
      });
      std::lock_guard lock(mu_);
      pairs_.push_back(std::move(pair));
      ++accepted_;
    }
  }

  // Copies `from` to `to` until `from` ends; when writing fails, goes on reading (and dropping)
  // while `drop_after_failed_write` says so.
  template <typename KeepReading>
  static void Pump(int from, int to, KeepReading drop_after_failed_write) {
    std::vector<char> buffer(256 << 10);
    bool writable = true;
    for (;;) {
      const ssize_t got = ::read(from, buffer.data(), buffer.size());
      if (got <= 0) return;
      for (ssize_t sent = 0; writable && sent < got;) {
        const ssize_t n =
            ::send(to, buffer.data() + sent, static_cast<size_t>(got - sent), MSG_NOSIGNAL);
        if (n <= 0) {
          writable = false;
          break;
        }
        sent += n;
      }
      if (!writable && !drop_after_failed_write()) return;
    }
  }

  const std::filesystem::path server_;
  int listener_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Pair>> pairs_;
  size_t accepted_ = 0;
};

}  // namespace gpulazy::testing
