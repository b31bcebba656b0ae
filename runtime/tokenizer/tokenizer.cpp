#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/json.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/decoder.h"
#include "tokenizer/json_fields.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/post_processor.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/unicode.h"

namespace ft::tokenizer {

// The pipeline of HF's TokenizerImpl, in encode order.
struct Tokenizer::Impl {
  std::unique_ptr<Normalizer> normalizer;       // null: none
  std::unique_ptr<PreTokenizer> pre_tokenizer;  // null: none
  std::unique_ptr<BpeModel> model;
  std::unique_ptr<AddedVocabulary> added;
  std::unique_ptr<PostProcessor> post_processor;  // null: none
  std::unique_ptr<Decoder> decoder;               // null: tokens joined with spaces
  size_t vocab_size = 0;
  std::optional<int32_t> bos;
  std::optional<int32_t> eos;
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ft::FormatError(path + ": cannot open tokenizer file: " + std::strerror(errno));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw ft::FormatError(path + ": read failed: " + std::strerror(errno));
  return from_json_text(text.str(), path);
}

Tokenizer Tokenizer::from_json_text(std::string_view json_text, const std::string& origin) {
  return from_json(ft::parse_json<ft::FormatError>(json_text, origin), origin);
}

Tokenizer Tokenizer::from_json(const Json& root, const std::string& origin) try {
  const JsonFields f(origin);
  if (!root.is_object()) f.fail("(top level)", "expected an object");
  if (const Json* version = f.optional(root, "version")) {
    if (*version != "1.0") f.fail("version", "unknown tokenizer.json version " + version->dump());
  }

  auto impl = std::make_unique<Impl>();
  if (const Json* n = f.optional(root, "normalizer")) {
    impl->normalizer = std::make_unique<Normalizer>(*n, "normalizer", f);
  }
  if (const Json* p = f.optional(root, "pre_tokenizer")) {
    impl->pre_tokenizer = std::make_unique<PreTokenizer>(*p, "pre_tokenizer", f);
  }
  impl->model = std::make_unique<BpeModel>(f.required(root, "", "model"), "model", f);
  static const Json kNoTokens = Json::array();
  const Json* added = f.optional(root, "added_tokens");
  impl->added = std::make_unique<AddedVocabulary>(added ? *added : kNoTokens, "added_tokens", f,
                                                  *impl->model, impl->normalizer.get());
  if (const Json* p = f.optional(root, "post_processor")) {
    impl->post_processor = std::make_unique<PostProcessor>(*p, "post_processor", f);
  }
  if (const Json* d = f.optional(root, "decoder")) {
    impl->decoder = std::make_unique<Decoder>(*d, "decoder", f);
  }

  Tokenizer tok(std::move(impl));
  Impl& m = *tok.impl_;
  m.vocab_size = m.model->size() + m.added->size() - m.added->count_in_model(*m.model);
  // Ids index the embedding: where they have gaps, it needs a row for the largest one, the
  // post-processor's template ids (which HF does not check against the vocabulary) included.
  m.vocab_size = std::max({m.vocab_size, m.model->id_bound(), m.added->id_bound()});
  if (m.post_processor) {
    for (const auto* ids : {&m.post_processor->prefix(), &m.post_processor->suffix()})
      for (const int32_t id : *ids) m.vocab_size = std::max(m.vocab_size, size_t(id) + 1);
  }

  auto first_present = [&](std::initializer_list<const char*> names) -> std::optional<int32_t> {
    for (const char* n : names) {
      if (const auto id = tok.token_to_id(n)) return id;
    }
    return std::nullopt;
  };
  if (m.post_processor && !m.post_processor->prefix().empty()) {
    m.bos = m.post_processor->prefix().back();
  } else {
    m.bos = first_present({"<s>", "<|begin_of_text|>"});
  }
  if (m.post_processor && !m.post_processor->suffix().empty()) {
    m.eos = m.post_processor->suffix().front();
  } else {
    m.eos = first_present({"</s>", "<|end_of_text|>", "<|endoftext|>"});
  }
  return tok;
} catch (const Json::exception& e) {
  // The readers check types before converting; this is the net for anything they missed.
  throw ft::FormatError(origin + ": unexpected JSON content: " + e.what());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  if (const size_t bad = find_invalid_utf8(text); bad != std::string_view::npos) {
    throw ft::FormatError("tokenizer input is not valid UTF-8 (byte " + std::to_string(bad) +
                          " of " + std::to_string(text.size()) + ")");
  }
  std::vector<Piece> pieces;
  if (!text.empty()) pieces.push_back(Piece{std::string(text), -1, 1});

  // HF's AddedVocabulary::extract_and_normalize: tokens matched in the raw text first, then the
  // rest normalized and searched for the normalized tokens.
  std::vector<Piece> next;
  if (m.added->has_tokens(false)) {
    for (const Piece& p : pieces) m.added->split(p, false, next);
    pieces.swap(next);
  }
  next.clear();
  for (Piece& p : pieces) {
    if (p.is_token()) {
      next.push_back(std::move(p));
      continue;
    }
    if (m.normalizer) m.normalizer->normalize(p.text, &p.origin_chars);
    if (m.added->has_tokens(true)) {
      m.added->split(p, true, next);
    } else if (!p.text.empty()) {
      next.push_back(std::move(p));
    }
  }
  pieces.swap(next);

  if (m.pre_tokenizer) m.pre_tokenizer->pre_tokenize(pieces);

  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  for (const Piece& p : pieces) {
    if (p.is_token()) {
      ids.push_back(p.id);
    } else {
      m.model->tokenize(p.text, ids);
    }
  }
  if (add_special_tokens && m.post_processor) return m.post_processor->apply(ids);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    const std::string* text = m.added->decode_text(id);
    if (text == nullptr) text = m.model->id_to_token(id);
    if (text == nullptr) continue;
    if (skip_special_tokens && m.added->is_special_text(*text)) continue;
    tokens.push_back(*text);
  }
  if (m.decoder) return m.decoder->decode(std::move(tokens));
  std::string out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0) out += ' ';
    out += tokens[i];
  }
  return out;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto id = impl_->added->id_of(token)) return id;
  return impl_->model->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  const std::string* text = impl_->added->decode_text(id);
  if (text == nullptr) text = impl_->model->id_to_token(id);
  if (text == nullptr) return std::nullopt;
  return *text;
}

bool Tokenizer::is_special(int32_t id) const {
  const auto text = id_to_token(id);
  return text && impl_->added->is_special_text(*text);
}

size_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }

}  // namespace ft::tokenizer
