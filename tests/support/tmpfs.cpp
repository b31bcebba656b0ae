#include "support/tmpfs.h"

#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "support/subprocess.h"

namespace ft::test {

namespace fs = std::filesystem;

namespace {
std::string size_option(int64_t bytes) { return "size=" + std::to_string(bytes); }

void remount(const std::string& dir, unsigned long flags, const std::string& options) {
  if (::mount("tmpfs", dir.c_str(), "tmpfs", MS_REMOUNT | flags, options.c_str()) != 0)
    throw std::runtime_error("remount of " + dir + " (" + options +
                             ") failed: " + std::strerror(errno));
}
}  // namespace

std::unique_ptr<Tmpfs> Tmpfs::mount(int64_t bytes, std::string* why) {
  const std::string dir = make_temp_dir() + "/tmpfs";
  fs::create_directories(dir);
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, size_option(bytes).c_str()) != 0) {
    *why = "cannot mount a tmpfs on " + dir + ": " + std::strerror(errno) +
           " (needs root or CAP_SYS_ADMIN)";
    fs::remove(dir);
    return nullptr;
  }
  return std::unique_ptr<Tmpfs>(new Tmpfs(dir));
}

Tmpfs::~Tmpfs() {
  if (::umount2(dir_.c_str(), 0) != 0) ::umount2(dir_.c_str(), MNT_DETACH);
  std::error_code ec;
  fs::remove(dir_, ec);
}

void Tmpfs::resize(int64_t bytes) { remount(dir_, 0, size_option(bytes)); }

void Tmpfs::make_read_only() { remount(dir_, MS_RDONLY, ""); }

int64_t tmpfs_bytes(const std::string& dir) {
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  int64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file())
      total += (static_cast<int64_t>(e.file_size()) + page - 1) / page * page;
  return total;
}

}  // namespace ft::test
