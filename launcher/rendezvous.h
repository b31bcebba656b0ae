// Static (and MIN:MAX) rendezvous of launchers over c10d's TCPStore, one round per restart.
// The launcher that hosts the store coordinates each round: it waits for the nodes, checks their
// fingerprints (software, layout, program), assigns node ranks and publishes the round's result or
// the reason it was refused; every launcher then reads the same answer, so all print the same
// error. Keys live under "ft/r<round>/"; worker keys from an earlier round are purged before the
// next one starts (torch >= 2.x Python workers attach without a per-round prefix). Not thread-safe;
// used from the launcher's main thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "fingerprint.h"
#include "options.h"
#include "store.h"

namespace ft::launcher {

struct RoundMember {
  int node_rank = 0;
  Fingerprint fp;
};

struct RoundResult {
  int round = 0;
  int nnodes = 0;
  int my_node_rank = 0;
  std::vector<RoundMember> members;  // indexed by node rank
};

class Rendezvous {
 public:
  // `interrupted` is polled while waiting; returning true aborts the wait (a signal arrived).
  // `say` prints a progress line: a wait longer than a few seconds says what it waits for, every
  // few seconds.
  Rendezvous(
      const LaunchConfig& cfg, Fingerprint mine, std::function<bool()> interrupted,
      std::function<void(const std::string&)> say = [](const std::string&) {});

  // Hosts or connects to the store. The host is node rank 0, or, with ranks assigned in join
  // order, the first launcher on the endpoint's machine to bind the port.
  void open();

  // The round a launcher starting now joins: 0 on a fresh store; for a launcher (re)started into a
  // running job, the round in progress if it is still forming, else the next one (which the
  // others start when they notice the lost node, or, below --nnodes MAX, this one waiting).
  int first_round();

  // Runs round `round`; throws RendezvousError / RendezvousTimeout with a message naming nodes.
  RoundResult join(int round);

  RdzvStore& store() { return *store_; }
  bool is_host() const { return store_ && store_->is_host(); }
  uint16_t port() const { return store_->port(); }

  static std::string key(int round, const std::string& name);

  // Host only: waits until `counter` reaches `n` or `timeout_s` passes.
  bool wait_count(int round, const std::string& counter, int64_t n, double timeout_s);

  // Records that node `node_rank` has stopped its workers of round `round`.
  void mark_stopped(int round, int node_rank);
  // Host only: waits until every node rank in `nodes` has marked round `round` stopped or
  // `timeout_s` passes, naming the nodes it still waits for every few seconds. Returns whether all
  // did.
  bool wait_stopped(int round, const std::vector<int>& nodes, double timeout_s);

  // Host only, after round `round` succeeded: launchers already waiting in the next round are
  // told the job is over (their join() throws JobFinished) and given a moment to read it.
  void finish(int round);

 private:
  std::string coordinate(int round);  // host: decide membership, return the result JSON
  std::string missing_description(int round, int64_t joined);
  void purge_worker_keys();
  LaunchConfig cfg_;
  Fingerprint mine_;
  std::function<bool()> interrupted_;
  std::function<void(const std::string&)> say_;
  std::unique_ptr<RdzvStore> store_;
};

// join(): the job finished successfully while this launcher was waiting to join it.
class JobFinished : public ft::RendezvousError {
 public:
  using ft::RendezvousError::RendezvousError;
};

// True when `host` names this machine (loopback or one of its interface addresses).
bool is_local_host(const std::string& host);
// True when a TCP connection to host:port is accepted within `timeout` (then closed at once).
bool port_accepts(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);

}  // namespace ft::launcher
