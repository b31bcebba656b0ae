// The BPE model of tokenizer.json ("model": {"type": "BPE"}): vocabulary, ranked merges, byte
// fallback and unknown-token handling, reproducing HF `tokenizers`' merge order exactly. Owns
// its tables; immutable after loading except for the word cache, which a mutex guards, so
// tokenize() may be called from many threads.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/json_fields.h"

namespace ft::tokenizer {

class BpeModel {
 public:
  // Ids are below this (2^24, the largest model.vocab_size a preset may set).
  static constexpr int64_t kMaxVocab = int64_t{1} << 24;

  // Reads `model` (at JSON key `key`). Refuses other model types, dropout, merges naming
  // tokens outside the vocabulary, an unk_token outside it and duplicate ids, each as
  // FormatError naming file and key.
  BpeModel(const Json& model, const std::string& key, const JsonFields& fields);
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of one pre-tokenized word (non-empty, valid UTF-8) to `out`.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // nullptr for an id the vocabulary does not have.
  const std::string* id_to_token(int32_t id) const;
  // Number of entries of the vocabulary (HF's model.get_vocab_size()).
  size_t size() const { return tokens_.size(); }
  // One past the largest id of the vocabulary: more than size() where the ids have gaps.
  size_t id_bound() const { return id_to_index_.size(); }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const Merge* find_merge(int32_t a, int32_t b) const;
  // Splits `word` into characters (vocab ids, byte fallback or unk) and applies the merges.
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  // tokens_[i] is the text of the i-th vocabulary entry; vocab_ maps views into it to ids.
  std::vector<std::string> tokens_;
  std::unordered_map<std::string_view, int32_t> vocab_;
  std::vector<int32_t> id_to_index_;  // id -> index into tokens_, -1 where the id is unused
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  int32_t byte_ids_[256];  // id of "<0xNN>" or -1

  // Words seen before, up to kCacheCapacity of them and kCacheMaxWordBytes long each (HF caches
  // the same way); full means no further inserts, so the hot words of a corpus stay.
  static constexpr size_t kCacheCapacity = 65536;
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable std::shared_mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace ft::tokenizer
