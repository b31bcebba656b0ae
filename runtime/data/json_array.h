// An index of the elements of a file holding one JSON array of records (`[{...}, {...}]`, as
// LLaMA-Factory's and Alpaca's .json datasets are written): one scan finds each element's bytes,
// then records are read by seeking, so a file larger than RAM is streamed, never loaded. The
// reader behind record_file.h's open_record_file for such files.
// Owns the index and an open descriptor; read() uses pread(), so it is thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ft::data {

class JsonArrayIndex {
 public:
  // Scans `path` once. Throws ft::FormatError naming the file and line when it is not one JSON
  // array (a missing '[', an element not followed by ',' or ']', a ',' before ']', text after
  // the closing ']', a file that ends inside the array) or cannot be read. The elements
  // themselves are checked when read: each must be a record, a JSON object.
  explicit JsonArrayIndex(std::string path);
  ~JsonArrayIndex();
  JsonArrayIndex(const JsonArrayIndex&) = delete;
  JsonArrayIndex& operator=(const JsonArrayIndex&) = delete;

  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  // Element i (0 <= i < size()) as its JSON text.
  std::string read(int64_t i) const;
  // Where element i is, for messages: "train.json:42 (element 17)" (1-based line of its first
  // character, 0-based index as Python's data[17]).
  std::string origin(int64_t i) const;

 private:
  struct Entry {
    uint64_t offset;  // byte offset of the element's first character
    uint64_t length;
    int64_t line;  // 1-based line of that character
  };
  std::string path_;
  int fd_ = -1;
  std::vector<Entry> entries_;
};

// Whether the text file at `path` begins (after whitespace and a UTF-8 byte order mark) with '[':
// a JSON array rather than JSON Lines.
bool starts_json_array(const std::string& path);

}  // namespace ft::data
