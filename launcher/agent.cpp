#include "agent.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/build_info.h"
#include "core/error.h"
#include "core/net.h"
#include "core/worker_contract.h"
#include "fingerprint.h"
#include "rendezvous.h"
#include "signals.h"
#include "supervisor.h"
#include "worker_env.h"

namespace ft::launcher {

using nlohmann::json;
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

class Agent {
 public:
  Agent(const LaunchConfig& cfg, const BuildInfo& node) : cfg_(cfg), node_(node) {}
  int run();
  // Rounds until the job ends, on the store open() connects to; `restarts` carries over when
  // the store is lost and found again (`reconnect`). BackendError when the store goes away.
  int run_rounds(int& restarts, bool reconnect);

 private:
  enum class Outcome { kSuccess, kFailure, kSignal };
  void log(const std::string& msg) const;
  Outcome run_round(const RoundResult& rr);
  void publish_failure(int round, const json& failure);
  void print_summary(const json& failure) const;
  void mark_stopped(int round);

  LaunchConfig cfg_;
  BuildInfo node_;
  SignalPipe signals_;
  std::unique_ptr<Rendezvous> rdzv_;
  int node_rank_ = -1;
  int stop_signal_ = 0;
  bool preempted_ = false;  // every local worker exited with kExitPreempted after our signal
  json failure_;
};

void Agent::log(const std::string& msg) const {
  std::string prefix = node_rank_ >= 0 ? fmt::format("[ft node {}] ", node_rank_) : "[ft] ";
  std::string line = prefix + msg + "\n";
  (void)!::write(2, line.data(), line.size());
}

void Agent::publish_failure(int round, const json& failure) {
  try {
    std::string stored =
        rdzv_->store().set_if_absent(Rendezvous::key(round, "failure"), failure.dump());
    failure_ = json::parse(stored);
  } catch (const BackendError&) {
    failure_ = failure;  // store gone: our own failure is the root cause we know of
  }
}

void Agent::print_summary(const json& f) const {
  std::string where =
      fmt::format("node {} ({})", f.value("node_rank", -1), f.value("hostname", "?"));
  std::string text;
  if (f.value("kind", "") == "worker") {
    text = fmt::format(
        "job failed: first failure on {} rank {} (local rank {}): worker {} after {:.1f} s", where,
        f.value("rank", -1), f.value("local_rank", -1), f.value("description", ""),
        f.value("elapsed_s", 0.0));
    auto tail = f.value("tail", std::vector<std::string>{});
    if (!tail.empty()) {
      text +=
          fmt::format("\n  last {} line(s) of rank {}'s output:", tail.size(), f.value("rank", -1));
      for (const auto& l : tail) text += "\n  | " + l;
    }
  } else {
    text = fmt::format("job stopped: {} {}", where, f.value("description", ""));
  }
  log(text);
}

Agent::Outcome Agent::run_round(const RoundResult& rr) {
  const int round = rr.round;
  JobLayout layout;
  layout.node_rank = rr.my_node_rank;
  layout.nnodes = rr.nnodes;
  layout.nproc_per_node = cfg_.nproc_per_node;
  layout.master_addr = cfg_.rdzv_host;
  layout.master_port = rdzv_->port();
  layout.restart_count = round;
  layout.max_restarts = cfg_.max_restarts;
  layout.run_id = cfg_.rdzv_id;
  layout.role = cfg_.role;
  layout.cpu_cores = cpu_cores();

  std::string log_dir;
  if (!cfg_.log_dir.empty()) {
    log_dir = fmt::format("{}/attempt_{}", cfg_.log_dir, round);
    std::error_code ec;
    std::filesystem::create_directories(log_dir, ec);
    FT_CHECK(!ec, "cannot create --log-dir folder ", log_dir, ": ", ec.message());
  }
  const EnvMap base = current_environment();
  std::vector<WorkerSpec> specs;
  for (int lr = 0; lr < cfg_.nproc_per_node; ++lr) {
    WorkerSpec s;
    s.local_rank = lr;
    s.global_rank = layout.global_rank(lr);
    s.argv = cfg_.program;
    s.env = to_envp(worker_environment(base, layout, lr));
    s.prefix = fmt::format("[node {} rank {}] ", layout.node_rank, s.global_rank);
    if (!log_dir.empty())
      s.log_path = fmt::format("{}/node{}.rank{}.log", log_dir, layout.node_rank, s.global_rank);
    specs.push_back(std::move(s));
  }

  WorkerGroup group(std::move(specs));
  log(fmt::format(
      "round {}: {} node(s) x {} worker(s), world size {}, store {}:{}; starting ranks "
      "{}..{}",
      round, layout.nnodes, layout.nproc_per_node, layout.world_size(), layout.master_addr,
      layout.master_port, layout.global_rank(0), layout.global_rank(layout.nproc_per_node - 1)));
  RdzvStore& store = rdzv_->store();
  try {
    group.spawn();
  } catch (const ConfigError& e) {
    // Not restartable: the same program would fail the same way. Every node stops and says why.
    publish_failure(round,
                    {{"kind", "error"},
                     {"node_rank", node_rank_},
                     {"hostname", hostname()},
                     {"description", fmt::format("could not start its workers: {}", e.what())}});
    group.stop(0);
    mark_stopped(round);
    return Outcome::kFailure;
  }

  const auto interval = std::chrono::milliseconds(
      std::max<int64_t>(1, static_cast<int64_t>(cfg_.monitor_interval_s * 1000)));
  bool marked_done = false;
  Outcome outcome;
  // Heartbeats: each launcher bumps its counter a few times per timeout; a peer whose counter has
  // not moved for --heartbeat-timeout (on our own clock) is lost.
  const auto hb_timeout = std::chrono::duration<double>(cfg_.heartbeat_timeout_s);
  const auto hb_every = std::chrono::duration_cast<Clock::duration>(
      std::min(hb_timeout / 4, std::chrono::duration<double>(1.0)));
  std::vector<int64_t> hb_seen(layout.nnodes, -1);
  std::vector<Clock::time_point> hb_changed(layout.nnodes, Clock::now());
  Clock::time_point hb_next = Clock::now();
  // Progress reported by the workers (ft train: contract::progress_key in its round's prefix).
  std::vector<int64_t> progress(cfg_.nproc_per_node, 0);
  std::vector<Clock::time_point> progressed(cfg_.nproc_per_node, Clock::now());
  const auto hang_every = std::chrono::duration_cast<Clock::duration>(std::min(
      std::chrono::duration<double>(cfg_.hang_timeout_s) / 4, std::chrono::duration<double>(1.0)));
  Clock::time_point hang_next = Clock::now();
  try {
    for (;;) {
      if (cfg_.hang_timeout_s > 0 && Clock::now() >= hang_next) {
        hang_next = Clock::now() + hang_every;
        int hung = -1;
        for (int lr = 0; lr < cfg_.nproc_per_node && hung < 0; ++lr) {
          const int rank = layout.global_rank(lr);
          const int64_t v = store.add(contract::full_progress_key(round, rank), 0);
          if (v != progress[lr]) {
            progress[lr] = v;
            progressed[lr] = Clock::now();
          } else if (v > 0 && Clock::now() - progressed[lr] >
                                  std::chrono::duration<double>(cfg_.hang_timeout_s)) {
            hung = lr;
          }
        }
        if (hung >= 0) {
          const int rank = layout.global_rank(hung);
          log(fmt::format(
              "rank {} reported no progress for {:.1f} s (--hang-timeout): stopping the "
              "job to restart it",
              rank, cfg_.hang_timeout_s));
          publish_failure(round,
                          {{"kind", "hang"},
                           {"node_rank", node_rank_},
                           {"hostname", hostname()},
                           {"description",
                            fmt::format("rank {} hung: no progress for {:.1f} s after {} reports "
                                        "(--hang-timeout)",
                                        rank, cfg_.hang_timeout_s, progress[hung])}});
          outcome = Outcome::kFailure;
          break;
        }
      }
      if (layout.nnodes > 1 && Clock::now() >= hb_next) {
        hb_next = Clock::now() + hb_every;
        store.add(Rendezvous::key(round, fmt::format("hb/{}", node_rank_)), 1);
        int lost = -1;
        for (int n = 0; n < layout.nnodes && lost < 0; ++n) {
          if (n == node_rank_) continue;
          const int64_t v = store.add(Rendezvous::key(round, fmt::format("hb/{}", n)), 0);
          if (v != hb_seen[n]) {
            hb_seen[n] = v;
            hb_changed[n] = Clock::now();
          } else if (Clock::now() - hb_changed[n] > hb_timeout) {
            lost = n;
          }
        }
        if (lost >= 0) {
          const auto& fp = rr.members[lost].fp;
          log(
              fmt::format("node {} ({}) sent no heartbeat for {:.1f} s: stopping this node's "
                          "workers for a new round",
                          lost, fp.hostname, cfg_.heartbeat_timeout_s));
          publish_failure(
              round,
              {{"kind", "node"},
               {"node_rank", lost},
               {"hostname", fp.hostname},
               {"description",
                fmt::format("sent no heartbeat for {:.1f} s (--heartbeat-timeout): its launcher "
                            "died or the machine is unreachable; restart it with the same command",
                            cfg_.heartbeat_timeout_s)}});
          outcome = Outcome::kFailure;
          break;
        }
      }
      if (group.poll(interval, signals_.fd())) {
        for (int sig : signals_.drain()) {
          group.signal_all(sig);  // forward first, so workers see exactly what we saw
          if (SignalPipe::terminates(sig) && !stop_signal_) {
            stop_signal_ = sig;
            log(fmt::format("received {}: stopping this node's workers (grace {:.0f} s)",
                            signal_name(sig), cfg_.term_grace_s));
            publish_failure(
                round, {{"kind", "signal"},
                        {"node_rank", node_rank_},
                        {"hostname", hostname()},
                        {"description", fmt::format("launcher received {}", signal_name(sig))}});
          }
        }
        if (stop_signal_) {
          outcome = Outcome::kSignal;
          break;
        }
      }
      if (auto f = group.first_failure()) {
        publish_failure(round, {{"kind", "worker"},
                                {"node_rank", node_rank_},
                                {"hostname", hostname()},
                                {"rank", f->global_rank},
                                {"local_rank", f->local_rank},
                                {"exit_code", f->exit_code},
                                {"signal", f->signal},
                                {"description", f->describe()},
                                {"elapsed_s", f->elapsed_s},
                                {"tail", f->tail}});
        outcome = Outcome::kFailure;
        break;
      }
      // Below --nnodes MAX, a launcher waiting to join makes the host start a new round with it.
      // Not once the job is ending (a node's workers all finished): it completes as it is, and
      // the waiting launcher is told so (Rendezvous::finish).
      if (rdzv_->is_host() && layout.nnodes < cfg_.max_nodes && !marked_done &&
          store.add(Rendezvous::key(round, "done"), 0) == 0 &&
          store.add(Rendezvous::key(round + 1, "joined"), 0) > 0) {
        publish_failure(round, {{"kind", "rejoin"},
                                {"node_rank", node_rank_},
                                {"hostname", hostname()},
                                {"description",
                                 "a node is waiting to join: starting a new round "
                                 "with it (workers checkpoint on SIGTERM)"}});
        outcome = Outcome::kFailure;
        break;
      }
      if (auto remote = store.try_get(Rendezvous::key(round, "failure"))) {
        failure_ = json::parse(*remote);
        outcome = Outcome::kFailure;
        break;
      }
      if (!marked_done && group.all_succeeded()) {
        store.add(Rendezvous::key(round, "done"), 1);
        marked_done = true;
        if (layout.nnodes > 1) log("all local workers finished; waiting for the other nodes");
      }
      if (marked_done && store.add(Rendezvous::key(round, "done"), 0) >= layout.nnodes) {
        outcome = Outcome::kSuccess;
        break;
      }
    }
  } catch (const BackendError&) {
    // The store host is gone: stop our workers gracefully before reporting it.
    log("lost the rendezvous store; stopping this node's workers");
    group.stop(cfg_.term_grace_s);
    throw;
  }
  if (outcome != Outcome::kSuccess) group.stop(cfg_.term_grace_s);
  preempted_ = outcome == Outcome::kSignal && group.all_exited_with(kExitPreempted);
  mark_stopped(round);
  return outcome;
}

void Agent::mark_stopped(int round) {
  // The host may already be gone after a failure (it waits only so long): that is not an error of
  // ours.
  try {
    rdzv_->store().add(Rendezvous::key(round, "stopped"), 1);
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
  rdzv_ = std::make_unique<Rendezvous>(cfg_, fp, [&] {
    for (int s : signals_.drain())
      if (SignalPipe::terminates(s)) {
        stop_signal_ = s;
        interrupted = true;
      }
    return interrupted;
  });

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
      Outcome o = run_round(rr);
      if (o == Outcome::kSuccess) {
        if (rdzv_->is_host()) {
          rdzv_->wait_count(round, "stopped", rr.nnodes, 30.0);
          rdzv_->finish(round);
        }
        log("job finished successfully");
        return kExitOk;
      }
      const std::string kind = failure_.value("kind", "");
      const bool restartable =
          (kind == "worker" || kind == "node" || kind == "hang" || kind == "rejoin") &&
          !stop_signal_;
      if (kind == "rejoin") {
        print_summary(failure_);
        continue;
      }
      if (restartable && restarts < cfg_.max_restarts) {
        ++restarts;
        print_summary(failure_);
        log(fmt::format("restarting the job: attempt {} of {} restarts", restarts,
                        cfg_.max_restarts));
        continue;
      }
      print_summary(failure_);
      // Keep the store up while the other nodes read the failure and stop their workers.
      if (rdzv_->is_host()) rdzv_->wait_count(round, "stopped", rr.nnodes, cfg_.term_grace_s + 5.0);
      if (stop_signal_ && preempted_) {
        log(
            fmt::format("every worker saved a checkpoint after {}; run the same command again to "
                        "continue (exit {})",
                        signal_name(stop_signal_), kExitPreempted));
        return kExitPreempted;
      }
      if (stop_signal_) return 128 + stop_signal_;
      if (restartable && cfg_.max_restarts > 0)
        log(fmt::format("no restarts left ({} used)", cfg_.max_restarts));
      return kExitWorkerFailed;
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
