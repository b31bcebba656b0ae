#include "template/source.h"

#include <algorithm>

namespace ft::jinja {

Source::Source(std::string text, std::string origin) : origin_(std::move(origin)) {
  text_.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\r') {
      text_ += '\n';
      if (i + 1 < text.size() && text[i + 1] == '\n') ++i;
    } else {
      text_ += text[i];
    }
  }
  if (!text_.empty() && text_.back() == '\n') text_.pop_back();
  line_starts_.push_back(0);
  for (size_t i = 0; i < text_.size(); ++i) {
    if (text_[i] == '\n') line_starts_.push_back(i + 1);
  }
}

Pos Source::pos_of(size_t offset) const {
  auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
  const size_t line = static_cast<size_t>(it - line_starts_.begin());  // 1-based
  const size_t start = line_starts_[line - 1];
  int col = 1;  // in code points
  for (size_t i = start; i < offset && i < text_.size(); ++i) {
    col += (static_cast<unsigned char>(text_[i]) & 0xC0) != 0x80;
  }
  return {static_cast<int>(line), col};
}

std::string Source::describe(Pos pos, const std::string& msg) const {
  std::string out = detail::cat(origin_, ":", pos.line, ":", pos.col, ": ", msg);
  if (pos.line < 1 || static_cast<size_t>(pos.line) > line_starts_.size()) return out;
  const size_t start = line_starts_[static_cast<size_t>(pos.line) - 1];
  size_t end = text_.find('\n', start);
  if (end == std::string::npos) end = text_.size();
  std::string line = text_.substr(start, end - start);
  // Long lines (templates written on one line) are quoted around the column.
  size_t col = static_cast<size_t>(pos.col - 1), from = 0;
  size_t byte = 0;
  for (size_t k = 0; k < col && byte < line.size(); ++k) {
    ++byte;
    while (byte < line.size() && (static_cast<unsigned char>(line[byte]) & 0xC0) == 0x80) ++byte;
  }
  if (byte > 60) from = byte - 40;
  while (from > 0 && (static_cast<unsigned char>(line[from]) & 0xC0) == 0x80) --from;
  std::string shown = line.substr(from, 100);
  // Do not cut the last character apart.
  size_t k = shown.size();
  while (k > 0 && (static_cast<unsigned char>(shown[k - 1]) & 0xC0) == 0x80) --k;
  if (k > 0) {
    const unsigned char lead = static_cast<unsigned char>(shown[k - 1]);
    const size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    if (shown.size() - (k - 1) < need) shown.resize(k - 1);
  }
  size_t caret = 0;
  for (size_t i = from; i < byte && i < line.size(); ++i) {
    caret += (static_cast<unsigned char>(line[i]) & 0xC0) != 0x80;
  }
  out += "\n  " + std::string(from > 0 ? "..." : "") + shown;
  out += "\n  " + std::string(caret + (from > 0 ? 3 : 0), ' ') + "^";
  return out;
}

void Source::fail(Pos pos, const std::string& msg) const {
  throw TemplateError(describe(pos, msg));
}

}  // namespace ft::jinja
