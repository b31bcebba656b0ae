// Jinja source to tokens, with transformers' environment: trim_blocks and lstrip_blocks on, and
// the whitespace control signs (`{%-`, `-%}`, `{%+`, `+%}`, the same for `{{ }}` and `{# #}`).
// Text between tags becomes one token with the whitespace rules already applied; comments vanish.
// Pure function; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "template/source.h"

namespace ft::jinja {

enum class Tok {
  kText,        // literal output
  kVarBegin,    // {{
  kVarEnd,      // }}
  kBlockBegin,  // {%
  kBlockEnd,    // %}
  kName,
  kString,  // text: the decoded value
  kInt,
  kFloat,
  kOp,  // text: the operator ("+", "//", "==", "(", ...)
  kEnd,
};

struct Token {
  Tok kind = Tok::kEnd;
  std::string text;
  int64_t int_value = 0;
  double float_value = 0;
  Pos pos;
};

// Throws TemplateError (naming the origin, line and column) for an unclosed tag, comment or
// string, or a character that starts no token.
std::vector<Token> tokenize(const Source& source);

}  // namespace ft::jinja
