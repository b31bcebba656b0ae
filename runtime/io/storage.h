// The storage under a path, as a writer needs to know it: the free space of its filesystem (to
// word a disk-full error and to warn before a save that cannot fit) and whether this process can
// create files there at all (to refuse an unwritable --output before anything is loaded).
// Stateless; thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace ft::io {

// The filesystem of `path`, measured at its nearest directory that exists (`path` itself when it
// does).
struct Space {
  std::string dir;           // the directory measured
  int64_t free_bytes = -1;   // what an unprivileged writer may still use (f_bavail); -1: unknown
  int64_t total_bytes = -1;  // the filesystem's size; -1: unknown
  bool read_only = false;    // mounted read-only
};
Space space_at(const std::string& path);

// "512.0 KiB free of 2.0 MiB on the filesystem of DIR", for error messages.
std::string describe_space(const Space& space);

// Refuses (ConfigError, exit 2) a directory this process cannot write into: `dir` itself when it
// exists, else the nearest parent that exists, in which it would be created. The message names
// `flag` ("--output"), the directory, why (a read-only filesystem, no write permission, a file in
// the way) and what to do. Writes nothing.
void check_writable_dir(const std::string& dir, const std::string& flag);

}  // namespace ft::io
