// An index of the records (non-empty lines) of a plain JSONL file: one scan records each line's
// byte offset, then records are read by seeking, so a file larger than RAM is streamed, never
// loaded. The JSONL reader behind record_file.h's open_record_file.
// Owns the index and an open descriptor; read() uses pread(), so it is thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ft::data {

struct JsonlLine {
  std::string text;  // the line without its newline (and without a trailing '\r')
  int64_t line = 0;  // 1-based line number in the file, for error messages
};

class JsonlIndex {
 public:
  // Scans `path` once. Lines holding only whitespace are not records. Throws ft::FormatError
  // naming the file when it cannot be opened or read.
  explicit JsonlIndex(std::string path);
  ~JsonlIndex();
  JsonlIndex(const JsonlIndex&) = delete;
  JsonlIndex& operator=(const JsonlIndex&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  // Record i (0 <= i < size()).
  JsonlLine read(int64_t i) const;
  // Record i's 1-based line number, without reading it.
  int64_t line_of(int64_t i) const { return entries_[static_cast<size_t>(i)].line; }

 private:
  struct Entry {
    uint64_t offset;  // byte offset of the line's first character
    uint64_t length;  // bytes before the newline
    int64_t line;     // 1-based
  };
  std::string path_;
  int fd_ = -1;
  std::vector<Entry> entries_;
};

}  // namespace ft::data
