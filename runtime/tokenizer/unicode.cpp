#include "tokenizer/unicode.h"

#include <unicode/bytestream.h>
#include <unicode/casemap.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/uniset.h>
#include <unicode/uscript.h>

#include <memory>
#include <stdexcept>

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

namespace {

bool is_ascii(std::string_view s) {
  for (const char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

void check_icu(UErrorCode status, const char* what) {
  if (U_FAILURE(status)) {
    throw std::runtime_error(std::string("ICU ") + what + " failed: " + u_errorName(status));
  }
}

bool in_categories(char32_t cp, uint32_t mask) {
  return (U_GET_GC_MASK(static_cast<UChar32>(cp)) & mask) != 0;
}

// HF's Unicode tables are older than ICU's; `version` is the one each property was taken from.
bool assigned_by(char32_t cp, int major, int minor) {
  UVersionInfo age;
  u_charAge(static_cast<UChar32>(cp), age);
  return age[0] != 0 && (age[0] < major || (age[0] == major && age[1] <= minor));
}

// ICU's normalizer limited to the characters of Unicode 9.0, the version of HF's
// unicode-normalization-alignments tables: newer characters are left as they are, as HF does.
const icu::Normalizer2* unicode9_normalizer(NormalForm form) {
  struct Filtered {
    icu::UnicodeSet set;
    std::unique_ptr<icu::FilteredNormalizer2> nfc, nfd, nfkc, nfkd;
  };
  static const Filtered* f = [] {
    UErrorCode status = U_ZERO_ERROR;
    auto* r =
        new Filtered{icu::UnicodeSet(icu::UnicodeString(u"[:age=9.0:]"), status), {}, {}, {}, {}};
    check_icu(status, "Unicode 9.0 character set");
    r->set.freeze();
    r->nfc = std::make_unique<icu::FilteredNormalizer2>(*icu::Normalizer2::getNFCInstance(status),
                                                        r->set);
    r->nfd = std::make_unique<icu::FilteredNormalizer2>(*icu::Normalizer2::getNFDInstance(status),
                                                        r->set);
    r->nfkc = std::make_unique<icu::FilteredNormalizer2>(*icu::Normalizer2::getNFKCInstance(status),
                                                         r->set);
    r->nfkd = std::make_unique<icu::FilteredNormalizer2>(*icu::Normalizer2::getNFKDInstance(status),
                                                         r->set);
    check_icu(status, "normalizer instance");
    return r;
  }();
  switch (form) {
    case NormalForm::kNfc:
      return f->nfc.get();
    case NormalForm::kNfd:
      return f->nfd.get();
    case NormalForm::kNfkc:
      return f->nfkc.get();
    case NormalForm::kNfkd:
      break;
  }
  return f->nfkd.get();
}

}  // namespace

std::string normalize_form(std::string_view s, NormalForm form) {
  if (is_ascii(s)) return std::string(s);  // ASCII is in every normalization form
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = unicode9_normalizer(form);

  std::string out;
  out.reserve(s.size() + s.size() / 4);
  icu::StringByteSink<std::string> sink(&out);
  n->normalizeUTF8(0, icu::StringPiece(s.data(), static_cast<int32_t>(s.size())), sink, nullptr,
                   status);
  check_icu(status, "normalization");
  return out;
}

std::string lowercase_chars(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) {
    const auto c = static_cast<unsigned char>(s[pos]);
    if (c < 0x80) {
      out += static_cast<char>(c >= 'A' && c <= 'Z' ? c + ('a' - 'A') : c);
      ++pos;
      continue;
    }
    // One character at a time, so that ICU sees no context (its final-sigma rule needs one).
    const size_t len = utf8_len(c);
    UErrorCode status = U_ZERO_ERROR;
    icu::StringByteSink<std::string> sink(&out);
    icu::CaseMap::utf8ToLower("", 0, icu::StringPiece(s.data() + pos, static_cast<int32_t>(len)),
                              sink, nullptr, status);
    check_icu(status, "lowercasing");
    pos += len;
  }
  return out;
}

bool is_numeric(char32_t cp) {
  return in_categories(cp, U_GC_ND_MASK | U_GC_NL_MASK | U_GC_NO_MASK);
}

bool is_punctuation(char32_t cp) {
  if (cp < 0x80)
    return (cp >= 0x21 && cp <= 0x2F) || (cp >= 0x3A && cp <= 0x40) || (cp >= 0x5B && cp <= 0x60) ||
           (cp >= 0x7B && cp <= 0x7E);
  // unicode_categories' tables are Unicode 8.0's, where U+166D and U+111C9 were still Po.
  if (cp == 0x166D || cp == 0x111C9) return true;
  return in_categories(cp, U_GC_P_MASK) && assigned_by(cp, 8, 0);
}

bool is_other(char32_t cp) {
  // unicode_categories' tables (Unicode 8.0); its "not assigned" test matches nothing.
  return in_categories(cp, U_GC_CC_MASK | U_GC_CF_MASK | U_GC_CO_MASK | U_GC_CS_MASK) &&
         assigned_by(cp, 8, 0);
}

// U+1CF2 and U+1CF3 were Mc, U+111C9 Po, in the Unicode versions of HF's tables.
bool is_mark(char32_t cp) {
  if (cp == 0x1CF2 || cp == 0x1CF3) return true;
  return cp != 0x111C9 && in_categories(cp, U_GC_M_MASK) && assigned_by(cp, 9, 0);
}

// Unicode 8.0 (unicode_categories): U+1734 was Mn; U+1885, U+1886, U+A9BD and U+111C9 were not.
bool is_nonspacing_mark(char32_t cp) {
  if (cp == 0x1734) return true;
  if (cp == 0x1885 || cp == 0x1886 || cp == 0xA9BD || cp == 0x111C9) return false;
  return in_categories(cp, U_GC_MN_MASK) && assigned_by(cp, 8, 0);
}

int hf_script(char32_t cp) {
  if (cp == 0x30FC) return USCRIPT_HAN;
  if (cp == ' ') return kAnyScript;
  // HF's table was generated from Unicode 9.0's Scripts.txt: anything newer (or unassigned) is
  // "Any" there.
  UVersionInfo age;
  u_charAge(static_cast<UChar32>(cp), age);
  if (age[0] > 9 || (age[0] == 9 && age[1] > 0)) return kAnyScript;
  // The four Unicode 9.0 characters whose Script value Unicode has changed since (compared over
  // every code point against HF's scripts.rs): HF keeps the old values.
  switch (cp) {
    case 0x0589:  // ARMENIAN FULL STOP, now Armenian
    case 0x061C:  // ARABIC LETTER MARK, now Arabic
      return USCRIPT_COMMON;
    case 0x0953:  // DEVANAGARI GRAVE ACCENT, now Inherited
    case 0x0954:  // DEVANAGARI ACUTE ACCENT, now Inherited
      return USCRIPT_DEVANAGARI;
    default:
      break;
  }
  UErrorCode status = U_ZERO_ERROR;
  const UScriptCode script = uscript_getScript(static_cast<UChar32>(cp), &status);
  if (U_FAILURE(status) || script == USCRIPT_UNKNOWN) return kAnyScript;
  if (script == USCRIPT_HIRAGANA || script == USCRIPT_KATAKANA) return USCRIPT_HAN;
  return script;
}

}  // namespace ft::tokenizer
