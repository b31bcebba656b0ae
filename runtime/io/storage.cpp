#include "io/storage.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/strings.h"

namespace ft::io {

namespace fs = std::filesystem;

namespace {

// `path` made absolute, then walked up to the nearest entry that exists.
fs::path nearest_existing(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(path.empty() ? "." : path, ec).lexically_normal();
  if (ec) p = path;
  while (!p.empty() && !fs::exists(p, ec) && p != p.parent_path()) p = p.parent_path();
  return p;
}

}  // namespace

Space space_at(const std::string& path) {
  Space s;
  s.dir = nearest_existing(path).string();
  struct statvfs sv {};
  if (::statvfs(s.dir.c_str(), &sv) == 0) {
    s.free_bytes = static_cast<int64_t>(sv.f_bavail) * static_cast<int64_t>(sv.f_frsize);
    s.total_bytes = static_cast<int64_t>(sv.f_blocks) * static_cast<int64_t>(sv.f_frsize);
    s.read_only = (sv.f_flag & ST_RDONLY) != 0;
  }
  return s;
}

std::string describe_space(const Space& s) {
  if (s.free_bytes < 0)
    return fmt::format("the free space on the filesystem of {} is unknown", s.dir);
  return fmt::format("{} free of {} on the filesystem of {}", human_bytes(s.free_bytes),
                     human_bytes(s.total_bytes), s.dir);
}

void check_writable_dir(const std::string& dir, const std::string& flag) {
  const fs::path at = nearest_existing(dir);
  std::error_code ec;
  const bool exists = fs::equivalent(at, fs::absolute(dir, ec), ec);
  // What the refusal names: the directory itself, or the parent it would be created in.
  const std::string where =
      exists ? fmt::format("{} {}", flag, dir)
             : fmt::format("{} {} cannot be created: its nearest existing parent {}", flag, dir,
                           at.string());
  const std::string fix = fmt::format("give an {} on writable storage", flag);
  FT_CHECK(fs::is_directory(at, ec), where, " is not a directory; ", fix);
  // Root writes past permission bits, but not onto a read-only mount: both are asked.
  bool read_only = space_at(at.string()).read_only;
  int err = 0;
  if (!read_only && ::faccessat(AT_FDCWD, at.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
    err = errno;
    read_only = err == EROFS;
  }
  FT_CHECK(!read_only, where, " is on a read-only filesystem, so nothing can be written there; ",
           fix, " (or remount it read-write)");
  FT_CHECK(err == 0, where, " cannot be written by this user (uid ", ::geteuid(),
           "): ", std::strerror(err), "; ", fix, " (or make it writable)");
}

}  // namespace ft::io
