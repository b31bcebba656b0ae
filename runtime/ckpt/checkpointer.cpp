#include "ckpt/checkpointer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>

#include "core/strings.h"
#include "io/storage.h"

namespace ft::ckpt {

using nlohmann::json;

namespace {

// Set by SIGTERM or SIGINT while a Checkpointer lives; the run checkpoints and stops after the
// step that is running. The handler only writes preformatted bytes (async-signal-safe).
volatile std::sig_atomic_t g_terminate = 0, g_signal = SIGTERM;
volatile std::sig_atomic_t g_announce = 0, g_second_stops = 0;
// On a terminal a message first ends the progress bar's line; in a pipe (a launcher prefixes each
// line) that newline would be an empty line of its own.
volatile std::sig_atomic_t g_tty = 0;
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
    put(msg, &n, g_tty ? "\nft train: " : "ft train: ");
    put(msg, &n, name);
    put(msg, &n, " again: stopping now; the checkpoints already committed are intact\n");
    write_all(msg, n);
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  if (!g_terminate && g_announce) {
    put(msg, &n, g_tty ? "\nft train: " : "ft train: ");
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
  g_tty = ::isatty(STDERR_FILENO) == 1 ? 1 : 0;
  struct sigaction sa {};
  sa.sa_handler = on_terminate;
  sa.sa_flags = SA_RESTART;
  // Each blocks the other while it runs: a launcher forwards a SIGINT and sends its own SIGTERM
  // right after, and with both pending the kernel ran the SIGTERM handler first, stacked on the
  // SIGINT one, so the run said it stopped on SIGTERM (issue 51).
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);
  sigaddset(&sa.sa_mask, SIGTERM);
  ::sigaction(SIGTERM, &sa, &g_old_term);
  ::sigaction(SIGINT, &sa, &g_old_int);
}

Checkpointer::~Checkpointer() {
  ::sigaction(SIGTERM, &g_old_term, nullptr);
  ::sigaction(SIGINT, &g_old_int, nullptr);
}

void Checkpointer::running(int64_t step) { g_step.store(step); }

const char* Checkpointer::stop_signal() { return g_signal == SIGINT ? "SIGINT" : "SIGTERM"; }

int64_t Checkpointer::committed_step() const {
  return std::max(committed_, saver_.committed_step());
}

double Checkpointer::last_save_s() const {
  const double write_s = saver_.last_write_s();
  return write_s > 0 ? snapshot_s_ + write_s : 0;
}

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

double Checkpointer::agree_max(double v) const {
  return options_.saver.world_size > 1 ? options_.max_over_ranks(v) : v;
}

double Checkpointer::agree_sum(double v) const {
  return options_.saver.world_size > 1 ? options_.sum_over_ranks(v) : v;
}

bool Checkpointer::after_step(int64_t step, int64_t total_steps,
                              const std::function<Snapshot()>& snapshot) {
  // One scalar collective per step carries rank 0's clock, SIGTERM on any rank and a background
  // save that failed on any rank: 1 = time to save, 2 = a rank was told to stop, 4 = a save
  // failed. The largest wins, so a failure hides the other two for this step; they are asked
  // again at the next (the signal and the clock stay set).
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_save_).count();
  const double flags =
      (saver_.failed() ? 4 : 0) + (g_terminate ? 2 : 0) +
      (rank0_ && options_.save_every_minutes > 0 && since >= options_.save_every_minutes * 60 ? 1
                                                                                              : 0);
  double agreed = agree_max(flags);
  if (agreed >= 4) {
    settle(/*stopping=*/false);
    agreed = 0;
  }
  const bool stop = agreed >= 2 && step < total_steps;
  // A signal from here on is answered after the next step: that is the step it finishes.
  if (!stop) g_step.store(step + 1);
  const bool due = (options_.save_every > 0 && step % options_.save_every == 0) || agreed >= 1 ||
                   (checkpoints_at_all(options_) && step == total_steps);
  if (due) {
    const bool async = options_.async_save && !stop;
    const auto s0 = std::chrono::steady_clock::now();
    settle(/*stopping=*/false);  // the previous save has ended on every rank
    const auto snap0 = std::chrono::steady_clock::now();
    Snapshot snap = snapshot();
    warn_if_no_room(step, snap);
    snapshot_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - snap0).count();
    std::string error;  // of a synchronous save; a background one keeps its own for wait()
    try {
      saver_.save(std::move(snap), async);
    } catch (const std::exception& e) {
      error = e.what();
    }
    in_flight_ = step;
    last_save_ = std::chrono::steady_clock::now();
    // What each save cost the training loop, and each write took. The stall of an async save
    // is this call plus the wait before the next update.
    const double stall_s = std::chrono::duration<double>(last_save_ - s0).count();
    pending_ = json{{"step", step},
                    {"async", async},
                    {"stall_s", stall_s},
                    {"previous_write_s", saver_.last_write_s()}};
    const bool written = async || settle(stop, error);
    if (!async) {
      if (written) log(*pending_);
      pending_.reset();
    }
    if (rank0_ && written && ::isatty(STDOUT_FILENO) != 1)
      fmt::print("ft train: checkpoint of step {} {} (training paused {:.3f} s)\n", step,
                 async ? "being written" : "written", stall_s);
    std::fflush(stdout);
  }
  return stop;
}

