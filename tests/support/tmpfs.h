// Test support: a tmpfs mounted for one test (a small filesystem to fill, one to make read-only),
// unmounted when its guard goes out of scope, whatever becomes of the test. Mounting needs root
// or CAP_SYS_ADMIN; where it is refused the test skips visibly (skip_test), never passes. Not
// thread-safe; one test thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace ft::test {

class Tmpfs {
 public:
  // A tmpfs of `bytes` mounted on a new directory; null, with the reason in `why`, when mounting
  // is not allowed here.
  static std::unique_ptr<Tmpfs> mount(int64_t bytes, std::string* why);
  ~Tmpfs();  // unmounts (lazily when something still holds it) and removes the directory
  Tmpfs(const Tmpfs&) = delete;
  Tmpfs& operator=(const Tmpfs&) = delete;

  const std::string& dir() const { return dir_; }
  // Remounts with another size, the files kept (std::runtime_error when it cannot).
  void resize(int64_t bytes);
  // Remounts read-only (std::runtime_error when it cannot).
  void make_read_only();

 private:
  explicit Tmpfs(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

// The bytes a directory tree's files take on a tmpfs: each file rounded up to whole pages.
int64_t tmpfs_bytes(const std::string& dir);

}  // namespace ft::test
