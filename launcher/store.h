// The rendezvous store: a thin handle on LibTorch's c10d::TCPStore (server on the hosting launcher,
// client everywhere) with string helpers and polling waits that name what they waited for.
// Only this file pair includes c10d headers, which keeps the launcher's compile time low.
// Not thread-safe: one launcher thread uses it (c10d's server runs its own thread internally).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ft::launcher {

class RdzvStore {
 public:
  // Starts the TCPStore server on `port` (0 = a free port) and connects to it.
  // Throws RendezvousError naming the port when it is already in use.
  static std::unique_ptr<RdzvStore> host(uint16_t port, std::chrono::milliseconds timeout);
  // Connects to a server at host:port, retrying until `timeout`; throws RendezvousTimeout with
  // c10d's reason. `host` is used as given (an IP is never reverse-resolved).
  static std::unique_ptr<RdzvStore> connect(const std::string& host, uint16_t port,
                                            std::chrono::milliseconds timeout);
  ~RdzvStore();

  uint16_t port() const;
  // Timeout of later blocking store operations.
  void set_timeout(std::chrono::milliseconds timeout);
  bool is_host() const { return is_host_; }

  void set(const std::string& key, const std::string& value);
  std::string get(const std::string& key);  // key must exist
  std::optional<std::string> try_get(const std::string& key);
  int64_t add(const std::string& key, int64_t delta);
  bool check(const std::string& key);
  // Sets key to `value` only if it does not exist yet; returns the value that is now stored.
  std::string set_if_absent(const std::string& key, const std::string& value);
  std::vector<std::string> list_keys();
  void delete_key(const std::string& key);

 private:
  struct Impl;
  explicit RdzvStore(std::unique_ptr<Impl> impl, bool is_host);
  std::unique_ptr<Impl> impl_;
  bool is_host_;
};

}  // namespace ft::launcher