// Every rank, in step (one collective): the save in flight, if any, has ended here (`error`: the
// failure of a synchronous one), and the ranks agree whether it failed anywhere. True when it did
// not.
bool Checkpointer::settle(bool stopping, std::string error) {
  try {
    saver_.wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const bool failed = agree_max(error.empty() ? 0 : 1) >= 1;
  const int64_t step = in_flight_;
  in_flight_ = -1;
  if (!failed) {
    committed_ = std::max(committed_, step);
    return true;
  }
  // Every rank reports rank 0's account, which names each rank that failed and why.
  if (!rank0_) {
    const std::string verdict = saver_.verdict(step);
    if (!verdict.empty()) error = verdict;
  }
  if (error.empty()) error = fmt::format("checkpoint of step {} not saved by another rank", step);
  save_failed(step, error, stopping);
  return false;
}

// The save of `step` failed on some rank (`what`: rank 0's account of it). The run stops
// (output.on_save_error=stop, or a SIGTERM's checkpoint: stopping without one would lose the
// steps) or rank 0 warns and training goes on.
void Checkpointer::save_failed(int64_t step, const std::string& what, bool stopping) {
  log(json{{"step", step}, {"error", what}});
  failed_steps_.push_back(step);
  const auto committed = list_committed(root());
  const std::string kept =
      committed.empty()
          ? std::string("no checkpoint of this run is committed yet")
          : fmt::format("the newest committed checkpoint, {}, is intact", committed.front());
  const bool stop = stopping || options_.on_save_error == OnSaveError::kStop;
  if (stop)
    throw CheckpointSaveError(fmt::format(
        "{}; {}; once the storage is fixed (room made, if it is full), run the same command "
        "again: {} ({}; exit {})",
        what, kept, committed.empty() ? "it starts over" : "--resume auto continues from it",
        stopping ? "the run was stopping on a signal"
                 : "output.on_save_error=stop; with continue the run would train on without it",
        contract::kExitSaveFailed));
  if (rank0_)
    fmt::print(stderr,
               "ft train: WARNING: {}; {}; training goes on without it "
               "(output.on_save_error=continue) and the next save tries again\n",
               what, kept);
}

// Best effort, before a save: when the filesystem plainly has less room than the checkpoint,
// rank 0 says so now. The save is tried all the same (room may be made meanwhile, and statvfs is
// only an estimate on shared storage); the write's own error is what counts. One collective.
void Checkpointer::warn_if_no_room(int64_t step, const Snapshot& snapshot) const {
  const double need = agree_sum(static_cast<double>(snapshot.data_bytes()));
  if (!rank0_) return;
  const io::Space space = io::space_at(root());
  if (space.free_bytes < 0 || need <= static_cast<double>(space.free_bytes)) return;
  fmt::print(stderr,
             "ft train: warning: the checkpoint of step {} needs about {}, but there is {}: the "
             "save will likely fail\n",
             step, human_bytes(static_cast<int64_t>(need)), io::describe_space(space));
  std::fflush(stderr);
}

void Checkpointer::finish(int64_t step) {
  if (pending_) log(*pending_);
  pending_.reset();
  settle(/*stopping=*/false);
  if (rank0_ && log_.is_open()) log(json{{"step", step}, {"last_write_s", saver_.last_write_s()}});
  if (rank0_ && !failed_steps_.empty())
    fmt::print(stderr,
               "ft train: WARNING: {} checkpoint save(s) failed (steps {}); the newest committed "
               "checkpoint is older than the end of the run\n",
               failed_steps_.size(), fmt::join(failed_steps_, ", "));
}

}  // namespace ft::ckpt
