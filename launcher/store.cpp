#include "store.h"

#include <fmt/format.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/error.h"

namespace ft::launcher {

struct RdzvStore::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::string endpoint;
};

namespace {
std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string str(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

bool looks_like_addr_in_use(const std::string& msg) {
  return msg.find("in use") != std::string::npos || msg.find("EADDRINUSE") != std::string::npos ||
         msg.find("errno: 98") != std::string::npos;
}

// Store operations can throw c10 errors when the peer vanished: make them BackendErrors that name
// the store, so the agent can report "lost the rendezvous store" rather than a c10 backtrace.
template <typename F>
auto guarded(const std::string& endpoint, const char* op, const std::string& key, F&& f) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw BackendError(fmt::format("rendezvous store {} unreachable during {}('{}'): {}", endpoint,
                                   op, key, e.what_without_backtrace()));
  }
}
}  // namespace

RdzvStore::RdzvStore(std::unique_ptr<Impl> impl, bool is_host)
    : impl_(std::move(impl)), is_host_(is_host) {}
RdzvStore::~RdzvStore() = default;

std::unique_ptr<RdzvStore> RdzvStore::host(uint16_t port, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = true;
  o.waitWorkers = false;
  o.numWorkers = std::nullopt;
  o.multiTenant = true;
  o.timeout = timeout;
  auto impl = std::make_unique<Impl>();
  try {
    impl->store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    if (looks_like_addr_in_use(msg))
      throw RendezvousError(fmt::format(
          "port {} is already in use on this machine, so the rendezvous store cannot start here. "
          "Stop what holds it (`ss -ltnp 'sport = :{}'`), pick another --master-port, or use "
          "--master-port 0 / --standalone on a single node",
          port, port));
    throw RendezvousError(
        fmt::format("cannot start the rendezvous store on port {}: {}", port, msg));
  }
  impl->endpoint = fmt::format("127.0.0.1:{}", impl->store->getPort());
  return std::unique_ptr<RdzvStore>(new RdzvStore(std::move(impl), true));
}

std::unique_ptr<RdzvStore> RdzvStore::connect(const std::string& host, uint16_t port,
                                              std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = timeout;
  auto impl = std::make_unique<Impl>();
  impl->endpoint = fmt::format("{}:{}", host, port);
  try {
    impl->store = c10::make_intrusive<c10d::TCPStore>(host, o);
  } catch (const c10::Error& e) {
    std::string why = e.what_without_backtrace();
    throw RendezvousTimeout(why.substr(0, why.find('\n')));
  }
  return std::unique_ptr<RdzvStore>(new RdzvStore(std::move(impl), false));
}

uint16_t RdzvStore::port() const { return impl_->store->getPort(); }

void RdzvStore::set_timeout(std::chrono::milliseconds timeout) {
  impl_->store->setTimeout(timeout);
}

void RdzvStore::set(const std::string& key, const std::string& value) {
  guarded(impl_->endpoint, "set", key, [&] {
    impl_->store->set(key, bytes(value));
    return 0;
  });
}

std::string RdzvStore::get(const std::string& key) {
  return guarded(impl_->endpoint, "get", key, [&] { return str(impl_->store->get(key)); });
}

std::optional<std::string> RdzvStore::try_get(const std::string& key) {
  if (!check(key)) return std::nullopt;
  return get(key);
}

int64_t RdzvStore::add(const std::string& key, int64_t delta) {
  return guarded(impl_->endpoint, "add", key, [&] { return impl_->store->add(key, delta); });
}

bool RdzvStore::check(const std::string& key) {
  return guarded(impl_->endpoint, "check", key, [&] { return impl_->store->check({key}); });
}

std::string RdzvStore::set_if_absent(const std::string& key, const std::string& value) {
  return guarded(impl_->endpoint, "compareSet", key,
                 [&] { return str(impl_->store->compareSet(key, {}, bytes(value))); });
}

std::vector<std::string> RdzvStore::list_keys() {
  return guarded(impl_->endpoint, "listKeys", "", [&] { return impl_->store->listKeys(); });
}

void RdzvStore::delete_key(const std::string& key) {
  guarded(impl_->endpoint, "deleteKey", key, [&] { return impl_->store->deleteKey(key); });
}

}  // namespace ft::launcher
