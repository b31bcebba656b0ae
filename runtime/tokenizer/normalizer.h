// tokenizer.json "normalizer": the text rewrites applied before pre-tokenization. The Llama 2 /
// Mistral v0.1 files use Sequence[Prepend("▁"), Replace(" ", "▁")]; other normalizer types
// (NFC, Lowercase, Precompiled, ...) are refused. Immutable after loading; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "tokenizer/json_fields.h"

namespace ft::tokenizer {

class Normalizer {
 public:
  // `normalizer` is the JSON value at `key` (not null). Sequences are flattened.
  Normalizer(const Json& normalizer, const std::string& key, const JsonFields& fields);

  // Rewrites `text` in place.
  void normalize(std::string& text) const;

 private:
  struct Step {
    enum class Kind { kPrepend, kReplace } kind;
    std::string pattern;  // kReplace: the literal to replace
    std::string content;  // kPrepend: what to prepend; kReplace: the replacement
  };
  void parse(const Json& n, const std::string& key, const JsonFields& f);

  std::vector<Step> steps_;
};

// Replaces every non-overlapping occurrence of `pattern` (non-empty), leftmost first.
std::string replace_all(const std::string& text, const std::string& pattern,
                        const std::string& content);

}  // namespace ft::tokenizer
