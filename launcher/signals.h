// Turns the signals a launcher forwards (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) into bytes on a
// self-pipe, so the main loop can poll() for them next to worker output. Install once, from main
// thread; the handler itself only write(2)s.
#pragma once

#include <vector>

namespace ft::launcher {

class SignalPipe {
 public:
  SignalPipe();   // installs the handlers; SIGPIPE is ignored so a closed console cannot kill us
  ~SignalPipe();  // restores default dispositions
  int fd() const;
  std::vector<int> drain();  // signals received since the last drain, in order
  static bool terminates(int sig) { return sig != 10 && sig != 12; }  // SIGUSR1/2 only forward
};

}  // namespace ft::launcher
