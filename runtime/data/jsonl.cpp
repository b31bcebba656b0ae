#include "data/jsonl.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace ft::data {
namespace {

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }

}  // namespace

JsonlIndex::JsonlIndex(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  FT_CHECK_T(FormatError, fd_ >= 0, path_, ": cannot open the data file: ", std::strerror(errno));
  // One pass in fixed-size chunks: memory is the index, not the file.
  std::vector<char> buf(1 << 20);
  uint64_t pos = 0, line_start = 0;
  int64_t line = 1;
  bool has_content = false;
  for (;;) {
    const ssize_t n = ::pread(fd_, buf.data(), buf.size(), static_cast<off_t>(pos));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string err = std::strerror(errno);
      ::close(fd_);
      throw FormatError(detail::cat(path_, ": read failed at byte ", pos, ": ", err));
    }
    if (n == 0) break;
    for (ssize_t i = 0; i < n; ++i, ++pos) {
      const char c = buf[i];
      if (c == '\n') {
        if (has_content) entries_.push_back({line_start, pos - line_start, line});
        ++line;
        line_start = pos + 1;
        has_content = false;
      } else if (!is_blank(c)) {
        has_content = true;
      }
    }
  }
  if (has_content) entries_.push_back({line_start, pos - line_start, line});  // no final newline
}

JsonlIndex::~JsonlIndex() {
  if (fd_ >= 0) ::close(fd_);
}

JsonlLine JsonlIndex::read(int64_t i) const {
  FT_ASSERT(i >= 0 && i < size(), "record ", i, " of ", size());
  const Entry& e = entries_[static_cast<size_t>(i)];
  JsonlLine out;
  out.line = e.line;
  out.text.resize(e.length);
  uint64_t done = 0;
  while (done < e.length) {
    const ssize_t n =
        ::pread(fd_, out.text.data() + done, e.length - done, static_cast<off_t>(e.offset + done));
    if (n < 0 && errno == EINTR) continue;
    FT_CHECK_T(FormatError, n > 0, path_, ":", e.line, ": read failed",
               n < 0 ? std::string(": ") + std::strerror(errno)
                     : std::string(": the file shrank after it was indexed"));
    done += static_cast<uint64_t>(n);
  }
  if (!out.text.empty() && out.text.back() == '\r') out.text.pop_back();
  return out;
}

}  // namespace ft::data
