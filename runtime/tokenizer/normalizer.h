// tokenizer.json "normalizer": the text rewrites applied before pre-tokenization. Implements HF's
// NFC, NFD, NFKC, NFKD (through ICU), Lowercase, Replace (string or regex), Prepend, Strip,
// StripAccents, BertNormalizer, Nmt, ByteLevel and Sequence of them; Precompiled (SentencePiece's
// compiled rules, Unigram models) is refused. Immutable after loading; thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "tokenizer/json_fields.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace ft::tokenizer {

// The {"Regex": ...} or {"String": ...} pattern of Replace and Split.
struct TextPattern {
  std::optional<Regex> regex;  // unset: `literal`, non-empty
  std::string literal;

  // Reads `obj[name]` (at `key`); a bad regex or an empty string is refused naming the key.
  static TextPattern parse(const Json& obj, const std::string& key, const char* name,
                           const JsonFields& f);
  // Every non-overlapping match, left to right; none in empty text (HF's find_matches).
  void find_all(const std::string& text, std::vector<std::pair<size_t, size_t>>& matches) const;
};

class Normalizer {
 public:
  // `normalizer` is the JSON value at `key` (not null). Sequences are flattened.
  Normalizer(const Json& normalizer, const std::string& key, const JsonFields& fields);

  // Rewrites `text` (valid UTF-8) in place. `origin` (optional; see Piece::origin_chars) is the
  // number of leading characters at offset 0 of the original input, updated as HF's alignments
  // would be: text prepended or inserted beside them joins them, removing them ends them.
  void normalize(std::string& text, size_t* origin = nullptr) const;

 private:
  struct Step {
    enum class Kind {
      kPrepend,
      kReplace,
      kUnicode,
      kLowercase,
      kStrip,
      kStripAccents,
      kBert,
      kNmt,
      kByteLevel
    } kind;
    TextPattern pattern;                 // kReplace: what to replace
    std::string content;                 // kPrepend: what to prepend; kReplace: the replacement
    NormalForm form = NormalForm::kNfc;  // kUnicode
    bool left = false;                   // kStrip: strip_left
    bool right = false;                  // kStrip: strip_right
    bool clean_text = false;             // kBert
    bool chinese_chars = false;          // kBert: handle_chinese_chars
    bool strip_accents = false;          // kBert
    bool lowercase = false;              // kBert
  };
  void parse(const Json& n, const std::string& key, const JsonFields& f);
  static void apply(const Step& s, std::string& text);
  // `origin` after `s` is applied to `text`.
  static size_t origin_after(const Step& s, const std::string& text, size_t origin);

  std::vector<Step> steps_;
};

// Replaces every non-overlapping occurrence of `pattern` (non-empty), leftmost first.
std::string replace_all(const std::string& text, const std::string& pattern,
                        const std::string& content);

}  // namespace ft::tokenizer
