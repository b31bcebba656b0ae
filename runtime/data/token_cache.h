// The tokenized form of a dataset file, made once by `ft data prepare` and memory-mapped by
// every rank and every restart instead of tokenizing the corpus at start. One file per (data
// file, tokenizer, format, template, prompt masking), beside the data by default
// (`FILE.ftcache/`, or data.cache_dir): records are kept whole, so one cache serves every
// seq_len, packing and shuffle. Reading is thread-safe (the mapping is read-only).
//
// File: "FTTOKC01", uint64 key length, the key (JSON), padding to 8 bytes; then per record its
// ids and its labels (int32 each, little-endian); then the footer: int64 offsets[n + 1] (in int32
// words from the data start), uint8 status[n] (0 ok, 1 malformed), padding to 8; then the
// trailer: int64 n, int64 words, int64 footer position, "FTTOKEND". Written through a
// DurableFile (complete or absent). Opening checks the magic, the key and every offset.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "data/jsonl_source.h"

namespace ft::data {

// What a cache is valid for: the data's path, size and modification time (of a folder, its files'
// total and newest: record_file.h's data_identity), the tokenizer
// file's size and FNV-1a hash, the format, template and prompt masking, the cache version.
nlohmann::json token_cache_key(const JsonlOptions& options);
// The cache file of `options`: data.cache_dir (or PATH.ftcache) / <hash of the key>.tokens.
std::string token_cache_path(const JsonlOptions& options, const nlohmann::json& key);

class TokenCache {
 public:
  // The cache at `path` when it exists and holds `key`; null, with the reason in `why`, when it
  // does not exist, was made for other inputs, or is damaged (a damaged cache is not an error:
  // the data is tokenized again).
  static std::unique_ptr<TokenCache> open(const std::string& path, const nlohmann::json& key,
                                          std::string* why);
  ~TokenCache();
  TokenCache(const TokenCache&) = delete;
  TokenCache& operator=(const TokenCache&) = delete;

  int64_t records() const { return n_; }
  int64_t tokens() const { return words_ / 2; }
  bool malformed(int64_t record) const { return status_[record] != 0; }
  // Record `record`'s ids and labels (a malformed record gives none).
  TokenizedRecord record(int64_t record) const;

 private:
  TokenCache() = default;
  void* base_ = nullptr;
  size_t size_ = 0;
  int64_t n_ = 0, words_ = 0;
  const int32_t* data_ = nullptr;
  const int64_t* offsets_ = nullptr;
  const uint8_t* status_ = nullptr;
};

struct PrepareResult {
  std::string path;
  int64_t records = 0, malformed = 0, tokens = 0;
  uint64_t bytes = 0;  // of the cache file
  double seconds = 0;
};
// Tokenizes every record of `source` (all cores, in file order chunks; `progress(done, total)`
// between chunks) into the cache at `path`. A malformed record is the FormatError training would
// throw, unless the source skips bad records (then it is marked). SystemError naming the file
// when it cannot be written.
PrepareResult write_token_cache(const JsonlSource& source, const std::string& path,
                                const nlohmann::json& key,
                                const std::function<void(int64_t, int64_t)>& progress);

// The cache at `path`, made by write_token_cache when it does not exist or was made for other
// inputs: one process at a time under an flock on `path`.lock, so that the ranks of a node
// tokenize the file once (the others wait, with a line on stderr every 30 s, then read it).
// Progress on stderr every 10 s. Errors as write_token_cache's; null never.
std::unique_ptr<TokenCache> prepare_token_cache(const JsonlSource& source, const std::string& path,
                                                const nlohmann::json& key);

}  // namespace ft::data
