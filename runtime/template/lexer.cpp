#include "template/lexer.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/strings.h"

namespace ft::jinja {
namespace {

bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

class Lexer {
 public:
  explicit Lexer(const Source& src) : src_(src), s_(src.text()) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    // How the previous tag's end treats the text after it: nothing, strip all whitespace (`-`).
    bool strip_next = false;
    while (pos <= s_.size()) {
      size_t k = find_tag(pos);
      std::string text = s_.substr(pos, k - pos);
      if (strip_next) {
        size_t b = 0;
        while (b < text.size() && is_ws(text[b])) ++b;
        text.erase(0, b);
      }
      strip_next = false;
      if (k == s_.size()) {
        emit_text(std::move(text), pos);
        break;
      }
      const char kind = s_[k + 1];
      const char sign = k + 2 < s_.size() ? s_[k + 2] : '\0';
      if (sign == '-') {
        size_t e = text.size();
        while (e > 0 && is_ws(text[e - 1])) --e;
        text.resize(e);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: spaces and tabs from the line's start up to a block or comment tag.
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size()) {
          bool only_ws = true;
          for (size_t i = l_pos; i < text.size(); ++i) only_ws = only_ws && is_ws(text[i]);
          if (only_ws) text.resize(l_pos);
        }
      }
      emit_text(std::move(text), pos);
      size_t after = k + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      size_t end;  // one past the closing tag
      if (kind == '#') {
        end = close_comment(k, after, &strip_next);
      } else {
        end = lex_tag(k, after, kind == '{', &strip_next);
      }
      // trim_blocks: one newline after a block or comment tag (not after `+%}` or `}}`).
      const bool block_like = kind != '{';
      if (block_like && !strip_next && !plus_end_ && end < s_.size() && s_[end] == '\n') ++end;
      line_starting = end > 0 && s_[end - 1] == '\n';
      if (strip_next) {
        size_t e = end;
        while (e < s_.size() && is_ws(s_[e])) ++e;
        line_starting = e > end ? s_[e - 1] == '\n' : line_starting;
        end = e;
        strip_next = false;
      }
      pos = end;
      if (pos == s_.size()) break;
    }
    Token eof;
    eof.kind = Tok::kEnd;
    eof.pos = src_.pos_of(s_.size());
    out_.push_back(eof);
    return std::move(out_);
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < s_.size(); ++i) {
      if (s_[i] == '{' && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    }
    return s_.size();
  }

  void emit_text(std::string text, size_t at) {
    if (text.empty()) return;
    Token t;
    t.kind = Tok::kText;
    t.text = std::move(text);
    t.pos = src_.pos_of(at);
    out_.push_back(std::move(t));
  }

  void push(Tok kind, size_t at, std::string text = {}) {
    Token t;
    t.kind = kind;
    t.text = std::move(text);
    t.pos = src_.pos_of(at);
    out_.push_back(std::move(t));
  }

  size_t close_comment(size_t open, size_t from, bool* strip_after) {
    const size_t e = s_.find("#}", from);
    if (e == std::string::npos)
      src_.fail(src_.pos_of(open), "comment `{#` is never closed by `#}`");
    *strip_after = e > from && s_[e - 1] == '-';
    plus_end_ = e > from && s_[e - 1] == '+';
    return e + 2;
  }

