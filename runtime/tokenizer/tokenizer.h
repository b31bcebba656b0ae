// Hugging Face tokenizer.json BPE tokenizers (Llama, Mistral, Qwen, Gemma, Phi, SmolLM, DeepSeek)
// in C++, giving the same ids as HF `tokenizers`. A Tokenizer owns all its tables; encode/decode
// are const and thread-safe (the word cache inside is guarded), so one instance can serve many data
// workers.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ft::tokenizer {

class Tokenizer {
 public:
  // Loads a tokenizer.json. Throws ft::FormatError naming the file and the JSON key for
  // anything malformed, and for every component ft does not implement (model "Unigram",
  // normalizer "Precompiled", ...): it refuses rather than tokenize differently from HF. The
  // "truncation" and "padding" sections are ignored, as transformers overrides them per call.
  static Tokenizer from_file(const std::string& path);
  // The same from JSON text, or from parsed JSON; `origin` names it in errors.
  static Tokenizer from_json_text(std::string_view json_text, const std::string& origin);
  static Tokenizer from_json(const nlohmann::json& root, const std::string& origin);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // HF's tokenizer.encode(text, add_special_tokens=...).ids. Special and added tokens written
  // in `text` are always recognised; add_special_tokens adds the post-processor's template
  // tokens (BOS). Throws ft::FormatError if `text` is not valid UTF-8.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;

  // HF's tokenizer.decode(ids, skip_special_tokens=...). Ids the tokenizer does not know are
  // skipped, as HF does (models often pad their embedding past the vocabulary).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;

  // HF's get_vocab_size(with_added_tokens=True): model vocabulary plus added tokens not in it;
  // where the ids have gaps, or the post-processor's template names an id past them, one past
  // the largest id: every id encode returns is below it.
  size_t vocab_size() const;

  // BOS: the token the post-processor puts before the text (<s>, <|begin_of_text|>), else an
  // added "<s>" / "<|begin_of_text|>". EOS: the token the template puts after the text, else
  // the first of "</s>", "<|end_of_text|>", "<|endoftext|>" present. tokenizer.json does not
  // name EOS itself: chat models end turns with others (<|eot_id|>); look those up by name.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ft::tokenizer
