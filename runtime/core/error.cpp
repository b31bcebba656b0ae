#include "core/error.h"

#include <cerrno>
#include <cstring>

namespace ft {

namespace detail {
void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  throw Error(fmt::format("internal error (a bug in ft, please report): {} failed at {}:{}{}{}",
                          expr, file, line, msg.empty() ? "" : ": ", msg));
}
}  // namespace detail

void throw_errno(const std::string& what, const char* file, int line) {
  int err = errno;
  throw SystemError(
      fmt::format("{} failed: {} (errno {}) at {}:{}", what, std::strerror(err), err, file, line));
}

}  // namespace ft
