#include "ckpt/checkpointer.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>

namespace ft::ckpt {

using nlohmann::json;

namespace {

// Set by SIGTERM while a Checkpointer lives; the run checkpoints and stops at the next step.
volatile std::sig_atomic_t g_terminate = 0;
void on_terminate(int) { g_terminate = 1; }
struct sigaction g_old_term {};

bool checkpoints_at_all(const CheckpointerOptions& o) {
  return o.save_every > 0 || o.save_every_minutes > 0;
}

}  // namespace

Checkpointer::Checkpointer(CheckpointerOptions options)
    : options_(std::move(options)),
      saver_(options_.saver),
      rank0_(options_.saver.rank == 0),
      last_save_(std::chrono::steady_clock::now()) {
  if (rank0_ && checkpoints_at_all(options_)) log_.open(options_.log_path, std::ios::app);
  g_terminate = 0;
  struct sigaction sa {};
  sa.sa_handler = on_terminate;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, &g_old_term);
}

Checkpointer::~Checkpointer() { ::sigaction(SIGTERM, &g_old_term, nullptr); }

void Checkpointer::log(const json& record) {
  if (!rank0_) return;
  log_ << record.dump() << "\n";
  log_.flush();
}

void Checkpointer::before_update() {
  const double fence_s = saver_.wait_captured();
  if (pending_) {
    (*pending_)["stall_s"] = (*pending_)["stall_s"].get<double>() + fence_s;
    log(*pending_);
  }
  pending_.reset();
}

bool Checkpointer::after_step(int64_t step, int64_t total_steps,
                              const std::function<Snapshot()>& snapshot) {
  // One scalar collective per step carries both rank 0's clock and SIGTERM on any rank:
  // 2 = a rank was told to stop, 1 = time to save.
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_save_).count();
  const double flags =
      (g_terminate ? 2 : 0) +
      (rank0_ && options_.save_every_minutes > 0 && since >= options_.save_every_minutes * 60 ? 1
                                                                                              : 0);
  const double agreed = options_.saver.world_size > 1 ? options_.max_over_ranks(flags) : flags;
  const bool stop = agreed >= 2 && step < total_steps;
  const bool due = (options_.save_every > 0 && step % options_.save_every == 0) || agreed >= 1 ||
                   (checkpoints_at_all(options_) && step == total_steps);
  if (due) {
    const bool async = options_.async_save && !stop;
    const auto s0 = std::chrono::steady_clock::now();
    saver_.save(snapshot(), async);
    last_save_ = std::chrono::steady_clock::now();
    // What each save cost the training loop, and each write took. The stall of an async save
    // is this call plus the wait before the next update.
    pending_ = json{{"step", step},
                    {"async", async},
                    {"stall_s", std::chrono::duration<double>(last_save_ - s0).count()},
                    {"previous_write_s", saver_.last_write_s()}};
    if (!async) {
      log(*pending_);
      pending_.reset();
    }
    if (rank0_ && ::isatty(STDOUT_FILENO) != 1)
      fmt::print("ft train: checkpoint of step {} {} (training paused {:.3f} s)\n", step,
                 async ? "being written" : "written", saver_.last_stall_s());
    std::fflush(stdout);
  }
  if (stop) saver_.wait();
  return stop;
}

void Checkpointer::finish(int64_t step) {
  saver_.wait();
  if (pending_) log(*pending_);
  if (rank0_ && log_.is_open()) log(json{{"step", step}, {"last_write_s", saver_.last_write_s()}});
}

}  // namespace ft::ckpt
