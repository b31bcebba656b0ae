// tokenizer.json "decoder": turns token strings back into text. Implements the chains the Llama
// family uses (Replace, ByteFallback, Fuse, Strip for SentencePiece-style files; ByteLevel for
// Llama 3; Metaspace for older files) and Sequence of them; other types are refused. Immutable
// after loading; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "tokenizer/json_fields.h"
#include "tokenizer/pretokenizer.h"

namespace ft::tokenizer {

class Decoder {
 public:
  // `decoder` is the JSON value at `key` (not null). Sequences are flattened.
  Decoder(const Json& decoder, const std::string& key, const JsonFields& fields);

  // HF's Decoder::decode: every step's decode_chain in turn, then the pieces concatenated.
  std::string decode(std::vector<std::string> tokens) const;

 private:
  struct Step {
    enum class Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace, kByteLevel } kind;
    std::string pattern;  // kReplace: literal to replace; kStrip: the character to strip
    std::string content;  // kReplace: the replacement
    size_t start = 0;     // kStrip: at most this many characters from the left
    size_t stop = 0;      // kStrip: at most this many characters from the right
    MetaspaceOptions metaspace;
  };
  void parse(const Json& d, const std::string& key, const JsonFields& f);

  std::vector<Step> steps_;
};

}  // namespace ft::tokenizer
