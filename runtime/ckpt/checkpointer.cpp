#include "ckpt/checkpointer.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>

namespace ft::ckpt {

using nlohmann::json;

namespace {

// Set by SIGTERM or SIGINT while a Checkpointer lives; the run checkpoints and stops after the
// step that is running. The handler only writes preformatted bytes (async-signal-safe).
volatile std::sig_atomic_t g_terminate = 0, g_signal = SIGTERM;
volatile std::sig_atomic_t g_announce = 0, g_second_stops = 0;
std::atomic<int64_t> g_step{0};
static_assert(std::atomic<int64_t>::is_always_lock_free, "read in a signal handler");
struct sigaction g_old_term {
}, g_old_int{};

void write_all(const char* s, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

// Appends `v` in decimal to `out` at `*n` (no allocation, no locale).
void put_number(char* out, size_t* n, int64_t v) {
  char digits[24];
  int k = 0;
  do digits[k++] = static_cast<char>('0' + v % 10);
  while ((v /= 10) > 0 && k < 23);
  while (k > 0) out[(*n)++] = digits[--k];
}

void put(char* out, size_t* n, const char* s) {
  while (*s) out[(*n)++] = *s++;
}

void on_terminate(int sig) {
  const int saved = errno;
  const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
  char msg[256];
  size_t n = 0;
  if (g_terminate && g_second_stops) {
    put(msg, &n, "\nft train: ");
    put(msg, &n, name);
    put(msg, &n, " again: stopping now; the checkpoints already committed are intact\n");
    write_all(msg, n);
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  if (!g_terminate && g_announce) {
    put(msg, &n, "\nft train: ");
    put(msg, &n, name);
    put(msg, &n, ": finishing step ");
    put_number(msg, &n, g_step.load());
    put(msg, &n, ", then a checkpoint, then exit 75");
    put(msg, &n, g_second_stops ? "; send it again to stop at once\n" : "\n");
    write_all(msg, n);
  }
  if (!g_terminate) g_signal = sig;
  g_terminate = 1;
  errno = saved;
}

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
  g_announce = options_.announce ? 1 : 0;
  g_second_stops = options_.second_signal_stops ? 1 : 0;
  struct sigaction sa {};
  sa.sa_handler = on_terminate;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, &g_old_term);
  ::sigaction(SIGINT, &sa, &g_old_int);
}

Checkpointer::~Checkpointer() {
  ::sigaction(SIGTERM, &g_old_term, nullptr);
  ::sigaction(SIGINT, &g_old_int, nullptr);
}

void Checkpointer::running(int64_t step) { g_step.store(step); }

const char* Checkpointer::stop_signal() { return g_signal == SIGINT ? "SIGINT" : "SIGTERM"; }

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
