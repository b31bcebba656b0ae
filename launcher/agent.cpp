#include "agent.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <thread>

#include "core/build_info.h"
#include "core/error.h"
#include "core/net.h"
#include "core/worker_contract.h"
#include "failure.h"
#include "fingerprint.h"
#include "grace.h"
#include "rendezvous.h"
#include "signals.h"
#include "supervisor.h"
#include "worker_env.h"

namespace ft::launcher {

using Clock = std::chrono::steady_clock;

namespace {

std::string hostname() {
  char buf[256] = {0};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

int cpu_cores() {
  long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

// The cores this launcher may run on (its affinity: taskset, cgroups, a scheduler's binding).
std::vector<int> allowed_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (::sched_getaffinity(0, sizeof set, &set) != 0) {
    for (int c = 0; c < cpu_cores(); ++c) out.push_back(c);
    return out;
  }
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

// What one look at a round found (torchelastic's WorkerState): it goes on, or how it ended.
enum class RoundState {
  kRunning,    // nothing has ended it yet
  kSucceeded,  // every worker of every node exited 0
  kFailed,     // the agent's failure_ says why: this node's record or another launcher's
  kStopped,    // this launcher received a terminating signal (stop_signal_)
  kPreempted,  // a terminating signal reached this launcher (kStopped, or while it stopped the
               // workers) and every local worker exited with kExitPreempted (checkpoint written)
};

// A counter another process bumps while it lives (a launcher's heartbeat, a rank's progress), and
// when this launcher last saw it move, on its own clock.
struct Liveness {
  int64_t seen;
  Clock::time_point changed;
  // Takes the counter's value now; true when it has not moved for `timeout`.
  bool stalled(int64_t value, std::chrono::duration<double> timeout) {
    if (value != seen) {
      seen = value;
      changed = Clock::now();
      return false;
    }
    return Clock::now() - changed > timeout;
  }
  // Seconds since this launcher saw the counter move.
  double silent_s() const { return std::chrono::duration<double>(Clock::now() - changed).count(); }
};

// Node ranks 0..nnodes-1.
std::vector<int> node_ranks(int nnodes) {
  std::vector<int> v(nnodes);
  for (int n = 0; n < nnodes; ++n) v[n] = n;
  return v;
}

// How often a watcher with a timeout looks: four times per timeout, at least once a second.
Clock::duration quarter_of(double timeout_s) {
  return std::chrono::duration_cast<Clock::duration>(
      std::min(std::chrono::duration<double>(timeout_s) / 4, std::chrono::duration<double>(1.0)));
}

// A started round on this node as the watchers see it: its layout and workers, and what they
// last saw. Made once the workers have started, so the watchers' clocks start with them.
struct Round {
  Round(const RoundResult& rr, const JobLayout& layout, WorkerGroup& group, const LaunchConfig& cfg)
      : rr(rr),
        layout(layout),
        group(group),
        interval(std::max<int64_t>(1, static_cast<int64_t>(cfg.monitor_interval_s * 1000))),
        hb_every(std::chrono::duration_cast<Clock::duration>(
            std::min(std::chrono::duration<double>(cfg.heartbeat_timeout_s) / 8,
                     std::chrono::duration<double>(0.5)))),
        heartbeats(layout.nnodes, Liveness{-1, Clock::now()}),
        hb_next(Clock::now()),
        hang_every(quarter_of(cfg.hang_timeout_s)),
        progress(cfg.nproc_per_node, Liveness{0, Clock::now()}),
        hang_next(Clock::now()) {}
  const RoundResult& rr;
  const JobLayout& layout;
  WorkerGroup& group;
  const std::chrono::milliseconds interval;  // --monitor-interval: how long one poll waits
  // Heartbeats: this launcher bumps its counter and reads the others' 8 times per
  // --heartbeat-timeout (at least every 0.5 s). A peer's last beat happened up to one read before
  // this launcher saw it, and the silence is seen at the next read after it passed: a peer is lost
  // once it has been silent for the timeout less those two reads (and two monitor intervals), so
  // it is declared lost within --heartbeat-timeout of its last beat. Indexed by node rank.
  const Clock::duration hb_every;
  std::vector<Liveness> heartbeats;
  Clock::time_point hb_next;
  // Progress the local workers report (contract::progress_key), for --hang-timeout. Indexed by
  // local rank.
  const Clock::duration hang_every;
  std::vector<Liveness> progress;
  Clock::time_point hang_next;
  bool marked_done = false;  // this node's workers all exited 0, counted in "done"
  // When a local worker failed only by losing its connection to another rank (follows_peer_loss):
  // the round waits up to `peer_loss_wait` from then for the cause to show itself elsewhere.
  std::optional<Clock::time_point> peer_loss_seen;
  std::optional<WorkerExit> peer_loss_worker;
  // How long stopping the workers waits before SIGKILL, decided (and told) when a signal arrives.
  std::optional<StopWait> stop_wait;
};

class Agent {
 public:
  Agent(const LaunchConfig& cfg, const BuildInfo& node) : cfg_(cfg), node_(node) {
    // Refused before joining the job: the same cores every round.
    if (cfg_.bind_cores) cores_ = core_shares(allowed_cores(), cfg_.nproc_per_node);
  }
  int run();
  // Rounds until the job ends, on the store open() connects to; `restarts` carries over when
  // the store is lost and found again (`reconnect`). BackendError when the store goes away.
  int run_rounds(int& restarts, bool reconnect);

 private:
  void log(const std::string& msg) const;
  JobLayout round_layout(const RoundResult& rr) const;
  std::vector<WorkerSpec> worker_specs(const JobLayout& layout) const;
  RoundState run_round(const RoundResult& rr);
  RoundState supervise(Round& r);
  RoundState monitor(Round& r);
  // The watchers, in the order monitor() runs them: each returns kRunning or how the round ended.
  RoundState watch_progress(Round& r);
  RoundState watch_heartbeats(Round& r);
  RoundState watch_signals(Round& r);
  RoundState watch_workers(Round& r);
  RoundState watch_joining_node(Round& r);
  RoundState watch_published_failure(Round& r);
  RoundState watch_completion(Round& r);
  int hung_local_rank(Round& r);
  int silent_node(Round& r);
  double peer_loss_wait_s(const Round& r) const;
  RoundState fail(const Round& r, const Failure& failure);
  std::vector<RankEstimate> read_estimates(const Round& r);
  void stop_workers(Round& r, RoundState state);
  bool kill_now(Round& r);
  void publish_failure(int round, const Failure& failure);
  void print_summary(const Failure& failure) const;
  void mark_stopped(int round);
  // After a round that did not succeed.
  bool starts_new_round(int& restarts);
  int exit_after_failure(const RoundResult& rr, RoundState state);
  int finish_job(const RoundResult& rr);

  LaunchConfig cfg_;
  std::vector<std::vector<int>> cores_;  // --bind-cores: each local rank's cores (empty: none)
  BuildInfo node_;
  SignalPipe signals_;
  std::unique_ptr<Rendezvous> rdzv_;
  int node_rank_ = -1;
  int stop_signal_ = 0;
  bool kill_now_ = false;  // a terminating signal came while the workers were being stopped
  double last_wait_s_ = kMinTermGrace;  // the wait of the last stop, for the other nodes' stops
  Failure failure_;  // the last round's first failure, as published (ours if the store is gone)
};

void Agent::log(const std::string& msg) const {
  std::string prefix = node_rank_ >= 0 ? fmt::format("[ft node {}] ", node_rank_) : "[ft] ";
  std::string line = prefix + msg + "\n";
  (void)!::write(2, line.data(), line.size());
}

void Agent::publish_failure(int round, const Failure& failure) {
  try {
    const std::string stored =
        rdzv_->store().set_if_absent(Rendezvous::key(round, "failure"), failure.to_json());
    failure_ = Failure::from_json(stored);
  } catch (const BackendError&) {
    failure_ = failure;  // store gone: our own failure is the root cause we know of
  }
}

// Publishes `failure` (the first one published wins) and ends the round with it.
RoundState Agent::fail(const Round& r, const Failure& failure) {
  publish_failure(r.rr.round, failure);
  return RoundState::kFailed;
}

void Agent::print_summary(const Failure& failure) const { log(summary_text(failure)); }

// The job's layout in round `rr`, as this node's workers see it.
JobLayout Agent::round_layout(const RoundResult& rr) const {
  JobLayout layout;
  layout.node_rank = rr.my_node_rank;
  layout.nnodes = rr.nnodes;
  layout.nproc_per_node = cfg_.nproc_per_node;
  layout.master_addr = cfg_.rdzv_host;
  layout.master_port = rdzv_->port();
  layout.restart_count = rr.round;
  layout.max_restarts = cfg_.max_restarts;
  layout.run_id = cfg_.rdzv_id;
  layout.role = cfg_.role;
  layout.cpu_cores = cpu_cores();
  layout.bound_cores = cores_;
  return layout;
}

// This node's workers in `layout`: program, environment, output prefix, --log-dir file.
std::vector<WorkerSpec> Agent::worker_specs(const JobLayout& layout) const {
  std::string log_dir;
  if (!cfg_.log_dir.empty()) {
    log_dir = fmt::format("{}/attempt_{}", cfg_.log_dir, layout.restart_count);
    std::error_code ec;
    std::filesystem::create_directories(log_dir, ec);
    FT_CHECK(!ec, "cannot create --log-dir folder ", log_dir, ": ", ec.message());
  }
  EnvMap base = current_environment();
  // A restart round tells its workers what ended the previous one (ft train records it in
  // events.jsonl for `ft report`'s timeline); the name is train/run_events.h's kPreviousFailureEnv.
  if (layout.restart_count > 0 && failure_.node_rank >= 0)
    base["FT_PREVIOUS_FAILURE"] = failure_.to_json();
  std::vector<WorkerSpec> specs;
  for (int lr = 0; lr < cfg_.nproc_per_node; ++lr) {
    WorkerSpec s;
    s.local_rank = lr;
    s.global_rank = layout.global_rank(lr);
    s.argv = cfg_.program;
    s.env = to_envp(worker_environment(base, layout, lr));
    s.prefix = fmt::format("[node {} rank {}] ", layout.node_rank, s.global_rank);
    if (lr < static_cast<int>(layout.bound_cores.size())) s.cpus = layout.bound_cores[lr];
    if (!log_dir.empty())
      s.log_path = fmt::format("{}/node{}.rank{}.log", log_dir, layout.node_rank, s.global_rank);
    specs.push_back(std::move(s));
  }
  return specs;
}

// Starts this node's workers of round `rr`, watches them until the round ends, stops them.
RoundState Agent::run_round(const RoundResult& rr) {
  const JobLayout layout = round_layout(rr);
  WorkerGroup group(worker_specs(layout));
  log(fmt::format(
      "round {}: {} node(s) x {} worker(s), world size {}, store {}:{}; starting ranks "
      "{}..{}",
      rr.round, layout.nnodes, layout.nproc_per_node, layout.world_size(), layout.master_addr,
      layout.master_port, layout.global_rank(0), layout.global_rank(layout.nproc_per_node - 1)));
  if (!layout.bound_cores.empty()) {
    std::vector<std::string> where;
    for (int lr = 0; lr < layout.nproc_per_node; ++lr)
      where.push_back(fmt::format("rank {} on {}", layout.global_rank(lr),
                                  cpu_list_text(layout.bound_cores[lr])));
    log(fmt::format("cores (--bind-cores): {}", fmt::join(where, ", ")));
  }
  try {
    group.spawn();
  } catch (const ConfigError& e) {
    // Not restartable: the same program would fail the same way. Every node stops and says why.
    publish_failure(rr.round,
                    make_failure(FailureKind::kError, node_rank_, hostname(),
                                 fmt::format("could not start its workers: {}", e.what())));
    print_summary(failure_);
    group.stop(0);
    mark_stopped(rr.round);
    return RoundState::kFailed;
  }
  Round r(rr, layout, group, cfg_);
  RoundState state = supervise(r);
  // A failure or a signal is told at once: stopping the workers may take --term-grace.
  if (state == RoundState::kFailed || state == RoundState::kStopped) print_summary(failure_);
  if (state != RoundState::kSucceeded) stop_workers(r, state);
  // Preempted also when this launcher's own signal came while it was already stopping the workers
  // for another node's: a scheduler (SLURM's scancel, a time limit) signals every node at once, and
  // whichever launcher hears of another's first must still say "checkpointed" (75), not 143.
  if ((state == RoundState::kStopped || stop_signal_) && group.all_exited_with(kExitPreempted))
    state = RoundState::kPreempted;
  mark_stopped(rr.round);
  return state;
}

// Monitors the round until something ends it. When the store host is gone, stops the workers
// gracefully before passing the error on.
RoundState Agent::supervise(Round& r) {
  try {
    for (;;) {
      const RoundState state = monitor(r);
      if (state != RoundState::kRunning) return state;
    }
  } catch (const BackendError&) {
    // Without the store the ranks cannot commit a checkpoint together: no reason to wait long.
    log("lost the rendezvous store; stopping this node's workers");
    r.group.stop(cfg_.term_grace_s.value_or(kMinTermGrace));
    throw;
  }
}

// One look at the round (torchelastic's _monitor_workers): the watchers in a fixed order; the first
// that sees the round end decides. watch_signals is where the loop waits.
RoundState Agent::monitor(Round& r) {
  for (auto watch : {&Agent::watch_progress, &Agent::watch_heartbeats, &Agent::watch_signals,
                     &Agent::watch_workers, &Agent::watch_joining_node,
                     &Agent::watch_published_failure, &Agent::watch_completion}) {
    const RoundState state = (this->*watch)(r);
    if (state != RoundState::kRunning) return state;
  }
  return RoundState::kRunning;
}

// --hang-timeout: a rank whose progress counter has not moved for that long, after it moved at
// least once, has hung.
RoundState Agent::watch_progress(Round& r) {
  if (cfg_.hang_timeout_s <= 0 || Clock::now() < r.hang_next) return RoundState::kRunning;
  r.hang_next = Clock::now() + r.hang_every;
  const int hung = hung_local_rank(r);
  if (hung < 0) return RoundState::kRunning;
  const int rank = r.layout.global_rank(hung);
  log(
      fmt::format("rank {} reported no progress for {:.1f} s (--hang-timeout): stopping the "
                  "job to restart it",
                  rank, cfg_.hang_timeout_s));
  return fail(r, make_failure(FailureKind::kHang, node_rank_, hostname(),
                              fmt::format("rank {} hung: no progress for {:.1f} s after {} "
                                          "reports (--hang-timeout)",
                                          rank, cfg_.hang_timeout_s, r.progress[hung].seen)));
}

// Reads every local rank's progress counter; the first local rank that hangs, or -1.
int Agent::hung_local_rank(Round& r) {
  const auto timeout = std::chrono::duration<double>(cfg_.hang_timeout_s);
  for (int lr = 0; lr < cfg_.nproc_per_node; ++lr) {
    const int64_t v =
        rdzv_->store().add(contract::full_progress_key(r.rr.round, r.layout.global_rank(lr)), 0);
    if (r.progress[lr].stalled(v, timeout) && v > 0) return lr;
  }
  return -1;
}

// --heartbeat-timeout, with more than one node: bumps this launcher's counter; a node whose
// counter has not moved for that long is lost.
RoundState Agent::watch_heartbeats(Round& r) {
  if (r.layout.nnodes <= 1 || Clock::now() < r.hb_next) return RoundState::kRunning;
  r.hb_next = Clock::now() + r.hb_every;
  rdzv_->store().add(Rendezvous::key(r.rr.round, fmt::format("hb/{}", node_rank_)), 1);
  const int lost = silent_node(r);
  if (lost < 0) return RoundState::kRunning;
  const std::string& host = r.rr.members[lost].fp.hostname;
  const double silent = r.heartbeats[lost].silent_s();
  // A local worker that lost its connection meanwhile failed because of this node, not of its own.
  const std::string consequence =
      r.peer_loss_worker
          ? fmt::format("; rank {} on node {} then lost its connection to it ({})",
                        r.peer_loss_worker->global_rank, node_rank_, r.peer_loss_worker->describe())
          : "";
  log(
      fmt::format("node {} ({}) sent no heartbeat for {:.1f} s (--heartbeat-timeout {:.1f}): "
                  "stopping this node's workers for a new round",
                  lost, host, silent, cfg_.heartbeat_timeout_s));
  return fail(r, make_failure(FailureKind::kNode, lost, host,
                              fmt::format("was lost: it sent no heartbeat for {:.1f} s "
                                          "(--heartbeat-timeout {:.1f}); its launcher died or the "
                                          "machine is unreachable; restart it with the same "
                                          "command{}",
                                          silent, cfg_.heartbeat_timeout_s, consequence)));
}

// Reads the other nodes' heartbeat counters; the first node rank that went silent, or -1.
int Agent::silent_node(Round& r) {
  const double slack =
      2 * std::chrono::duration<double>(r.hb_every).count() + 2 * cfg_.monitor_interval_s;
  const auto timeout = std::chrono::duration<double>(
      std::max(cfg_.heartbeat_timeout_s - slack, cfg_.heartbeat_timeout_s / 2));
  for (int n = 0; n < r.layout.nnodes; ++n) {
    if (n == node_rank_) continue;
    const int64_t v = rdzv_->store().add(Rendezvous::key(r.rr.round, fmt::format("hb/{}", n)), 0);
    if (r.heartbeats[n].stalled(v, timeout)) return n;
  }
  return -1;
}

// Waits up to --monitor-interval for worker output and exits (pumped and reaped meanwhile) or a
// signal. Every signal is forwarded to the workers; the first terminating one stops the round.
RoundState Agent::watch_signals(Round& r) {
  if (!r.group.poll(r.interval, signals_.fd())) return RoundState::kRunning;
  for (int sig : signals_.drain()) {
    r.group.signal_all(sig);  // forward first, so workers see exactly what we saw
    if (SignalPipe::terminates(sig) && !stop_signal_) {
      stop_signal_ = sig;
      r.stop_wait = stop_wait(cfg_.term_grace_s, read_estimates(r), /*checkpointing=*/true);
      log(fmt::format(
          "received {}: stopping this node's workers; {}; send it again to stop at once",
          signal_name(sig), stop_wait_text(*r.stop_wait)));
      if (r.stop_wait->too_short()) log(too_short_text(*r.stop_wait));
      publish_failure(r.rr.round,
                      make_failure(FailureKind::kSignal, node_rank_, hostname(),
                                   fmt::format("launcher received {}", signal_name(sig))));
    }
  }
  return stop_signal_ ? RoundState::kStopped : RoundState::kRunning;
}

// A local worker that exited non-zero or was killed fails the round. One that only lost its
// connection to another rank (follows_peer_loss) is the consequence of a failure elsewhere: a local
// worker's own failure, another node's record (watch_published_failure) or a node that went
// silent (watch_heartbeats) is given peer_loss_wait_s() to show itself and is blamed instead.
RoundState Agent::watch_workers(Round& r) {
  const std::vector<WorkerExit>& failed = r.group.failures();
  if (failed.empty()) return RoundState::kRunning;
  for (const WorkerExit& w : failed)
    if (!follows_peer_loss(w))
      return fail(r, make_failure(FailureKind::kWorker, node_rank_, hostname(), w.describe(), w));
  const WorkerExit& first = failed.front();
  const double wait_s = peer_loss_wait_s(r);
  if (!r.peer_loss_seen) {
    r.peer_loss_seen = Clock::now();
    r.peer_loss_worker = first;
    log(
        fmt::format("rank {} lost its connection to another rank ({}); waiting up to {:.1f} s to "
                    "learn which rank or node failed first",
                    first.global_rank, first.describe(), wait_s));
  }
  if (Clock::now() - *r.peer_loss_seen < std::chrono::duration<double>(wait_s))
    return RoundState::kRunning;
  return fail(r, make_failure(FailureKind::kWorker, node_rank_, hostname(),
                              fmt::format("{}: it lost its connection to another rank, and no "
                                          "other failure showed within {:.1f} s (a network "
                                          "fault between the nodes?)",
                                          first.describe(), wait_s),
                              first));
}

// How long a peer-loss failure waits for its cause: a local worker's failure is reaped within a
// couple of monitor intervals; another node's record within one; a dead node's silence within
// --heartbeat-timeout of its last beat, seen at the next heartbeat read.
double Agent::peer_loss_wait_s(const Round& r) const {
  const double local = std::max(2.0, 4 * cfg_.monitor_interval_s);
  if (r.layout.nnodes <= 1) return local;
  return cfg_.heartbeat_timeout_s + std::chrono::duration<double>(r.hb_every).count() + local;
}

// Below --nnodes MAX, a launcher waiting to join makes the host start a new round with it. Not once
// the job is ending (a node's workers all finished): it completes as it is, and the waiting
// launcher is told so (Rendezvous::finish).
RoundState Agent::watch_joining_node(Round& r) {
  RdzvStore& store = rdzv_->store();
  if (!rdzv_->is_host() || r.layout.nnodes >= cfg_.max_nodes || r.marked_done ||
      store.add(Rendezvous::key(r.rr.round, "done"), 0) != 0 ||
      store.add(Rendezvous::key(r.rr.round + 1, "joined"), 0) <= 0)
    return RoundState::kRunning;
  return fail(r, make_failure(FailureKind::kRejoin, node_rank_, hostname(),
                              "a node is waiting to join: starting a new round with it (workers "
                              "checkpoint on SIGTERM)"));
}

// Another launcher published the round's failure.
RoundState Agent::watch_published_failure(Round& r) {
  const auto remote = rdzv_->store().try_get(Rendezvous::key(r.rr.round, "failure"));
  if (!remote) return RoundState::kRunning;
  failure_ = Failure::from_json(*remote);
  return RoundState::kFailed;
}

// The round succeeds when every node has counted its workers' success in "done".
RoundState Agent::watch_completion(Round& r) {
  RdzvStore& store = rdzv_->store();
  if (!r.marked_done && r.group.all_succeeded()) {
    store.add(Rendezvous::key(r.rr.round, "done"), 1);
    r.marked_done = true;
    if (r.layout.nnodes > 1) log("all local workers finished; waiting for the other nodes");
  }
  if (r.marked_done && store.add(Rendezvous::key(r.rr.round, "done"), 0) >= r.layout.nnodes)
    return RoundState::kSucceeded;
  return RoundState::kRunning;
}

// The StopEstimates of this node's ranks and of rank 0 (which alone knows of a checkpoint it
// committed in the background), as published; none from programs that publish none or when the
// store is gone.
std::vector<RankEstimate> Agent::read_estimates(const Round& r) {
  std::vector<int> ranks;
  for (int lr = 0; lr < cfg_.nproc_per_node; ++lr) ranks.push_back(r.layout.global_rank(lr));
  if (ranks.front() != 0) ranks.push_back(0);
  std::vector<RankEstimate> out;
  try {
    for (int rank : ranks) {
      const auto text = rdzv_->store().try_get(contract::full_stop_estimate_key(r.rr.round, rank));
      if (!text) continue;
      if (auto e = contract::parse_stop_estimate(*text)) out.push_back({rank, *e});
    }
  } catch (const BackendError&) {
  }
  return out;
}

// Stops the round's workers: SIGTERM, then SIGKILL after the wait grace.h sets (a second signal
// cuts it short). When the workers were to checkpoint (a signal, a node joining) the wait covers
// what they said finishing a step and a checkpoint takes, and a kill says what it lost.
void Agent::stop_workers(Round& r, RoundState state) {
  const bool checkpointing = state == RoundState::kStopped ||
                             failure_.kind == FailureKind::kSignal ||
                             failure_.kind == FailureKind::kRejoin;
  if (!r.stop_wait) {
    r.stop_wait =
        stop_wait(cfg_.term_grace_s,
                  checkpointing ? read_estimates(r) : std::vector<RankEstimate>{}, checkpointing);
    if (checkpointing && r.stop_wait->known) {
      log(fmt::format("stopping this node's workers for a checkpoint; {}",
                      stop_wait_text(*r.stop_wait)));
      if (r.stop_wait->too_short()) log(too_short_text(*r.stop_wait));
    }
  }
  last_wait_s_ = r.stop_wait->seconds;
  kill_now_ = false;
  const std::vector<int> killed = r.group.stop(r.stop_wait->seconds, [&] { return kill_now(r); });
  if (killed.empty()) return;
  const std::vector<RankEstimate> now =
      checkpointing ? read_estimates(r) : std::vector<RankEstimate>{};
  StopWait told = *r.stop_wait;
  if (!checkpointing) told.known = false;  // a failure: no checkpoint was coming
  log(lost_text(told, killed, now, kill_now_));
}

// While the workers stop: a terminating signal stops the job (no restart) and, once one has,
// another ends the wait at once; other signals are forwarded.
bool Agent::kill_now(Round& r) {
  for (int sig : signals_.drain()) {
    if (!SignalPipe::terminates(sig)) {
      r.group.signal_all(sig);
    } else if (!stop_signal_) {
      stop_signal_ = sig;
      log(
          fmt::format("received {} while stopping the workers: the job will not go on; send it "
                      "again to stop at once",
                      signal_name(sig)));
    } else if (!kill_now_) {
      kill_now_ = true;
      log(fmt::format("received {} again: killing this node's workers now", signal_name(sig)));
    }
  }
  return kill_now_;
}

void Agent::mark_stopped(int round) {
  // The host may already be gone after a failure (it waits only so long): that is not an error of
  // ours.
  try {
    rdzv_->mark_stopped(round, node_rank_);
  } catch (const BackendError&) {
  }
}

int Agent::run() {
  const BuildInfo& bi = node_;
  Fingerprint fp;
  fp.hostname = hostname();
  fp.addr = cfg_.advertise_addr.empty() ? ft::local_addr_towards(cfg_.rdzv_host, cfg_.rdzv_port)
                                        : cfg_.advertise_addr;
  if (fp.addr.empty()) fp.addr = fp.hostname;
  fp.node_rank = cfg_.node_rank.value_or(-1);
  fp.rdzv_id = cfg_.rdzv_id;
  fp.nnodes = cfg_.min_nodes == cfg_.max_nodes
                  ? std::to_string(cfg_.max_nodes)
                  : fmt::format("{}:{}", cfg_.min_nodes, cfg_.max_nodes);
  fp.nproc = cfg_.nproc_per_node;
  fp.max_restarts = cfg_.max_restarts;
  fp.ft_version = bi.ft_version;
  fp.ft_commit = bi.git_commit;
  fp.torch_version = bi.torch_version;
  fp.cuda_version = bi.cuda_version;
  fp.nccl_version = bi.nccl_version;
  fp.gpu_name = bi.gpu_name;
  fp.gpu_count = bi.cuda_devices;
  fp.program_hash = hash_program(cfg_.program);

  bool interrupted = false;
  rdzv_ = std::make_unique<Rendezvous>(
      cfg_, fp,
      [&] {
        for (int s : signals_.drain())
          if (SignalPipe::terminates(s)) {
            stop_signal_ = s;
            interrupted = true;
          }
        return interrupted;
      },
      [this](const std::string& msg) { log(msg); });

  if (cfg_.node_rank.value_or(-1) == 0 && cfg_.max_nodes > 1 && !is_local_host(cfg_.rdzv_host)) {
    log(
        fmt::format("warning: this node is node_rank 0 and hosts the rendezvous store, but "
                    "--master-addr {} is not an address of this machine; the other nodes will look "
                    "for the store there. Run node_rank 0 on {} or fix --master-addr",
                    cfg_.rdzv_host, cfg_.rdzv_host));
  }
  int restarts = 0;  // failures restarted so far (a node joining is not a failure)
  for (bool reconnect = false;; reconnect = true) {
    try {
      return run_rounds(restarts, reconnect);
    } catch (const BackendError& e) {
      // Node 0 (the store host) is gone. The others wait for it to be started again: it hosts a
      // fresh store and the job resumes from its latest checkpoint.
      if (rdzv_->is_host() || stop_signal_) {
        log(fmt::format("error: lost the rendezvous store: {}", e.what()));
        return stop_signal_ ? 128 + stop_signal_ : kExitStoreLost;
      }
      log(
          fmt::format("lost the rendezvous store (node 0's launcher exited or was killed?): "
                      "waiting up to {:.0f} s (--rdzv-timeout) for it to come back",
                      cfg_.rdzv_timeout_s));
    }
  }
}

int Agent::run_rounds(int& restarts, bool reconnect) {
  try {
    rdzv_->open();
    if (rdzv_->is_host())
      log(fmt::format("hosting the rendezvous store on port {}", rdzv_->port()));
    const int first = rdzv_->first_round();
    if (first > 0)
      log(
          fmt::format("the job is running; joining it at round {} (a restart from its latest "
                      "checkpoint)",
                      first));
    if (reconnect) log("the rendezvous store is back; joining the restarted job");
    for (int round = first;; ++round) {
      RoundResult rr = rdzv_->join(round);
      node_rank_ = rr.my_node_rank;
      const RoundState state = run_round(rr);
      if (state == RoundState::kSucceeded) return finish_job(rr);
      if (!starts_new_round(restarts)) return exit_after_failure(rr, state);
    }
  } catch (const JobFinished& e) {
    log(e.what());
    return kExitOk;
  } catch (const RendezvousError& e) {
    if (stop_signal_) {
      log(fmt::format("stopped by {} during rendezvous", signal_name(stop_signal_)));
      return 128 + stop_signal_;
    }
    if (reconnect && dynamic_cast<const RendezvousTimeout*>(&e)) {
      log(fmt::format("error: the rendezvous store did not come back: {}", e.what()));
      return kExitStoreLost;
    }
    log(fmt::format("error: {}", e.what()));
    return kExitRendezvous;
  }
}

// Every node's workers finished. The host keeps the store up until every launcher has stopped and
// tells launchers already waiting to join that the job is over.
int Agent::finish_job(const RoundResult& rr) {
  if (rdzv_->is_host()) {
    rdzv_->wait_stopped(rr.round, node_ranks(rr.nnodes), 30.0);
    rdzv_->finish(rr.round);
  }
  log("job finished successfully");
  return kExitOk;
}

// Whether the job goes on after a round ended by failure_ (torchelastic's _invoke_run dispatch):
// a node joining takes a new round and no restart; a restartable failure takes one while any are
// left and no signal stopped this launcher.
bool Agent::starts_new_round(int& restarts) {
  switch (failure_.kind) {
    case FailureKind::kRejoin:
      return !stop_signal_;
    case FailureKind::kWorker:
    case FailureKind::kNode:
    case FailureKind::kHang:
      if (stop_signal_ || restarts >= cfg_.max_restarts) return false;
      ++restarts;
      log(fmt::format("restarting the job: attempt {} of {} restarts", restarts,
                      cfg_.max_restarts));
      return true;
    case FailureKind::kSignal:
    case FailureKind::kError:
      return false;
  }
  return false;
}

// The job ends after round `rr`, which ended in `state`: the launcher's exit code.
int Agent::exit_after_failure(const RoundResult& rr, RoundState state) {
  // Keep the store up while the other nodes read the failure and stop their workers.
  // A node known to be lost never reports: not waited for.
  if (rdzv_->is_host()) {
    std::vector<int> nodes = node_ranks(rr.nnodes);
    if (failure_.kind == FailureKind::kNode)
      nodes.erase(std::remove(nodes.begin(), nodes.end(), failure_.node_rank), nodes.end());
    rdzv_->wait_stopped(rr.round, nodes, last_wait_s_ + 5.0);
  }
  if (state == RoundState::kPreempted) {
    log(
        fmt::format("every worker saved a checkpoint after {}; run the same command again to "
                    "continue (exit {})",
                    signal_name(stop_signal_), kExitPreempted));
    return kExitPreempted;
  }
  if (stop_signal_) return 128 + stop_signal_;
  if (restartable(failure_.kind) && cfg_.max_restarts > 0)
    log(fmt::format("no restarts left ({} used)", cfg_.max_restarts));
  return kExitWorkerFailed;
}

}  // namespace

int run_launch(const LaunchConfig& cfg, const BuildInfo& node) {
  Agent agent(cfg, node);
  return agent.run();
}

std::string dry_run_text(const LaunchConfig& cfg) {
  std::string s = "ft launch --dry-run: resolved settings\n";
  for (const auto& spec : launch_option_specs()) {
    const auto& r = cfg.sources.at(spec.name);
    s += fmt::format("  {:<18} {:<22} ({})\n", spec.name, r.value.empty() ? "<unset>" : r.value,
                     r.source);
  }
  JobLayout l;
  l.node_rank = cfg.node_rank.value_or(0);
  l.nnodes = cfg.max_nodes;
  l.nproc_per_node = cfg.nproc_per_node;
  l.master_addr = cfg.rdzv_host;
  l.master_port = cfg.rdzv_port;
  l.max_restarts = cfg.max_restarts;
  l.run_id = cfg.rdzv_id;
  l.role = cfg.role;
  l.cpu_cores = cpu_cores();
  if (cfg.bind_cores) l.bound_cores = core_shares(allowed_cores(), cfg.nproc_per_node);
  s += fmt::format(
      "layout: {} node(s) x {} worker(s) = world size {}; this node: {}; ranks {}..{}\n",
      cfg.min_nodes == cfg.max_nodes ? std::to_string(cfg.max_nodes)
                                     : fmt::format("{}:{}", cfg.min_nodes, cfg.max_nodes),
      cfg.nproc_per_node, l.world_size(),
      cfg.node_rank ? fmt::format("node_rank {}", *cfg.node_rank)
                    : std::string("node_rank assigned at join (shown as 0)"),
      l.global_rank(0), l.global_rank(cfg.nproc_per_node - 1));
  s += fmt::format("rendezvous store: {}:{} (hosted by node_rank 0)\n", cfg.rdzv_host,
                   cfg.rdzv_port);
  s += fmt::format("program: {}\n", fmt::join(cfg.program, " "));
  EnvMap env = worker_environment(current_environment(), l, 0);
  s += "worker environment of local rank 0:\n";
  for (const auto& k : worker_env_keys()) s += fmt::format("  {}={}\n", k, env[k]);
  return s;
}

}  // namespace ft::launcher
