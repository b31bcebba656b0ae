// Tokens to a syntax tree, with jinja2's grammar and precedence (filters and tests bind tighter
// than arithmetic; `not` looser than comparisons). Nesting is limited (kMaxNesting) so hostile
// input cannot exhaust the stack. Pure function; thread-safe.
#pragma once

#include <vector>

#include "template/ast.h"
#include "template/lexer.h"

namespace ft::jinja {

inline constexpr int kMaxNesting = 200;

// Throws TemplateError naming origin:line:col for a syntax error, an unknown or unclosed block
// tag, or a statement ft does not implement (include, extends, import, recursive loops).
Body parse(const std::vector<Token>& tokens, const Source& source);

}  // namespace ft::jinja
