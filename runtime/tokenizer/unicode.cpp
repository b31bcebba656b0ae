#include "tokenizer/unicode.h"

#include "core/strings.h"

namespace ft::tokenizer {

namespace {

bool is_continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

// Length of the valid UTF-8 sequence at `pos`, or 0 when it is invalid there. The second-byte
// ranges exclude overlong encodings, surrogates and code points above U+10FFFF (RFC 3629).
size_t valid_sequence_len(std::string_view s, size_t pos) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  if (b0 < 0x80) return 1;
  const size_t n = s.size() - pos;
  auto at = [&](size_t i) { return static_cast<unsigned char>(s[pos + i]); };
  if (b0 >= 0xC2 && b0 <= 0xDF) return n >= 2 && is_continuation(at(1)) ? 2 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (n < 3) return 0;
    const unsigned char b1 = at(1);
    const bool ok1 = b0 == 0xE0   ? (b1 >= 0xA0 && b1 <= 0xBF)
                     : b0 == 0xED ? (b1 >= 0x80 && b1 <= 0x9F)
                                  : is_continuation(b1);
    return ok1 && is_continuation(at(2)) ? 3 : 0;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (n < 4) return 0;
    const unsigned char b1 = at(1);
    const bool ok1 = b0 == 0xF0   ? (b1 >= 0x90 && b1 <= 0xBF)
                     : b0 == 0xF4 ? (b1 >= 0x80 && b1 <= 0x8F)
                                  : is_continuation(b1);
    return ok1 && is_continuation(at(2)) && is_continuation(at(3)) ? 4 : 0;
  }
  return 0;
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t len = valid_sequence_len(s, pos);
    if (len == 0) return pos;
    pos += len;
  }
  return std::string_view::npos;
}

char32_t decode_utf8(std::string_view s, size_t pos, size_t* len) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  const size_t n = utf8_len(b0);
  *len = n;
  if (n == 1) return b0;
  char32_t cp = b0 & (0xFF >> (n + 1));
  for (size_t i = 1; i < n; ++i) cp = (cp << 6) | (static_cast<unsigned char>(s[pos + i]) & 0x3F);
  return cp;
}

void append_utf8(char32_t cp, std::string& out) { ft::append_utf8(cp, out); }

bool is_white_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t len = valid_sequence_len(bytes, pos);
    if (len > 0) {
      out.append(bytes.substr(pos, len));
      pos += len;
      continue;
    }
    // Rust replaces the lead byte plus the continuation bytes that could still start a valid
    // sequence (the "maximal subpart"), then resumes at the first byte that breaks it.
    const auto b0 = static_cast<unsigned char>(bytes[pos]);
    size_t consumed = 1;
    const size_t want = utf8_len(b0);
    if (want > 1 && b0 >= 0xC2 && b0 <= 0xF4) {
      for (size_t i = 1; i < want && pos + i < bytes.size(); ++i) {
        const auto b = static_cast<unsigned char>(bytes[pos + i]);
        bool ok = is_continuation(b);
        if (i == 1) {
          if (b0 == 0xE0) ok = b >= 0xA0 && b <= 0xBF;
          if (b0 == 0xED) ok = b >= 0x80 && b <= 0x9F;
          if (b0 == 0xF0) ok = b >= 0x90 && b <= 0xBF;
          if (b0 == 0xF4) ok = b >= 0x80 && b <= 0x8F;
        }
        if (!ok) break;
        consumed = i + 1;
      }
    }
    out += "\xEF\xBF\xBD";
    pos += consumed;
  }
  return out;
}

namespace {

struct ByteLevelTables {
  std::array<std::string, 256> chars;
  std::array<int16_t, 324> bytes;  // code point -> byte; the table's characters are all < 324
};

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves, the other 68 bytes
// are shifted to U+0100 onwards in byte order.
const ByteLevelTables& tables() {
  static const ByteLevelTables t = [] {
    ByteLevelTables r;
    r.bytes.fill(-1);
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    int shifted = 0;
    for (int b = 0; b < 256; ++b) {
      const char32_t cp = printable(b) ? static_cast<char32_t>(b) : 256 + shifted++;
      append_utf8(cp, r.chars[b]);
      r.bytes[cp] = static_cast<int16_t>(b);
    }
    return r;
  }();
  return t;
}

}  // namespace

const std::array<std::string, 256>& byte_level_chars() { return tables().chars; }

int byte_level_byte(char32_t cp) { return cp < tables().bytes.size() ? tables().bytes[cp] : -1; }

}  // namespace ft::tokenizer
