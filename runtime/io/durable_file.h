// The one durable write, for every file a later run reads: bytes go to `path + ".tmp"` beside the
// target, are fsync'ed and renamed over it, then the directory is fsync'ed; on any failure the
// temporary is removed and the target left as it was. A full disk (ENOSPC, EDQUOT) is reported
// with the file, the free space of its filesystem and the bytes the file needed. One thread per
// DurableFile, one per target.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ft::io {

// A file written in pieces (a header, then tensor after tensor) and replaced in one step.
class DurableFile {
 public:
  // Creates (truncates) the temporary `path + ".tmp"`: a crash's leftover is reused, not piled
  // up. SystemError naming the temporary when it cannot be created (no such directory, no
  // permission). `expected_bytes` (0: unknown), the size the file will have, only words a
  // disk-full error.
  explicit DurableFile(std::string path, uint64_t expected_bytes = 0);
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;
  // Without a successful commit(): closes and removes the temporary; `path` is untouched.
  ~DurableFile();

  // Appends to the temporary. SystemError naming it (disk full, file-size limit); on a full disk
  // the partial temporary is removed first, and the message gives the space left without it.
  void write(const void* data, uint64_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  // fsync, close, rename over `path`, fsync of the directory. SystemError naming the file; a
  // failure before the rename leaves `path` unchanged. Call once.
  void commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return tmp_; }

 private:
  // Throws errno's error of `op` on the temporary; a full disk gets its own message.
  [[noreturn]] void fail(const char* op, int line);

  std::string path_;
  std::string tmp_;
  uint64_t expected_ = 0;  // bytes the file will have; 0: unknown
  uint64_t written_ = 0;
  int fd_ = -1;
  bool committed_ = false;
};

// Writes `bytes` as the whole of `path` through a DurableFile.
void write_file_durably(const std::string& path, std::string_view bytes);

// Copies the file `src` to `dst` through a DurableFile, 8 MiB at a time. SystemError naming the
// file that failed.
void copy_file_durably(const std::string& src, const std::string& dst);

// fsync of directory `dir` ("" is the current one): makes a rename, creation or removal of an
// entry in it durable. SystemError naming the directory.
void fsync_dir(const std::string& dir);

// fsync_dir of the directory that holds `path`.
void fsync_parent_dir(const std::string& path);

}  // namespace ft::io
