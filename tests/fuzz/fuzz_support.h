// What the harnesses of tests/fuzz/ share: a scratch directory for parsers that only read files,
// splitting one input into parts, and the rule for what is a finding. ft's typed errors (ft::Error
// and its subclasses) are the expected answer to bad input, except an FT_ASSERT's "internal error",
// which no input may reach; every other exception escapes to libFuzzer, which reports it as a crash
// (a user would get an untyped error or a stack trace). One fuzzing thread per process: not
// thread-safe.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace ft::fuzz {

// A directory of this process's own, made on first use: under $FT_FUZZ_TMP, which scripts/fuzz.sh
// sets and removes afterwards (with what a crashed harness left), else on /dev/shm where there is
// one (a file is written per input, and tmpfs makes that and its fsync cheap), else under $TMPDIR,
// and then removed at exit.
inline const std::string& scratch_dir() {
  // Never destroyed: the exit handler that removes it runs after static destructors would.
  static const std::string& dir = *new std::string([] {
    std::string base = "/tmp";
    if (const char* t = std::getenv("TMPDIR"); t && *t) base = t;
    if (std::filesystem::is_directory("/dev/shm")) base = "/dev/shm";
    const char* owned = std::getenv("FT_FUZZ_TMP");
    if (owned && *owned) base = owned;
    std::filesystem::create_directories(base);
    std::string templ = base + "/ft-fuzz-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      std::perror(("mkdtemp " + templ).c_str());
      std::abort();
    }
    if (!owned || !*owned) {
      std::atexit([] {
        std::error_code ec;
        std::filesystem::remove_all(scratch_dir(), ec);
      });
    }
    return templ;
  }());
  return dir;
}

// `bytes` as the whole content of `path` (replacing it).
inline void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "fuzz harness: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// Runs `f`, treating ft's typed errors as the expected outcome of bad input.
template <class F>
void expect_ft_errors(F&& f) {
  try {
    f();
  } catch (const ft::Error& e) {
    if (std::string_view(e.what()).rfind("internal error", 0) == 0) {
      std::fprintf(stderr, "fuzz harness: input reached an FT_ASSERT: %s\n", e.what());
      std::abort();
    }
  }
}

// A harness's own property check: aborts (a finding) with `what` when `ok` is false.
inline void require(bool ok, const std::string& what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz harness: property violated: %s\n", what.c_str());
  std::abort();
}

// `text` cut at each `sep` into at most `max_parts` parts (the last one keeps the rest).
inline std::vector<std::string_view> split(std::string_view text, std::string_view sep,
                                           size_t max_parts) {
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    const size_t at = text.find(sep);
    if (at == std::string_view::npos) break;
    parts.push_back(text.substr(0, at));
    text.remove_prefix(at + sep.size());
  }
  parts.push_back(text);
  return parts;
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace ft::fuzz
