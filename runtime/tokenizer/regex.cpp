#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdexcept>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace ft::tokenizer {

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  const int n = pcre2_get_error_message(code, buf, sizeof(buf));
  return n < 0 ? "PCRE2 error " + std::to_string(code) : std::string(reinterpret_cast<char*>(buf));
}

// Rewrites the Oniguruma (Ruby syntax) escapes that PCRE2 reads differently. Oniguruma's \s is
// exactly Unicode White_Space, while PCRE2's lacks U+0085 and adds U+180E; its \w is
// Alphabetic|M|Nd|Pc where PCRE2's is L|N|_ ; its \h is a hexadecimal digit, PCRE2's a horizontal
// space; its \v is the vertical tab and \uHHHH a code point. What cannot be rewritten inside a
// character class, and Oniguruma's nested classes, are refused rather than guessed.
std::string translate_oniguruma(std::string_view p) {
  static constexpr const char* kSpace =
      "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
      "\\x{202F}\\x{205F}\\x{3000}";
  // Oniguruma's \w: Alphabetic, marks, decimal digits, connector punctuation; outside a class
  // also the Latin-1 No characters ² ³ ¹ ¼ ½ ¾ (compared with HF's over every code point).
  static constexpr const char* kWordInClass = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}";
  static constexpr const char* kWord =
      "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}";
  static constexpr const char* kHex = "0-9a-fA-F";
  auto refuse = [&](size_t at, const std::string& what) {
    throw std::invalid_argument(what + " at offset " + std::to_string(at) +
                                " is not supported (Oniguruma and PCRE2 differ there)");
  };
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 >= p.size()) throw std::invalid_argument("pattern ends with a lone backslash");
      const char e = p[++i];
      auto cls = [&](const char* body, bool negate) {
        if (in_class && negate) refuse(i - 1, std::string("\\") + e + " inside a character class");
        if (in_class) {
          out += body;
        } else {
          out += negate ? "[^" : "[";
          out += body;
          out += ']';
        }
      };
      switch (e) {
        case 's':
          cls(kSpace, false);
          break;
        case 'S':
          cls(kSpace, true);
          break;
        case 'w':
          cls(in_class ? kWordInClass : kWord, false);
          break;
        case 'W':
          cls(kWord, true);
          break;
        case 'h':
          cls(kHex, false);
          break;
        case 'H':
          cls(kHex, true);
          break;
        case 'b':
        case 'B':
          if (!in_class) refuse(i - 1, std::string("word boundary \\") + e);
          out += '\\';
          out += e;
          break;
        case 'v':  // Ruby: the vertical tab; PCRE2: any vertical white space
          out += "\\x{0B}";
          break;
        case 'u': {  // Ruby's \uHHHH, which PCRE2 does not read
          const std::string_view hex = p.substr(i + 1, 4);
          if (hex.size() != 4 || hex.find_first_not_of("0123456789abcdefABCDEF") != hex.npos) {
            refuse(i - 1, "\\u without four hex digits");
          }
          out += "\\x{";
          out.append(hex);
          out += '}';
          i += 4;
          break;
        }
        case 'V':
        case 'Q':
          refuse(i - 1, std::string("\\") + e);
          break;
        default:
          out += '\\';
          out += e;
      }
      continue;
    }
    if (!in_class) {
      out += c;
      if (c == '[') {
        in_class = true;
        // A ']' right after '[' or '[^' is a literal in both dialects.
        if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
        if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      }
      continue;
    }
    if (c == ']') {
      in_class = false;
      out += c;
    } else if (c == '[') {
      // Oniguruma nests classes, and its POSIX classes ([:alpha:]) are Unicode properties that
      // PCRE2 defines differently.
      refuse(i, i + 1 < p.size() && p[i + 1] == ':' ? "a POSIX class" : "a nested character class");
    } else if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') {
      refuse(i, "class intersection &&");
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

Regex::Regex(std::string pattern, bool oniguruma) : pattern_(std::move(pattern)) {
  auto code = std::make_shared<Code>();
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  // Ruby syntax makes ^ and $ line anchors, with "\n" the only line end; PCRE2's default newline
  // is a build option, so it is set explicitly.
  pcre2_compile_context* ctx = pcre2_compile_context_create(nullptr);
  if (ctx == nullptr) throw std::bad_alloc();
  pcre2_set_newline(ctx, PCRE2_NEWLINE_LF);
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | (oniguruma ? PCRE2_MULTILINE : 0u);
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern_.data()), pattern_.size(),
                             options, &err, &err_offset, ctx);
  pcre2_compile_context_free(ctx);
  if (code->code == nullptr) {
    throw std::invalid_argument(pcre2_message(err) + " at offset " + std::to_string(err_offset) +
                                " of PCRE2 pattern \"" + pattern_ + "\"");
  }
  // JIT is an optimisation only: where it is unavailable the interpreter gives the same matches.
  code->jit = pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE) == 0;
  code_ = std::move(code);
}

Regex Regex::oniguruma(std::string_view pattern) {
  return Regex(translate_oniguruma(pattern), true);
}

Regex Regex::pcre2(std::string_view pattern) { return Regex(std::string(pattern), false); }

namespace {

struct MatchData {
  explicit MatchData(const pcre2_code* code)
      : data(pcre2_match_data_create_from_pattern(code, nullptr)) {
    if (data == nullptr) throw std::bad_alloc();
  }
  ~MatchData() { pcre2_match_data_free(data); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
  pcre2_match_data* data;
};

}  // namespace

bool Regex::match_at(std::string_view text, size_t start, void* match_data, size_t* begin,
                     size_t* end) const {
  auto* md = static_cast<pcre2_match_data*>(match_data);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  // The caller validated the UTF-8 once; checking it again on every call would be quadratic.
  int rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    // Long runs (e.g. megabytes of spaces) can overflow JIT's small stack; the interpreter keeps
    // its backtracking state on the heap.
    rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                     md, nullptr);
  }
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    // A pattern of tokenizer.json that backtracks without end on this text (PCRE2's match limit):
    // the file's fault, and typed so that the data pipeline names the record.
    throw ft::FormatError("regex \"" + pattern_ + "\" failed on a " + std::to_string(text.size()) +
                          "-byte text: " + pcre2_message(rc));
  }
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(md);
  *begin = ovector[0];
  *end = ovector[1];
  return true;
}

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
  matches.clear();
  MatchData md(code_->code);
  size_t last_end = 0;
  bool have_last = false;
  size_t last_match_end = 0;
  while (last_end <= text.size()) {
    size_t begin = 0;
    size_t end = 0;
    if (!match_at(text, last_end, md.data, &begin, &end)) break;
    if (begin == end && have_last && last_match_end == end) {
      last_end += last_end < text.size() ? utf8_len(static_cast<unsigned char>(text[last_end])) : 1;
      continue;
    }
    last_end = end;
    last_match_end = end;
    have_last = true;
    matches.emplace_back(begin, end);
  }
}

bool Regex::search(std::string_view text) const {
  MatchData md(code_->code);
  size_t begin = 0;
  size_t end = 0;
  return match_at(text, 0, md.data, &begin, &end);
}

}  // namespace ft::tokenizer
