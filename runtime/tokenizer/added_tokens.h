// tokenizer.json "added_tokens": special and user tokens matched in the raw text before the
// model sees it (HF's AddedVocabulary), with the single_word / lstrip / rstrip / normalized
// flags. Owns its tables; immutable after loading; thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tokenizer/bpe.h"
#include "tokenizer/json_fields.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/piece.h"
#include "tokenizer/regex.h"

namespace ft::tokenizer {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

class AddedVocabulary {
 public:
  // Reads the list at `key`. Ids are assigned as HF does (the model's id for a token in its
  // vocabulary, else the next free one after it); a declared "id" that disagrees is refused,
  // since HF would quietly use another id than the file says. `normalizer` may be null.
  AddedVocabulary(const Json& added_tokens, const std::string& key, const JsonFields& fields,
                  const BpeModel& model, const Normalizer* normalizer);
  ~AddedVocabulary();
  AddedVocabulary(const AddedVocabulary&) = delete;
  AddedVocabulary& operator=(const AddedVocabulary&) = delete;

  // Splits `piece` (text) on the non-normalized (`normalized` false) or normalized added tokens,
  // appending text and token pieces to `out`; empty text pieces are dropped.
  void split(const Piece& piece, bool normalized, std::vector<Piece>& out) const;
  bool has_tokens(bool normalized) const;

  std::optional<int32_t> id_of(std::string_view content) const;
  // The text decode() shows for an added token id (its normalized form if it is normalized), or
  // nullptr when `id` is not an added token.
  const std::string* decode_text(int32_t id) const;
  // Whether `text` is the content of a special token (HF decides skip_special_tokens by text).
  bool is_special_text(std::string_view text) const;
  // Number of distinct added token contents, and how many of them the model's vocabulary has.
  size_t size() const { return by_content_.size(); }
  size_t count_in_model(const BpeModel& model) const;
  // One past the largest added token id (0 when there is none).
  size_t id_bound() const;

 private:
  class Trie;
  bool is_word_char_at_end(std::string_view s) const;
  bool is_word_char_at_start(std::string_view s) const;

  std::unordered_map<int32_t, AddedToken> by_id_;
  std::unordered_map<std::string, int32_t> by_content_;
  std::unordered_map<int32_t, std::string> normalized_text_;  // where normalization changed it
  std::unordered_set<std::string> special_;
  std::unique_ptr<Trie> raw_trie_;
  std::unique_ptr<Trie> normalized_trie_;
  // Rust regex's \w (what HF's single_word check uses); compiled only when a token needs it.
  std::optional<Regex> word_char_;
};

}  // namespace ft::tokenizer
