// A piece of the input on its way through the encode pipeline (HF's Split of a
// PreTokenizedString): either text still to be pre-tokenized and run through the model, or an
// added token already resolved to its id. Plain value type.
#pragma once

#include <cstdint>
#include <string>

namespace ft::tokenizer {

struct Piece {
  std::string text;  // normalized text (or the matched text of an added token)
  int32_t id = -1;   // the added token's id; -1 while the piece is text
  // Whether the piece starts at offset 0 of the original input: Metaspace's
  // prepend_scheme "first" adds its "▁" only there.
  bool at_start = false;

  bool is_token() const { return id >= 0; }
};

}  // namespace ft::tokenizer
