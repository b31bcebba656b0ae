// Builds the c10d process group of a worker from its DistEnv: a TCPStore client on the launcher's
// store, or on the one rank 0 hosts when no launcher does (prefixed per restart round) and Gloo for
// CPU tensors, or NCCL for the tensors of this rank's GPU (opened through the CUDA room,
// cuda/loader.h). World size 1 without a launcher uses an in-process HashStore. Create once per
// process, from the main thread; collectives on the returned backend must be issued in the same
// order on every rank. NCCL runs each collective on its own stream; Work::wait() makes the calling
// thread's current stream wait for it (it does not block the CPU), so a later .item() on that
// stream sees the result.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/dist_env.h"

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace ft::comm {

// When `e` is a failure to communicate with another rank, not of this rank's own work, its text
// (without a backtrace): a c10d distributed error (the store, the network, a backend), a Gloo
// transport error (connection reset or closed, a read or write failed) or PeerLostError. Such a
// failure usually follows a peer's death; `ft train` exits with contract::kExitPeerLost for it, so
// that the launcher looks for the peer's own failure before blaming this rank.
std::optional<std::string> peer_failure(const std::exception& e);

// The launcher's store as this worker's restart round sees it: a TCPStore client on
// MASTER_ADDR:MASTER_PORT under worker_store_prefix(restart_count). Every launched ProcessGroup
// forms on it; a world-size-1 `ft train` under `ft launch`, which forms none, reports its progress
// through it. Throws BackendError naming the endpoint when the store cannot be reached.
c10::intrusive_ptr<c10d::Store> connect_launcher_store(const DistEnv& env,
                                                       std::chrono::milliseconds timeout);

// The job's store when no launcher hosts one (mpirun, srun, or RANK/WORLD_SIZE set by hand): rank
// 0 hosts a TCPStore on MASTER_PORT and every rank connects to MASTER_ADDR:MASTER_PORT, as
// torchrun's env:// does, under worker_store_prefix(restart_count). Throws BackendError naming the
// endpoint and where MASTER_ADDR came from when rank 0 cannot bind or another rank cannot connect.
c10::intrusive_ptr<c10d::Store> connect_job_store(const DistEnv& env,
                                                  std::chrono::milliseconds timeout);

struct ProcessGroupOptions {
  static constexpr std::chrono::seconds kDefaultTimeout{300};
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Where the group's tensors live: cpu -> Gloo; cuda:i -> NCCL on device i (this rank's GPU).
  c10::Device device = c10::kCPU;
};

class ProcessGroup {
 public:
  // Throws BackendError naming the store endpoint and rank when the group cannot be formed.
  ProcessGroup(const DistEnv& env, const ProcessGroupOptions& opts = {});
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;
  int rank() const;
  int size() const;
  c10d::Backend& backend();
  // The group's store (the launcher's TCPStore under this round's prefix; in-process at world size
  // 1). TCPStore clients serialise their operations, so other threads may use it too.
  c10d::Store& store();
  // "gloo" or "nccl".
  const char* backend_name() const;
  // The interface/address Gloo bound to, for messages ("" under NCCL, which picks its own).
  const std::string& transport_addr() const;

  // A group of some of this group's ranks (`ranks` lists them in group-rank order and must hold
  // rank()), on the same store under "group/<name>/" and the same backend and device. Only the
  // members call it, each with the same name and list; names must be unique per process group.
  // Collective over the members.
  std::unique_ptr<ProcessGroup> subgroup(const std::string& name, const std::vector<int>& ranks);

 private:
  ProcessGroup() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ft::comm