  // Tokens of one `{{ ... }}` or `{% ... %}`; returns the offset after its end.
  size_t lex_tag(size_t open, size_t i, bool variable, bool* strip_after) {
    push(variable ? Tok::kVarBegin : Tok::kBlockBegin, open);
    int depth = 0;  // brackets open inside the tag: `}}` in `{{ {'a': {}} }}` does not end it
    plus_end_ = false;
    while (true) {
      while (i < s_.size() && is_ws(s_[i])) ++i;
      if (i >= s_.size()) {
        src_.fail(src_.pos_of(open),
                  variable ? "`{{` is never closed by `}}`" : "`{%` is never closed by `%}`");
      }
      if (depth == 0) {
        const char* close = variable ? "}}" : "%}";
        for (const char* sign : {"-", "+", ""}) {
          const std::string end = std::string(sign) + close;
          if (s_.compare(i, end.size(), end) == 0 && (variable ? *sign != '+' : true)) {
            push(variable ? Tok::kVarEnd : Tok::kBlockEnd, i);
            *strip_after = *sign == '-';
            plus_end_ = *sign == '+';
            return i + end.size();
          }
        }
      }
      const char c = s_[i];
      const size_t start = i;
      if (is_name_start(c)) {
        while (i < s_.size() && (is_name_start(s_[i]) || is_digit(s_[i]))) ++i;
        push(Tok::kName, start, s_.substr(start, i - start));
      } else if (is_digit(c)) {
        i = lex_number(i);
      } else if (c == '\'' || c == '"') {
        i = lex_string(i);
      } else {
        static const char* const kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                           "/",  "%",  "~",  "<",  ">",  "(",  ")", "[", "]",
                                           "{",  "}",  ",",  ".",  ":",  "|",  "=", ";"};
        const char* found = nullptr;
        for (const char* op : kOps) {
          if (s_.compare(i, std::strlen(op), op) == 0) {
            found = op;
            break;
          }
        }
        if (!found) {
          src_.fail(src_.pos_of(i),
                    detail::cat("unexpected character '", std::string(1, c), "' inside a tag"));
        }
        if (*found == '(' || *found == '[' || *found == '{') ++depth;
        if (*found == ')' || *found == ']' || *found == '}') {
          if (depth == 0) src_.fail(src_.pos_of(i), detail::cat("unexpected '", found, "'"));
          --depth;
        }
        push(Tok::kOp, i, found);
        i += std::strlen(found);
      }
    }
  }

  size_t lex_number(size_t i) {
    const size_t start = i;
    auto digits = [&] {
      while (i < s_.size() &&
             (is_digit(s_[i]) || (s_[i] == '_' && i + 1 < s_.size() && is_digit(s_[i + 1])))) {
        ++i;
      }
    };
    digits();
    bool is_float = false;
    // `x.0` after a dot is an attribute, not a float (jinja2's `(?<!\.)`).
    const bool after_dot = !out_.empty() && out_.back().kind == Tok::kOp && out_.back().text == ".";
    if (!after_dot && i + 1 < s_.size() && s_[i] == '.' && is_digit(s_[i + 1])) {
      is_float = true;
      ++i;
      digits();
    }
    if (!after_dot && i < s_.size() && (s_[i] == 'e' || s_[i] == 'E')) {
      size_t j = i + 1;
      if (j < s_.size() && (s_[j] == '+' || s_[j] == '-')) ++j;
      if (j < s_.size() && is_digit(s_[j])) {
        is_float = true;
        i = j;
        digits();
      }
    }
    std::string text;
    for (size_t k = start; k < i; ++k) {
      if (s_[k] != '_') text += s_[k];
    }
    Token t;
    t.pos = src_.pos_of(start);
    t.text = text;
    if (is_float) {
      t.kind = Tok::kFloat;
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      t.kind = Tok::kInt;
      errno = 0;
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) src_.fail(t.pos, "integer literal " + text + " is too large");
    }
    out_.push_back(std::move(t));
    return i;
  }

  // A quoted string, decoded as Python's unicode-escape does (\n, \t, \\, \', \xhh, \uhhhh, ...);
  // an unknown escape keeps its backslash.
  size_t lex_string(size_t i) {
    const char q = s_[i];
    const size_t start = i++;
    std::string out;
    while (true) {
      if (i >= s_.size()) src_.fail(src_.pos_of(start), "string literal is never closed");
      const char c = s_[i];
      if (c == q) break;
      if (c != '\\') {
        out += c;
        ++i;
        continue;
      }
      if (i + 1 >= s_.size()) src_.fail(src_.pos_of(start), "string literal is never closed");
      const char e = s_[i + 1];
      i += 2;
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case '\n':
          break;  // a backslash before a newline joins the lines
        case 'x':
        case 'u':
        case 'U': {
          const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (size_t k = 0; k < n; ++k) {
            const char h = i + k < s_.size() ? s_[i + k] : '\0';
            int d = (h >= '0' && h <= '9')   ? h - '0'
                    : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                    : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                             : -1;
            if (d < 0) {
              src_.fail(src_.pos_of(i - 2),
                        detail::cat("truncated \\", std::string(1, e), " escape in a string"));
            }
            cp = cp * 16 + static_cast<uint32_t>(d);
          }
          if (cp > 0x10FFFF) src_.fail(src_.pos_of(i - 2), "escape beyond U+10FFFF in a string");
          append_utf8(static_cast<char32_t>(cp), out);
          i += n;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && i < s_.size() && s_[i] >= '0' && s_[i] <= '7'; ++k, ++i) {
              cp = cp * 8 + static_cast<uint32_t>(s_[i] - '0');
            }
            append_utf8(static_cast<char32_t>(cp), out);
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    push(Tok::kString, start, std::move(out));
    return i + 1;
  }

  const Source& src_;
  const std::string& s_;
  std::vector<Token> out_;
  bool plus_end_ = false;
};

}  // namespace

std::vector<Token> tokenize(const Source& source) { return Lexer(source).run(); }

}  // namespace ft::jinja
