// PCRE2 regular expressions (UTF + Unicode properties, JIT) standing in for the Oniguruma
// patterns of tokenizer.json. Owns the compiled pattern; immutable after construction, so one
// Regex may be used from many threads (each call brings its own match data).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ft::tokenizer {

class Regex {
 public:
  // Compiles an Oniguruma (Ruby syntax) pattern as HF `tokenizers` does: the escapes whose
  // meaning differs in PCRE2 are rewritten (\s also matches U+0085 there, \h is a hex digit).
  // Throws std::invalid_argument with PCRE2's message and the offset on a bad pattern, or for
  // constructs that would silently match differently (a nested [class] or \S inside a class).
  // ^ and $ are line anchors, as in Ruby.
  static Regex oniguruma(std::string_view pattern);
  // Compiles a PCRE2 pattern as is.
  static Regex pcre2(std::string_view pattern);

  // Every non-overlapping match in `text`, left to right, as Oniguruma's find_iter reports them:
  // after an empty match the search moves one character on, and an empty match right where the
  // previous match ended is skipped. `text` must be valid UTF-8 (callers validate once).
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const;

  // Whether the pattern matches somewhere in `text` (valid UTF-8).
  bool search(std::string_view text) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  Regex(std::string pattern, bool oniguruma);
  // Runs one match from `start`; returns false when there is none. Throws ft::FormatError on
  // PCRE2 errors (its match limit: a pattern that backtracks without end).
  bool match_at(std::string_view text, size_t start, void* match_data, size_t* begin,
                size_t* end) const;

  std::string pattern_;
  std::shared_ptr<const Code> code_;
};

}  // namespace ft::tokenizer
