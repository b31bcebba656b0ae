// A template's text and where it came from, and the errors that point into it: every parse and
// render error names the origin ("model/tokenizer_config.json chat_template") and line:column,
// with the line quoted and a caret under the column. Immutable after construction; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "core/error.h"

namespace ft::jinja {

// A template that does not parse, or fails while rendering (including raise_exception). Exit
// code 2, as every bad input file.
class TemplateError : public FormatError {
 public:
  using FormatError::FormatError;
};

struct Pos {
  int line = 1;
  int col = 1;
};

class Source {
 public:
  // Newlines are normalised as jinja2 does (\r\n and \r become \n) and one trailing newline is
  // dropped (keep_trailing_newline=False).
  Source(std::string text, std::string origin);

  const std::string& text() const { return text_; }
  const std::string& origin() const { return origin_; }
  Pos pos_of(size_t offset) const;
  // "origin:line:col: msg" and the quoted line with a caret.
  std::string describe(Pos pos, const std::string& msg) const;
  [[noreturn]] void fail(Pos pos, const std::string& msg) const;

 private:
  std::string text_;
  std::string origin_;
  std::vector<size_t> line_starts_;
};

}  // namespace ft::jinja
