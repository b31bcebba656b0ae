#include "signals.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include "core/error.h"

namespace ft::launcher {
namespace {
int g_pipe[2] = {-1, -1};
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2};

void on_signal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  (void)!::write(g_pipe[1], &b, 1);
  errno = saved;
}
}  // namespace

static_assert(SIGUSR1 == 10 && SIGUSR2 == 12, "SignalPipe::terminates assumes Linux numbering");

SignalPipe::SignalPipe() {
  FT_ASSERT(g_pipe[0] < 0, "only one SignalPipe may exist");
  FT_SYSCALL(::pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : kForwarded) ::sigaction(s, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
}

SignalPipe::~SignalPipe() {
  for (int s : kForwarded) ::signal(s, SIG_DFL);
  ::close(g_pipe[0]);
  ::close(g_pipe[1]);
  g_pipe[0] = g_pipe[1] = -1;
}

int SignalPipe::fd() const { return g_pipe[0]; }

std::vector<int> SignalPipe::drain() {
  std::vector<int> out;
  unsigned char buf[64];
  ssize_t n;
  while ((n = ::read(g_pipe[0], buf, sizeof buf)) > 0)
    for (ssize_t i = 0; i < n; ++i) out.push_back(buf[i]);
  return out;
}

}  // namespace ft::launcher
