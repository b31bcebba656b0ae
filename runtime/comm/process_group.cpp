#include "comm/process_group.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <string_view>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/error.h"
#include "core/net.h"
#include "cuda/loader.h"

namespace ft::comm {

std::optional<std::string> peer_failure(const std::exception& e) {
  if (dynamic_cast<const PeerLostError*>(&e)) return std::string(e.what());
  if (dynamic_cast<const Error*>(&e)) return std::nullopt;  // ft's own, which says what it is
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string what = c10_error ? c10_error->what_without_backtrace() : e.what();
  if (dynamic_cast<const c10::DistError*>(&e)) return what;
  // Gloo's own exceptions (gloo::IoException and friends) are not c10 errors and its headers are
  // not installed: they are known by the transport's source path in the message, or by the socket
  // error text.
  for (std::string_view mark :
       {"/gloo/transport/", "Connection reset by peer", "Connection closed by peer", "Broken pipe"})
    if (what.find(mark) != std::string::npos) return what;
  return std::nullopt;
}

c10::intrusive_ptr<c10d::Store> connect_launcher_store(const DistEnv& env,
                                                       std::chrono::milliseconds timeout) {
  FT_CHECK(env.agent_store || env.world_size == 1,
           "ft workers attach to their launcher's store: TORCHELASTIC_USE_AGENT_STORE must be "
           "True (run under `ft launch` or torchrun)");
  c10d::TCPStoreOptions so;
  so.port = env.master_port;
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = timeout;
  try {
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    return c10::make_intrusive<c10d::PrefixStore>(worker_store_prefix(env.restart_count), tcp);
  } catch (const c10::Error& e) {
    throw BackendError(fmt::format("rank {}/{}: cannot reach the launcher's store at {}:{}: {}",
                                   env.rank, env.world_size, env.master_addr, env.master_port,
                                   e.what_without_backtrace()));
  }
}

c10::intrusive_ptr<c10d::Store> connect_job_store(const DistEnv& env,
                                                  std::chrono::milliseconds timeout) {
  FT_ASSERT(env.rank0_hosts_store(), "rank ", env.rank, ": the job's store is the launcher's");
  c10d::TCPStoreOptions so;
  so.port = env.master_port;
  so.isServer = env.rank == 0;
  so.numWorkers = env.world_size;
  so.waitWorkers = false;  // the process group's own rendezvous waits for every rank
  so.timeout = timeout;
  try {
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    return c10::make_intrusive<c10d::PrefixStore>(worker_store_prefix(env.restart_count), tcp);
  } catch (const c10::Error& e) {
    if (env.rank == 0)
      throw BackendError(fmt::format(
          "rank 0/{}: cannot host the job's store on port {} ({}:{}, {}): {}. Another job may hold "
          "the port: give every task the same free MASTER_PORT",
          env.world_size, env.master_port, env.master_addr, env.master_port, env.master_source,
          e.what_without_backtrace()));
    throw BackendError(fmt::format(
        "rank {}/{}: cannot reach the job's store at {}:{} ({}), which rank 0 hosts: {}. Is rank 0 "
        "running on that host? Set MASTER_ADDR to rank 0's host for every task",
        env.rank, env.world_size, env.master_addr, env.master_port, env.master_source,
        e.what_without_backtrace()));
  }
}

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;      // this group's store (subgroups prefix it further)
  c10::intrusive_ptr<c10d::Backend> backend;  // Gloo or NCCL
  c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> gloo_options;  // Gloo only
  ProcessGroupOptions options;
  std::string addr;
  std::vector<int> world_ranks;  // world rank of each group rank
  int rank = 0, size = 1;
  bool nccl() const { return options.device.is_cuda(); }

  // An NCCL backend for this group on its store (through the CUDA library).
  void make_nccl(const std::string& name) {
    cuda::NcclGroup g;
    g.rank = rank;
    g.size = size;
    g.device = options.device.index();
    g.timeout = options.timeout;
    g.name = name;
    for (int r : world_ranks) g.global_ranks.push_back(static_cast<uint64_t>(r));
    backend = cuda::api().make_nccl_backend(store, g);
  }
};

