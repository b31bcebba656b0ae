// A piece of the input on its way through the encode pipeline (HF's Split of a
// PreTokenizedString): either text still to be pre-tokenized and run through the model, or an
// added token already resolved to its id. Plain value type.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tokenizer/unicode.h"

namespace ft::tokenizer {

struct Piece {
  std::string text;  // normalized text (or the matched text of an added token)
  int32_t id = -1;   // the added token's id; -1 while the piece is text
  // How many leading characters stand at offset 0 of the original input, as HF's alignments put
  // them: the first character, and text a normalizer or pre-tokenizer added beside it (0 when the
  // piece starts further on). Metaspace's prepend_scheme "first" adds its "▁" only where this is
  // not 0.
  size_t origin_chars = 0;

  bool is_token() const { return id >= 0; }
  bool at_origin() const { return origin_chars > 0; }

  // The origin_chars of the part of this piece that starts at byte `begin`.
  // Reads at most origin_chars characters, so splitting a long text stays linear.
  size_t origin_from(size_t begin) const {
    size_t before = 0;
    for (size_t i = 0; i < begin && before < origin_chars; ++i) {
      before += (static_cast<unsigned char>(text[i]) & 0xC0) != 0x80;
    }
    return before < origin_chars ? origin_chars - before : 0;
  }
};

}  // namespace ft::tokenizer
