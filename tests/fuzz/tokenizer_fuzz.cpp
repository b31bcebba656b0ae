// Fuzzes tokenizer.json loading and encode/decode of arbitrary bytes. The first byte chooses: one
// of the four fixture tokenizers (Llama 2, Llama 3, Mistral v1, v3) with the rest of the input the
// text, or (every fifth value) a tokenizer.json of the input's own, up to its first NUL byte, with
// the text after it. The text is encoded with and without special tokens, the ids decoded back,
// and also read 4 bytes at a time as ids to decode, known or not. Every id encode returns must be
// below vocab_size() (the data pipeline indexes the embedding with it, and checks the model against
// vocab_size()), and Llama 3's byte-level encoding decodes back to its text.
#include <cstring>

#include "fuzz_support.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace ft;

const tokenizer::Tokenizer& fixture(size_t i) {
  static const tokenizer::Tokenizer tokenizers[] = {
      tokenizer::Tokenizer::from_file(FT_SOURCE_DIR
                                      "/tests/tokenizer/fixtures/llama2/tokenizer.json"),
      tokenizer::Tokenizer::from_file(FT_SOURCE_DIR
                                      "/tests/tokenizer/fixtures/llama3/tokenizer.json"),
      tokenizer::Tokenizer::from_file(FT_SOURCE_DIR
                                      "/tests/tokenizer/fixtures/mistral_v1/tokenizer.json"),
      tokenizer::Tokenizer::from_file(FT_SOURCE_DIR
                                      "/tests/tokenizer/fixtures/mistral_v3/tokenizer.json")};
  return tokenizers[i];
}
constexpr size_t kLlama3 = 1;

void check_ids(const tokenizer::Tokenizer& tok, const std::vector<int32_t>& ids) {
  for (const int32_t id : ids)
    fuzz::require(id >= 0 && static_cast<size_t>(id) < tok.vocab_size(),
                  "encode returned id " + std::to_string(id) + " outside the vocabulary of " +
                      std::to_string(tok.vocab_size()));
}

// `fixture`: a real tokenizer, whose tokens and ids map one to one (a fuzzed one may give an added
// token the id of a vocabulary entry, as HF would).
void exercise(const tokenizer::Tokenizer& tok, std::string_view text, bool fixture,
              bool round_trips) {
  fuzz::expect_ft_errors([&] {
    const std::vector<int32_t> ids = tok.encode(text, false);
    check_ids(tok, ids);
    const std::string back = tok.decode(ids, false);
    if (round_trips) fuzz::require(back == text, "byte-level decode(encode(text)) == text");
    (void)tok.decode(ids, true);
    const std::vector<int32_t> with_special = tok.encode(text, true);
    check_ids(tok, with_special);
    (void)tok.decode(with_special, true);
  });
  std::vector<int32_t> raw(text.size() / 4);
  if (!raw.empty()) std::memcpy(raw.data(), text.data(), raw.size() * 4);
  (void)tok.decode(raw, false);
  (void)tok.decode(raw, true);
  if (const auto id = tok.token_to_id(text)) {
    fuzz::require(!fixture || tok.id_to_token(*id).value_or("") == text,
                  "id_to_token(token_to_id(t)) == t");
    (void)tok.is_special(*id);
  }
  (void)tok.bos_id();
  (void)tok.eos_id();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (size_t i = 0; i < 4; ++i) (void)fixture(i);  // loaded before the first input
  if (size == 0) return 0;
  const size_t choice = data[0] % 5;
  const std::string_view rest = fuzz::as_text(data + 1, size - 1);
  if (choice < 4) {
    exercise(fixture(choice), rest, true, choice == kLlama3);
    return 0;
  }
  const auto parts = fuzz::split(rest, std::string_view("\0", 1), 2);
  fuzz::expect_ft_errors([&] {
    const tokenizer::Tokenizer tok =
        tokenizer::Tokenizer::from_json_text(parts[0], "tokenizer.json");
    exercise(tok, parts.size() > 1 ? parts[1] : std::string_view(), false, false);
  });
  return 0;
}
