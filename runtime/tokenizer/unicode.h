// UTF-8 helpers the tokenizer needs to match Hugging Face `tokenizers` (Rust) byte for byte:
// validation, code-point iteration, Rust's lossy decoding, Unicode White_Space, GPT-2's
// byte-to-character table, and (through ICU, not hand-written tables) normalization forms,
// lowercasing, general categories and scripts as Rust's char methods and HF's tables see them.
// Pure functions over caller-owned strings; thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ft::tokenizer {

// Byte offset of the first byte that makes `s` invalid UTF-8 (overlong forms, surrogates and code
// points above U+10FFFF are invalid, as in Rust's str), or std::string_view::npos if it is valid.
size_t find_invalid_utf8(std::string_view s);

// Length in bytes of the UTF-8 sequence that starts with `lead`; 1 for a stray byte.
inline size_t utf8_len(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;
}

// Number of characters of valid UTF-8 `s`.
inline size_t count_chars(std::string_view s) {
  size_t n = 0;
  for (const char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// Bytes taken by the first `n` characters of valid UTF-8 `s` (all of it if it has fewer).
inline size_t prefix_bytes(std::string_view s, size_t n) {
  size_t pos = 0;
  for (size_t i = 0; i < n && pos < s.size(); ++i)
    pos += utf8_len(static_cast<unsigned char>(s[pos]));
  return pos;
}

// Decodes the code point at `pos` of valid UTF-8 `s`; stores its length in `*len`.
char32_t decode_utf8(std::string_view s, size_t pos, size_t* len);

// Appends the UTF-8 encoding of `cp` to `out`.
void append_utf8(char32_t cp, std::string& out);

// Unicode's White_Space property: what Rust's `\s` and `char::is_whitespace` match.
bool is_white_space(char32_t cp);

// Rust's String::from_utf8_lossy: each maximal invalid subsequence becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// Unicode normalization forms (HF's NFC / NFD / NFKC / NFKD normalizers) of valid UTF-8 `s`, by
// Unicode 9.0's data as HF's: characters assigned later are left unchanged.
enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
std::string normalize_form(std::string_view s, NormalForm form);

// Rust's char::to_lowercase applied to each character of valid UTF-8 `s` on its own, as HF's
// Lowercase does: the full mapping (U+0130 becomes "i\u0307"), no context (Σ is always σ). Rust
// knows Unicode 16.0 and ICU 72 15.0: the 55 letters with a lowercase new in 16.0 stay as they are.
std::string lowercase_chars(std::string_view s);

// General-category tests as the Rust functions HF calls answer them. Those tables are older than
// ICU's: characters assigned after their Unicode version (8.0 for unicode_categories, 9.0 for
// unicode-normalization-alignments) lack the property, and the few whose category changed since
// keep their old one. Rust's std (char::is_numeric) is newer than ICU 72: Unicode 15.1 / 16.0
// digits are not numeric here.
bool is_numeric(char32_t cp);          // char::is_numeric: Nd, Nl, No
bool is_punctuation(char32_t cp);      // HF's is_punc: ASCII punctuation (incl. $+<=>^`|~) or P*
bool is_other(char32_t cp);            // unicode_categories' is_other: Cc, Cf, Cs, Co (not Cn)
bool is_mark(char32_t cp);             // is_combining_mark (StripAccents): Mn, Mc, Me
bool is_nonspacing_mark(char32_t cp);  // Mn (BertNormalizer's strip_accents)

// The script HF's UnicodeScripts pre-tokenizer gives `cp` (its fixed_script): ICU's Script
// property, with Hiragana, Katakana and U+30FC counted as Han, and kAnyScript for " " and for
// characters HF's table (Unicode 9.0) does not have; the four characters whose Script value
// changed since Unicode 9.0 keep their old value, as in HF.
constexpr int kAnyScript = -1;
int hf_script(char32_t cp);

// GPT-2's reversible byte -> printable character table used by the ByteLevel pre-tokenizer and
// decoder: entry b is the UTF-8 text of the character standing for byte b.
const std::array<std::string, 256>& byte_level_chars();

// The byte that ByteLevel character `cp` stands for, or -1 if `cp` is not one of them.
int byte_level_byte(char32_t cp);

}  // namespace ft::tokenizer
