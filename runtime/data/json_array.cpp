#include "data/json_array.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace ft::data {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// The scan of one top-level array, a character at a time (the file is read in chunks, so no
// state may live in a chunk). An element's extent is found without parsing it: brackets and
// braces are counted outside strings, and a bare value (a number, true) ends at the next ',', ']'
// or whitespace. Parsing, and the check that each element is a record, happen when it is read.
class ArrayScanner {
 public:
  explicit ArrayScanner(const std::string& path) : path_(path) {}

  struct Extent {
    uint64_t offset, length;
    int64_t line;
  };
  std::vector<Extent> extents;

  void feed(char c, uint64_t pos) {
    switch (state_) {
      case State::kBeforeArray:
        if (is_space(c) || (pos < 3 && static_cast<unsigned char>(c) == kBom[pos])) break;
        if (c != '[') fail("a JSON array file must begin with '['");
        state_ = State::kFirstValue;
        break;
      case State::kFirstValue:
      case State::kValue:
        begin_value(c, pos);
        break;
      case State::kInValue:
        in_value(c, pos);
        break;
      case State::kAfterValue:
        after_value(c);
        break;
      case State::kAfterArray:
        if (!is_space(c))
          fail(
              "text after the array's closing ']': a JSON array file holds one array (JSON "
              "Lines, one record per line, is read when the file does not begin with '[')");
        break;
    }
    if (c == '\n') ++line_;
  }

  // After the file's last byte, at offset `end`.
  void finish(uint64_t end) {
    if (state_ == State::kInValue && bare_) end_value(end);
    if (state_ == State::kBeforeArray) fail("no JSON array in the file");
    if (state_ != State::kAfterArray)
      fail(detail::cat("the file ends inside the array (a truncated file?) after ", extents.size(),
                       " element(s)"));
  }

 private:
  enum class State { kBeforeArray, kFirstValue, kValue, kInValue, kAfterValue, kAfterArray };
  static constexpr unsigned char kBom[3] = {0xef, 0xbb, 0xbf};

  void begin_value(char c, uint64_t pos) {
    if (is_space(c)) return;
    if (c == ']') {
      if (state_ == State::kValue) fail("a ',' with no element after it, before ']'");
      state_ = State::kAfterArray;
      return;
    }
    if (c == ',') fail("an empty element (a ',' after '[' or another ',')");
    start_ = pos;
    start_line_ = line_;
    in_string_ = c == '"';
    depth_ = c == '{' || c == '[' ? 1 : 0;
    bare_ = !in_string_ && depth_ == 0;
    state_ = State::kInValue;
  }

  void in_value(char c, uint64_t pos) {
    if (bare_) {
      if (is_space(c) || c == ',' || c == ']') {
        end_value(pos);
        after_value(c);
      }
    } else if (in_string_) {
      if (escaped_) {
        escaped_ = false;
      } else if (c == '\\') {
        escaped_ = true;
      } else if (c == '"') {
        in_string_ = false;
        if (depth_ == 0) end_value(pos + 1);
      }
    } else if (c == '"') {
      in_string_ = true;
    } else if (c == '{' || c == '[') {
      ++depth_;
    } else if ((c == '}' || c == ']') && --depth_ == 0) {
      end_value(pos + 1);
    }
  }

  void after_value(char c) {
    if (is_space(c)) return;
    if (c == ',')
      state_ = State::kValue;
    else if (c == ']')
      state_ = State::kAfterArray;
    else
      fail(
          detail::cat("element ", extents.size() - 1, " is followed by '", c, "', not ',' or ']'"));
  }

  void end_value(uint64_t end) {
    extents.push_back({start_, end - start_, start_line_});
    bare_ = false;
    state_ = State::kAfterValue;
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(detail::cat(path_, ":", line_, ": not a JSON array of records: ", what));
  }

  const std::string& path_;
  State state_ = State::kBeforeArray;
  int64_t line_ = 1;
  uint64_t start_ = 0;
  int64_t start_line_ = 1;
  int64_t depth_ = 0;
  bool in_string_ = false, escaped_ = false, bare_ = false;
};

}  // namespace

JsonArrayIndex::JsonArrayIndex(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  FT_CHECK_T(FormatError, fd_ >= 0, path_, ": cannot open the data file: ", std::strerror(errno));
  ArrayScanner scan(path_);
  std::vector<char> buf(1 << 20);
  uint64_t pos = 0;
  try {
    for (;;) {
      const ssize_t n = ::pread(fd_, buf.data(), buf.size(), static_cast<off_t>(pos));
      if (n < 0 && errno == EINTR) continue;
      FT_CHECK_T(FormatError, n >= 0, path_, ": read failed at byte ", pos, ": ",
                 std::strerror(errno));
      if (n == 0) break;
      for (ssize_t i = 0; i < n; ++i, ++pos) scan.feed(buf[i], pos);
    }
    scan.finish(pos);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
  entries_.reserve(scan.extents.size());
  for (const auto& e : scan.extents) entries_.push_back({e.offset, e.length, e.line});
}

JsonArrayIndex::~JsonArrayIndex() {
  if (fd_ >= 0) ::close(fd_);
}

std::string JsonArrayIndex::read(int64_t i) const {
  FT_ASSERT(i >= 0 && i < size(), "element ", i, " of ", size());
  const Entry& e = entries_[static_cast<size_t>(i)];
  std::string text(e.length, '\0');
  uint64_t done = 0;
  while (done < e.length) {
    const ssize_t n =
        ::pread(fd_, text.data() + done, e.length - done, static_cast<off_t>(e.offset + done));
    if (n < 0 && errno == EINTR) continue;
    FT_CHECK_T(FormatError, n > 0, origin(i), ": read failed",
               n < 0 ? std::string(": ") + std::strerror(errno)
                     : std::string(": the file shrank after it was indexed"));
    done += static_cast<uint64_t>(n);
  }
  return text;
}

std::string JsonArrayIndex::origin(int64_t i) const {
  return detail::cat(path_, ":", entries_[static_cast<size_t>(i)].line, " (element ", i, ")");
}

bool starts_json_array(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[4096];
  bool array = false;
  uint64_t pos = 0;
  for (;;) {
    const ssize_t n = ::pread(fd, buf, sizeof buf, static_cast<off_t>(pos));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    ssize_t i = 0;
    if (pos == 0 && n >= 3 && std::memcmp(buf, "\xef\xbb\xbf", 3) == 0) i = 3;
    while (i < n && is_space(buf[i])) ++i;
    if (i < n) {
      array = buf[i] == '[';
      break;
    }
    pos += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return array;
}

}  // namespace ft::data
