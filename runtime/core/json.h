// Reading JSON that ft did not write (presets, --set values, config.json, tokenizer.json, JSONL
// records, safetensors indexes, checkpoint metadata, store messages) without trusting its shape:
// a nesting limit checked before nlohmann parses (its parser and destructor recurse, and a text
// 100,000 levels deep overflowed the stack), and short excerpts of bad values for error messages.
// Pure functions; thread-safe.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>

namespace ft {

// No file ft reads nests deeper than a few levels; 256 leaves room and stays far from the stack's
// limit.
inline constexpr int kMaxJsonDepth = 256;

// The byte offset at which `text` opens its (max_depth + 1)-th nested array or object (brackets
// inside strings do not count), or std::string_view::npos when it nests no deeper than max_depth.
size_t json_too_deep_at(std::string_view text, int max_depth = kMaxJsonDepth);

// `s` as an error message may quote it: whole when short, else its first `max` characters, "...",
// and its length.
std::string excerpt(std::string_view s, size_t max = 80);
// A JSON value as an error message may quote it: its text (bytes that are not UTF-8 written as
// U+FFFD, where nlohmann's dump() would throw), excerpted as above.
std::string excerpt_json(const nlohmann::json& value, size_t max = 80);

// nlohmann::json::parse of `text` (J::parse: nlohmann::ordered_json keeps the key order), refused
// with an E naming `what` (a file, "file:line", a store key) when it nests deeper than
// kMaxJsonDepth or is not valid JSON.
template <class E, class J = nlohmann::json>
J parse_json(std::string_view text, const std::string& what) {
  const size_t at = json_too_deep_at(text);
  if (at != std::string_view::npos)
    throw E(fmt::format("{}: JSON nested deeper than {} levels (at byte {}); refused", what,
                        kMaxJsonDepth, at));
  try {
    return J::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {  // parse errors, numbers out of range
    throw E(fmt::format("{}: not valid JSON: {}", what, excerpt(e.what(), 200)));
  }
}

// The whole of the file at `path`, refused with an E naming it when it cannot be opened.
template <class E>
std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f.good()) throw E(fmt::format("{}: cannot be read", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace ft
