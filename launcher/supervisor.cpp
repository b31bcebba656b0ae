#include "supervisor.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace ft::launcher {

using Clock = std::chrono::steady_clock;

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

std::string WorkerExit::describe() const {
  if (signal != 0) return fmt::format("was killed by signal {} ({})", signal, signal_name(signal));
  return fmt::format("exited with code {}", exit_code);
}

struct WorkerGroup::Worker {
  WorkerSpec spec;
  pid_t pid = -1;
  int fd[2] = {-1, -1};    // read ends of stdout, stderr pipes
  std::string partial[2];  // incomplete last line per stream
  std::deque<std::string> tail;
  int log_fd = -1;
  bool exited = false;
  int status = 0;
  Clock::time_point started;
  double elapsed_s = 0;

  ~Worker() {
    for (int f : fd)
      if (f >= 0) ::close(f);
    if (log_fd >= 0) ::close(log_fd);
  }
};

namespace {

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // console gone (EPIPE): nothing sensible to do, keep supervising
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

WorkerGroup::WorkerGroup(std::vector<WorkerSpec> specs) {
  for (auto& s : specs) {
    auto w = std::make_unique<Worker>();
    w->spec = std::move(s);
    workers_.push_back(std::move(w));
  }
}

WorkerGroup::~WorkerGroup() {
  for (auto& w : workers_) {
    if (w->pid > 0 && !w->exited) {
      ::killpg(w->pid, SIGKILL);
      ::waitpid(w->pid, &w->status, 0);
      w->exited = true;
    }
  }
}

void WorkerGroup::spawn() {
  const pid_t parent = ::getpid();
  for (auto& wp : workers_) {
    Worker& w = *wp;
    int out[2], err[2], exec_err[2];
    FT_SYSCALL(::pipe2(out, O_CLOEXEC));
    FT_SYSCALL(::pipe2(err, O_CLOEXEC));
    FT_SYSCALL(::pipe2(exec_err, O_CLOEXEC));
    if (!w.spec.log_path.empty()) {
      w.log_fd = ::open(w.spec.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (w.log_fd < 0) {
        int e = errno;
        throw ConfigError(
            fmt::format("cannot write worker log file {}: {}", w.spec.log_path, std::strerror(e)));
      }
    }

    // Everything the child touches is prepared before fork: it only calls async-signal-safe
    // functions (execvpe aside, which is the last thing it does).
    std::vector<char*> argv, envp;
    for (auto& a : w.spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (auto& e : w.spec.env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    for (const int c : w.spec.cpus) CPU_SET(c, &cpus);
    const bool bind = !w.spec.cpus.empty();

    pid_t pid = ::fork();
    if (pid < 0) throw_errno("fork", __FILE__, __LINE__);
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // launcher died between fork and prctl
      int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      sigset_t all;
      sigemptyset(&all);
      ::sigprocmask(SIG_SETMASK, &all, nullptr);
      ::signal(SIGPIPE, SIG_DFL);
      // A subset of the launcher's own cores (core_shares), so this cannot be refused.
      if (bind) (void)::sched_setaffinity(0, sizeof cpus, &cpus);
      ::execvpe(argv[0], argv.data(), envp.data());
      int e = errno;
      (void)!::write(exec_err[1], &e, sizeof e);
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also done in the child; whichever runs first wins the race
    w.pid = pid;
    w.started = Clock::now();
    ::close(out[1]);
    ::close(err[1]);
    ::close(exec_err[1]);
    w.fd[0] = out[0];
    w.fd[1] = err[0];

    int child_errno = 0;
    ssize_t n;
    do {
      n = ::read(exec_err[0], &child_errno, sizeof child_errno);
    } while (n < 0 && errno == EINTR);
    ::close(exec_err[0]);
    if (n == sizeof child_errno) {
      ::waitpid(pid, &w.status, 0);
      w.exited = true;
      throw ConfigError(
          fmt::format("cannot run '{}': {}. Check the program path after `--` (and "
                      "that it is executable on every node)",
                      w.spec.argv[0], std::strerror(child_errno)));
    }
  }
}

void WorkerGroup::pump(Worker& w, int which) {
  char buf[65536];
  ssize_t n = ::read(w.fd[which], buf, sizeof buf);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  const int console = which == 0 ? 1 : 2;
  auto emit = [&](const std::string& line) {
    std::string out = w.spec.prefix + line + "\n";
    write_all(console, out.data(), out.size());
    if (w.log_fd >= 0) write_all(w.log_fd, (line + "\n").data(), line.size() + 1);
    w.tail.push_back(line);
    if (w.tail.size() > kTailLines) w.tail.pop_front();
  };
  std::string& part = w.partial[which];
  if (n <= 0) {  // EOF: flush an unterminated last line, close the stream
    if (!part.empty()) emit(part);
    part.clear();
    ::close(w.fd[which]);
    w.fd[which] = -1;
    return;
  }
  part.append(buf, static_cast<size_t>(n));
  size_t start = 0;
  for (size_t nl; (nl = part.find('\n', start)) != std::string::npos; start = nl + 1) {
    emit(part.substr(start, nl - start));
  }
  part.erase(0, start);
  // A line longer than 1 MiB is split rather than buffered without bound.
  if (part.size() > (1u << 20)) {
    emit(part);
    part.clear();
  }
}

void WorkerGroup::reap() {
  for (auto& wp : workers_) {
    Worker& w = *wp;
    if (w.pid <= 0 || w.exited) continue;
    int status = 0;
    pid_t r = ::waitpid(w.pid, &status, WNOHANG);
    if (r != w.pid) continue;
    // Drain what is left in the pipes so the tail holds the worker's last words.
    for (int i = 0; i < 2; ++i) {
      while (w.fd[i] >= 0) {
        pollfd p{w.fd[i], POLLIN, 0};
        if (::poll(&p, 1, 0) <= 0) break;
        pump(w, i);
      }
    }
    w.exited = true;
    w.status = status;
    w.elapsed_s = std::chrono::duration<double>(Clock::now() - w.started).count();
    WorkerExit e;
    e.local_rank = w.spec.local_rank;
    e.global_rank = w.spec.global_rank;
    if (WIFSIGNALED(status)) e.signal = WTERMSIG(status);
    if (WIFEXITED(status)) e.exit_code = WEXITSTATUS(status);
    e.elapsed_s = w.elapsed_s;
    for (auto& p : w.partial)
      if (!p.empty()) w.tail.push_back(p);
    e.tail.assign(w.tail.begin(), w.tail.end());
    if (e.failed()) failures_.push_back(std::move(e));
  }
}

bool WorkerGroup::poll(std::chrono::milliseconds timeout, int wake_fd) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, int>> owners;
  if (wake_fd >= 0) fds.push_back({wake_fd, POLLIN, 0});
  for (auto& w : workers_) {
    for (int i = 0; i < 2; ++i) {
      if (w->fd[i] >= 0) {
        fds.push_back({w->fd[i], POLLIN, 0});
        owners.emplace_back(w.get(), i);
      }
    }
  }
  int ms = static_cast<int>(timeout.count());
  int n = ::poll(fds.data(), fds.size(), ms);
  if (n < 0 && errno != EINTR) throw_errno("poll", __FILE__, __LINE__);
  bool woke = false;
  size_t base = wake_fd >= 0 ? 1 : 0;
  if (n > 0) {
    if (wake_fd >= 0 && (fds[0].revents & (POLLIN | POLLHUP))) woke = true;
    for (size_t i = base; i < fds.size(); ++i) {
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
        pump(*owners[i - base].first, owners[i - base].second);
    }
  }
  reap();
  return woke;
}

void WorkerGroup::signal_all(int sig) {
  for (auto& w : workers_)
    if (w->pid > 0 && !w->exited) ::killpg(w->pid, sig);
}

std::vector<int> WorkerGroup::stop(double grace_s, const std::function<bool()>& kill_now) {
  reap();
  signal_all(SIGTERM);
  auto deadline = Clock::now() + std::chrono::duration<double>(grace_s);
  while (!all_exited() && Clock::now() < deadline && !(kill_now && kill_now()))
    poll(std::chrono::milliseconds(20));
  std::vector<int> killed;
  if (!all_exited()) {
    for (auto& w : workers_)
      if (w->pid > 0 && !w->exited) killed.push_back(w->spec.global_rank);
    signal_all(SIGKILL);
    while (!all_exited()) poll(std::chrono::milliseconds(20));
  }
  // Children the workers left behind in their process groups go too: only our own groups.
  for (auto& w : workers_)
    if (w->pid > 0) ::killpg(w->pid, SIGKILL);
  return killed;
}

bool WorkerGroup::all_exited() const {
  for (auto& w : workers_)
    if (w->pid > 0 && !w->exited) return false;  // never started (spawn failed) counts as gone
  return true;
}

bool WorkerGroup::all_succeeded() const {
  for (auto& w : workers_)
    if (!w->exited || !WIFEXITED(w->status) || WEXITSTATUS(w->status) != 0) return false;
  return true;
}

bool WorkerGroup::all_exited_with(int code) const {
  for (auto& w : workers_)
    if (!w->exited || !WIFEXITED(w->status) || WEXITSTATUS(w->status) != code) return false;
  return !workers_.empty();
}

std::optional<WorkerExit> WorkerGroup::first_failure() const {
  if (failures_.empty()) return std::nullopt;
  return failures_.front();
}

std::vector<pid_t> WorkerGroup::pids() const {
  std::vector<pid_t> out;
  for (auto& w : workers_) out.push_back(w->pid);
  return out;
}

}  // namespace ft::launcher
