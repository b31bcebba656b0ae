// Typed errors shared by the launcher and the runtime, and the two kinds of check (STYLE.md
// "Errors"). FT_CHECK validates user input (configs, flags, files, peers) and throws a typed error
// carrying the bad value and what to do; FT_ASSERT guards internal invariants. Neither is compiled
// out. Thread-safe.
#pragma once

#include <fmt/format.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/worker_contract.h"

namespace ft {

// Base of every error ft raises on purpose. `exit_code()` lets main() map a failure to a process
// status without knowing every type.
class Error : public std::runtime_error {
 public:
  explicit Error(std::string msg) : std::runtime_error(std::move(msg)) {}
  virtual int exit_code() const { return 1; }
};

// Bad user input: flags, environment, presets. Restarting will not help.
class ConfigError : public Error {
 public:
  using Error::Error;
  int exit_code() const override { return 2; }
};

// Rendezvous did not complete: timeout, refused node, lost store.
class RendezvousError : public Error {
 public:
  using Error::Error;
  int exit_code() const override { return 3; }
};
class RendezvousTimeout : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

// A communication backend (Gloo/NCCL) or the store failed under us.
class BackendError : public Error {
 public:
  using Error::Error;
  int exit_code() const override { return 4; }
};

// Communication with another rank broke under a worker (connection reset or closed, a collective
// or the store timed out): the cause is usually a peer that died first. Exit code
// contract::kExitPeerLost, which tells the launcher to look for that peer's failure before blaming
// this rank.
class PeerLostError : public BackendError {
 public:
  using BackendError::BackendError;
  int exit_code() const override { return contract::kExitPeerLost; }
};

// A file ft reads is malformed or inconsistent: model weights, config.json, tokenizer.json, a
// dataset line. The message names the file and the tensor / key / line.
class FormatError : public Error {
 public:
  using Error::Error;
  int exit_code() const override { return 2; }
};

// An operating-system call failed (fork, pipe, bind ...).
class SystemError : public Error {
 public:
  using Error::Error;
};

namespace detail {
// Formats with fmt where it can, else with operator<< (shapes, devices and other c10 types).
template <typename T>
void append(std::string& out, const T& v) {
  if constexpr (fmt::is_formattable<T>::value) {
    out += fmt::format("{}", v);
  } else {
    std::ostringstream ss;
    ss << v;
    out += ss.str();
  }
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}
[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);
}  // namespace detail

// Throws `errno`'s text along with `what` and file:line.
[[noreturn]] void throw_errno(const std::string& what, const char* file, int line);

}  // namespace ft

// User-input check: throws ErrorType with the concatenated message parts.
#define FT_CHECK_T(ErrorType, cond, ...)                          \
  do {                                                            \
    if (!(cond)) throw ErrorType(::ft::detail::cat(__VA_ARGS__)); \
  } while (0)
#define FT_CHECK(cond, ...) FT_CHECK_T(::ft::ConfigError, cond, __VA_ARGS__)

// Internal invariant: a failure is a bug in ft, reported with file:line.
#define FT_ASSERT(cond, ...)                                                                \
  do {                                                                                      \
    if (!(cond))                                                                            \
      ::ft::detail::assert_fail(#cond, __FILE__, __LINE__, ::ft::detail::cat(__VA_ARGS__)); \
  } while (0)

// POSIX call check: `FT_SYSCALL(fd = open(...))` throws SystemError with strerror(errno) on -1.
#define FT_SYSCALL(expr)                                            \
  do {                                                              \
    if ((expr) == -1) ::ft::throw_errno(#expr, __FILE__, __LINE__); \
  } while (0)
