// Local worker processes of one restart round: spawn, pump their output, reap, signal, stop.
// Each worker runs in its own process group and gets SIGKILL when its launcher dies
// (PR_SET_PDEATHSIG), so no orphan survives a killed launcher. Output reaches the console line by
// line with a "[node N rank R] " prefix, one write(2) per line so lines from different workers
// never interleave mid-line, and in full to a per-rank log file when one is set. Ordering: only the
// launcher's main thread uses a WorkerGroup; spawn() forks from that thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ft::launcher {

struct WorkerSpec {
  int local_rank = 0;
  int global_rank = 0;
  std::vector<std::string> argv;
  std::vector<std::string> env;  // "KEY=VALUE", the complete environment
  std::string prefix;            // "[node 0 rank 1] "
  std::string log_path;          // "" for none
  std::vector<int> cpus;         // --bind-cores: the cores it runs on (empty: not bound)
};

struct WorkerExit {
  int local_rank = 0;
  int global_rank = 0;
  int exit_code = 0;  // valid when signal == 0
  int signal = 0;     // terminating signal, 0 if it exited
  double elapsed_s = 0;
  std::vector<std::string> tail;  // last lines of its output (stdout and stderr, in order)
  bool failed() const { return signal != 0 || exit_code != 0; }
  std::string describe() const;  // "exited with code 1" / "was killed by signal 9 (SIGKILL)"
};

class WorkerGroup {
 public:
  static constexpr size_t kTailLines = 20;

  explicit WorkerGroup(std::vector<WorkerSpec> specs);
  ~WorkerGroup();  // kills (SIGKILL) and reaps anything still running
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts every worker. Throws ConfigError when the program cannot be executed (not found, not
  // executable), SystemError when fork/pipe fail. Workers already started are killed on failure.
  void spawn();

  // Waits up to `timeout` for output or exits (also waking when `wake_fd` is readable), pumps
  // output and reaps exited workers. Returns whether `wake_fd` is readable.
  bool poll(std::chrono::milliseconds timeout, int wake_fd = -1);

  // Sends `sig` to every running worker's process group.
  void signal_all(int sig);

  // SIGTERM to all, keep pumping output, SIGKILL after `grace_s` or as soon as `kill_now()`
  // says so (polled every 20 ms), reap all. Returns the global ranks that were still running and
  // got SIGKILL. Idempotent.
  std::vector<int> stop(double grace_s, const std::function<bool()>& kill_now = {});

  bool all_exited() const;
  bool all_succeeded() const;  // all exited with code 0
  bool all_exited_with(int code) const;
  // The first worker that failed, in the order failures were observed.
  std::optional<WorkerExit> first_failure() const;
  // Every worker that failed so far, in that order.
  const std::vector<WorkerExit>& failures() const { return failures_; }
  std::vector<pid_t> pids() const;

 private:
  struct Worker;
  void pump(Worker& w, int which);
  void reap();
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<WorkerExit> failures_;
};

// Human name of a signal: "SIGKILL".
std::string signal_name(int sig);

}  // namespace ft::launcher
