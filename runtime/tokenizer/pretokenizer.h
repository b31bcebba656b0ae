// tokenizer.json "pre_tokenizer": splits text pieces into the words the model encodes one by one.
// Implements HF's Split (regex or string, all five behaviors, invert), ByteLevel, Metaspace (old
// and new JSON forms), Digits, Punctuation, Whitespace, WhitespaceSplit, CharDelimiterSplit,
// UnicodeScripts, BertPreTokenizer and Sequence of them; other types (FixedLength) are refused.
// Immutable after loading; thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "tokenizer/json_fields.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/piece.h"
#include "tokenizer/regex.h"

namespace ft::tokenizer {

// Metaspace's prepend_scheme: where a "▁" is put before the text.
enum class PrependScheme { kAlways, kFirst, kNever };

// Reads a Metaspace object's replacement / prepend_scheme / split, accepting both the current
// form and the add_prefix_space form of tokenizers < 0.15 (shared with the Metaspace decoder).
struct MetaspaceOptions {
  std::string replacement;  // one character, usually "▁"
  PrependScheme scheme = PrependScheme::kAlways;
  bool split = true;
  static MetaspaceOptions parse(const Json& obj, const std::string& key, const JsonFields& f);
};

class PreTokenizer {
 public:
  // `pre_tokenizer` is the JSON value at `key` (not null). Sequences are flattened.
  PreTokenizer(const Json& pre_tokenizer, const std::string& key, const JsonFields& fields);

  // Replaces the text pieces of `pieces` by their words; token pieces pass through.
  void pre_tokenize(std::vector<Piece>& pieces) const;

 private:
  enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
  // The character tests of HF's char-predicate splits (one match per character).
  enum class CharClass { kWhiteSpace, kNumeric, kPunctuation, kDelimiter };
  struct Step {
    enum class Kind { kSplit, kCharSplit, kScripts, kByteLevel, kMetaspace } kind;
    TextPattern pattern;  // kSplit
    Behavior behavior = Behavior::kIsolated;
    bool invert = false;
    // kCharSplit (with `behavior`)
    CharClass char_class = CharClass::kWhiteSpace;
    char32_t delimiter = 0;
    // kByteLevel
    bool add_prefix_space = false;
    bool use_regex = false;
    // kMetaspace
    MetaspaceOptions metaspace;
  };
  void parse(const Json& p, const std::string& key, const JsonFields& f);
  static Behavior parse_behavior(const Json& p, const std::string& key, const JsonFields& f,
                                 bool required);
  static void char_matches(const Step& step, const std::string& text,
                           std::vector<std::pair<size_t, size_t>>& matches);
  static void script_split(const Piece& piece, std::vector<Piece>& out);
  void apply(const Step& step, const Piece& piece, std::vector<Piece>& out) const;
  static void split(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                    Behavior behavior, bool invert, std::vector<Piece>& out);

  std::vector<Step> steps_;
  std::optional<Regex> gpt2_regex_;  // ByteLevel's built-in split, when a step uses it
};

}  // namespace ft::tokenizer