ProcessGroup::ProcessGroup(const DistEnv& env, const ProcessGroupOptions& opts)
    : impl_(std::make_unique<Impl>()) {
  // A peer that closes its sockets must give this rank an error to report (EPIPE), not kill it
  // silently with SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);
  impl_->rank = env.rank;
  impl_->size = env.world_size;
  const std::string endpoint = fmt::format("{}:{}", env.master_addr, env.master_port);
  try {
    if (env.agent_store) {
      impl_->store = connect_launcher_store(env, opts.timeout);
    } else if (env.launched()) {
      impl_->store = connect_job_store(env, opts.timeout);
    } else {
      impl_->store = c10::make_intrusive<c10d::HashStore>();
    }
    impl_->options = opts;
    for (int r = 0; r < env.world_size; ++r) impl_->world_ranks.push_back(r);
    if (impl_->nccl()) {
      FT_ASSERT(opts.device.has_index(), "an NCCL group needs a device index, got ", opts.device);
      impl_->make_nccl("world");
      return;
    }
    auto gopts = c10d::ProcessGroupGloo::Options::create(opts.timeout);
    impl_->gloo_options = gopts;
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      impl_->addr = ifname;
      gopts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else {
      // Bind where this machine reaches the store: right on multi-homed nodes and in containers
      // whose hostname does not resolve.
      impl_->addr =
          env.launched() ? local_addr_towards(env.master_addr, env.master_port) : "127.0.0.1";
      if (impl_->addr.empty()) impl_->addr = "127.0.0.1";
      gopts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(impl_->addr));
    }
    impl_->backend =
        c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, env.rank, env.world_size, gopts);
  } catch (const c10::Error& e) {
    throw BackendError(
        fmt::format("rank {}/{}: cannot form the {} process group through store {}: {}", env.rank,
                    env.world_size, backend_name(), endpoint, e.what_without_backtrace()));
  }
}

ProcessGroup::~ProcessGroup() {
  if (!impl_ || !impl_->backend || !impl_->nccl()) return;
  // NCCL: at a normal end flush and destroy the communicators (what destroy_process_group does);
  // while an error unwinds, abort them instead, since a peer may never join a collective in flight.
  try {
    if (std::uncaught_exceptions() > 0)
      impl_->backend->abort();
    else
      impl_->backend->shutdown();
  } catch (const std::exception&) {
    // Tearing down: the error that matters is already on its way, or the run has finished.
  }
}
int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size; }
c10d::Backend& ProcessGroup::backend() { return *impl_->backend; }
const char* ProcessGroup::backend_name() const { return impl_->nccl() ? "NCCL" : "Gloo"; }
c10d::Store& ProcessGroup::store() { return *impl_->store; }
const std::string& ProcessGroup::transport_addr() const { return impl_->addr; }

std::unique_ptr<ProcessGroup> ProcessGroup::subgroup(const std::string& name,
                                                     const std::vector<int>& ranks) {
  auto it = std::find(ranks.begin(), ranks.end(), impl_->rank);
  FT_ASSERT(it != ranks.end(), "rank ", impl_->rank, " is not a member of group ", name);
  std::unique_ptr<ProcessGroup> g(new ProcessGroup());
  g->impl_ = std::make_unique<Impl>();
  g->impl_->rank = static_cast<int>(it - ranks.begin());
  g->impl_->size = static_cast<int>(ranks.size());
  g->impl_->addr = impl_->addr;
  g->impl_->gloo_options = impl_->gloo_options;
  g->impl_->options = impl_->options;
  for (int r : ranks) g->impl_->world_ranks.push_back(impl_->world_ranks.at(r));
  g->impl_->store = c10::make_intrusive<c10d::PrefixStore>("group/" + name, impl_->store);
  try {
    if (g->impl_->nccl())
      g->impl_->make_nccl(name);
    else
      g->impl_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
          g->impl_->store, g->impl_->rank, g->impl_->size, impl_->gloo_options);
  } catch (const c10::Error& e) {
    throw BackendError(fmt::format("rank {}: cannot form the {} group '{}' of ranks [{}]: {}",
                                   impl_->rank, backend_name(), name, fmt::join(ranks, ","),
                                   e.what_without_backtrace()));
  }
  return g;
}

}  // namespace ft::comm
