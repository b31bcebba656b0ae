#include "io/durable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/strings.h"
#include "io/storage.h"

namespace ft::io {

namespace {
// A descriptor, closed when it goes out of scope (after throw_errno has read errno).
struct Fd {
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd != -1) ::close(fd);
  }
  const int fd;
};
}  // namespace

DurableFile::DurableFile(std::string path, uint64_t expected_bytes)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), expected_(expected_bytes) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ == -1) throw_errno("open '" + tmp_ + "' for writing", __FILE__, __LINE__);
}

DurableFile::~DurableFile() {
  if (fd_ != -1) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void DurableFile::write(const void* data, uint64_t size) {
  FT_ASSERT(fd_ != -1, "write to '", tmp_, "' after commit()");
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    // Linux moves at most ~2 GiB per write(); loop over short writes too.
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(size, 1ull << 30));
    const ssize_t n = ::write(fd_, p, chunk);
    if (n == -1) {
      if (errno == EINTR) continue;
      fail("write", __LINE__);
    }
    p += n;
    size -= static_cast<uint64_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
}

void DurableFile::fail(const char* op, int line) {
  const int err = errno;
  if (err != ENOSPC && err != EDQUOT) throw_errno(fmt::format("{} '{}'", op, tmp_), __FILE__, line);
  // The partial file goes first: the space it held is free again, and what is reported is what
  // the filesystem has without it.
  if (fd_ != -1) ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
  const std::string need =
      expected_ > 0 ? fmt::format("the file needs {}", human_bytes(static_cast<int64_t>(expected_)))
                    : std::string("the file's size was not known");
  throw SystemError(fmt::format(
      "cannot write '{}': {} (errno {}) during {} of its temporary: {}; {}, {} had been written "
      "(the partial file was removed) at {}:{}",
      path_, std::strerror(err), err, op,
      describe_space(space_at(std::filesystem::path(path_).parent_path().string())), need,
      human_bytes(static_cast<int64_t>(written_)), __FILE__, line));
}

void DurableFile::commit() {
  FT_ASSERT(fd_ != -1, "commit() of '", path_, "' called twice");
  // Storage that allocates late (NFS, delayed allocation) reports a full disk here.
  if (::fsync(fd_) == -1) fail("fsync", __LINE__);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) == -1) fail("close", __LINE__);
  if (::rename(tmp_.c_str(), path_.c_str()) == -1)
    throw_errno("rename '" + tmp_ + "' to '" + path_ + "'", __FILE__, __LINE__);
  committed_ = true;
  fsync_parent_dir(path_);
}

void write_file_durably(const std::string& path, std::string_view bytes) {
  DurableFile out(path, bytes.size());
  out.write(bytes);
  out.commit();
}

void copy_file_durably(const std::string& src, const std::string& dst) {
  const Fd in(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
  if (in.fd == -1) throw_errno("open '" + src + "'", __FILE__, __LINE__);
  struct stat st {};
  DurableFile out(dst, ::fstat(in.fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0);
  std::vector<char> buf(8 << 20);
  for (;;) {
    const ssize_t n = ::read(in.fd, buf.data(), buf.size());
    if (n == -1 && errno == EINTR) continue;
    if (n == -1) throw_errno("read '" + src + "'", __FILE__, __LINE__);
    if (n == 0) break;
    out.write(buf.data(), static_cast<uint64_t>(n));
  }
  out.commit();
}

void fsync_dir(const std::string& dir) {
  const std::string d = dir.empty() ? "." : dir;
  const Fd fd(::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.fd == -1) throw_errno("open directory '" + d + "'", __FILE__, __LINE__);
  if (::fsync(fd.fd) == -1) throw_errno("fsync directory '" + d + "'", __FILE__, __LINE__);
}

void fsync_parent_dir(const std::string& path) {
  fsync_dir(std::filesystem::path(path).parent_path().string());
}

}  // namespace ft::io
