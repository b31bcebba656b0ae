// tokenizer.json "post_processor": the special tokens put around an encoded sequence when
// add_special_tokens is asked (TemplateProcessing's "single" template: <s> for Llama 2 and
// Mistral, <|begin_of_text|> for Llama 3). ByteLevel post-processing only moves offsets, which
// ft does not report, so it is accepted as a no-op. Immutable after loading; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tokenizer/json_fields.h"

namespace ft::tokenizer {

class PostProcessor {
 public:
  // `post_processor` is the JSON value at `key` (not null).
  PostProcessor(const Json& post_processor, const std::string& key, const JsonFields& fields);

  // Returns the ids of the single-sequence template with `ids` in place of the sequence.
  std::vector<int32_t> apply(const std::vector<int32_t>& ids) const;

  // The ids the template puts before / after the sequence (empty without a template).
  const std::vector<int32_t>& prefix() const { return prefix_; }
  const std::vector<int32_t>& suffix() const { return suffix_; }

 private:
  void parse(const Json& p, const std::string& key, const JsonFields& f);

  bool has_template_ = false;
  std::vector<int32_t> prefix_;
  std::vector<int32_t> suffix_;
};

}  // namespace ft::tokenizer
