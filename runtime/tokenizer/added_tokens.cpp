#include "tokenizer/added_tokens.h"

#include <algorithm>
#include <array>

#include "tokenizer/unicode.h"

namespace ft::tokenizer {

// Byte trie over the token patterns, answering "longest pattern starting here"; scanning left to
// right with it gives the leftmost-longest, non-overlapping matches of HF's Aho-Corasick.
class AddedVocabulary::Trie {
 public:
  Trie() { root_children_.fill(-1); }

  // Returns false if `pattern` is already present.
  bool insert(std::string_view pattern, int32_t value) {
    int32_t node = -1;  // -1 is the root
    for (const char c : pattern) {
      const auto b = static_cast<unsigned char>(c);
      int32_t next = child(node, b);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
        if (node < 0) {
          root_children_[b] = next;
        } else {
          auto& kids = nodes_[node].children;
          kids.insert(std::lower_bound(kids.begin(), kids.end(), std::make_pair(b, int32_t{0})),
                      std::make_pair(b, next));
        }
      }
      node = next;
    }
    if (nodes_[node].value >= 0) return false;
    nodes_[node].value = value;
    return true;
  }

  // The value and end offset of the longest pattern that starts at `pos`, if any.
  bool longest_at(std::string_view s, size_t pos, int32_t* value, size_t* end) const {
    bool found = false;
    int32_t node = -1;
    for (size_t i = pos; i < s.size(); ++i) {
      node = child(node, static_cast<unsigned char>(s[i]));
      if (node < 0) break;
      if (nodes_[node].value >= 0) {
        *value = nodes_[node].value;
        *end = i + 1;
        found = true;
      }
    }
    return found;
  }

  bool empty() const { return nodes_.empty(); }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t value = -1;
  };
  int32_t child(int32_t node, unsigned char b) const {
    if (node < 0) return root_children_[b];
    const auto& kids = nodes_[node].children;
    const auto it = std::lower_bound(kids.begin(), kids.end(), std::make_pair(b, int32_t{0}));
    return it != kids.end() && it->first == b ? it->second : -1;
  }

  std::array<int32_t, 256> root_children_;
  std::vector<Node> nodes_;
};

AddedVocabulary::~AddedVocabulary() = default;

AddedVocabulary::AddedVocabulary(const Json& added_tokens, const std::string& key,
                                 const JsonFields& f, const BpeModel& model,
                                 const Normalizer* normalizer)
    : raw_trie_(std::make_unique<Trie>()), normalized_trie_(std::make_unique<Trie>()) {
  if (!added_tokens.is_array()) {
    f.fail(key, std::string("expected an array, got ") + added_tokens.type_name());
  }
  // HF (AddedVocabulary::add_tokens) numbers tokens that are not in the model's vocabulary
  // from the vocabulary's size on, in file order; the file's "id" is only checked against it.
  auto next_id = static_cast<int64_t>(model.size());
  for (size_t i = 0; i < added_tokens.size(); ++i) {
    const Json& t = added_tokens[i];
    const std::string tkey = JsonFields::index(key, i);
    AddedToken tok;
    tok.content = f.string(t, tkey, "content");
    tok.single_word = f.boolean(t, tkey, "single_word", false);
    tok.lstrip = f.boolean(t, tkey, "lstrip", false);
    tok.rstrip = f.boolean(t, tkey, "rstrip", false);
    tok.normalized = f.boolean(t, tkey, "normalized", true);
    tok.special = f.boolean(t, tkey, "special", false);
    if (find_invalid_utf8(tok.content) != std::string::npos) {
      f.fail(JsonFields::join(tkey, "content"), "not valid UTF-8");
    }
    if (tok.content.empty()) continue;  // HF ignores empty tokens

    int64_t id = 0;
    if (const auto it = by_content_.find(tok.content); it != by_content_.end()) {
      id = it->second;
    } else if (const auto model_id = model.token_to_id(tok.content)) {
      id = *model_id;
    } else {
      id = next_id++;
    }
    if (id > INT32_MAX) f.fail(tkey, "id overflows 32 bits");
    const int64_t declared = f.integer(t, tkey, "id");
    if (declared != id) {
      f.fail(JsonFields::join(tkey, "id"),
             "token \"" + tok.content + "\" is declared with id " + std::to_string(declared) +
                 " but Hugging Face tokenizers assigns it id " + std::to_string(id) +
                 " (model vocabulary id, or the next id after the vocabulary); the file is "
                 "inconsistent");
    }
    tok.id = static_cast<int32_t>(id);
    if (tok.normalized && normalizer != nullptr) {
      std::string normed = tok.content;
      normalizer->normalize(normed);
      if (normed != tok.content) {
        normalized_text_[tok.id] = std::move(normed);
      } else {
        normalized_text_.erase(tok.id);
      }
    }
    by_content_[tok.content] = tok.id;
    if (tok.special) special_.insert(tok.content);
    if (tok.single_word && !word_char_) {
      // Rust regex's Unicode \w (UTS #18): Alphabetic, marks, decimal numbers, connector
      // punctuation and the joiners.
      word_char_ = Regex::pcre2("^[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]");
    }
    by_id_[tok.id] = std::move(tok);  // a later entry with the same id replaces, as in HF
  }

  for (const auto& [id, tok] : by_id_) {
    const auto nt = normalized_text_.find(id);
    const std::string& pattern =
        tok.normalized && nt != normalized_text_.end() ? nt->second : tok.content;
    Trie& trie = tok.normalized ? *normalized_trie_ : *raw_trie_;
    if (!trie.insert(pattern, id)) {
      f.fail(key, "two added tokens match the same text \"" + pattern + "\"");
    }
  }
}

bool AddedVocabulary::has_tokens(bool normalized) const {
  return !(normalized ? normalized_trie_ : raw_trie_)->empty();
}

std::optional<int32_t> AddedVocabulary::id_of(std::string_view content) const {
  const auto it = by_content_.find(std::string(content));
  if (it == by_content_.end()) return std::nullopt;
  return it->second;
}

const std::string* AddedVocabulary::decode_text(int32_t id) const {
  const auto it = by_id_.find(id);
  if (it == by_id_.end()) return nullptr;
  const auto nt = normalized_text_.find(id);
  return nt != normalized_text_.end() ? &nt->second : &it->second.content;
}

size_t AddedVocabulary::count_in_model(const BpeModel& model) const {
  size_t n = 0;
  for (const auto& [content, id] : by_content_) n += model.token_to_id(content).has_value();
  return n;
}

size_t AddedVocabulary::id_bound() const {
  size_t bound = 0;
  for (const auto& [id, tok] : by_id_) bound = std::max(bound, static_cast<size_t>(id) + 1);
  return bound;
}

bool AddedVocabulary::is_special_text(std::string_view text) const {
  return special_.count(std::string(text)) > 0;
}

bool AddedVocabulary::is_word_char_at_end(std::string_view s) const {
  if (s.empty()) return false;
  size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return word_char_->search(s.substr(start));
}

bool AddedVocabulary::is_word_char_at_start(std::string_view s) const {
  return !s.empty() && word_char_->search(s);
}

namespace {

// Start of the run of white space that ends `s` (Rust's `\s*$` match start).
size_t trailing_space_start(std::string_view s) {
  size_t pos = s.size();
  while (pos > 0) {
    size_t start = pos - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t len = 0;
    if (!is_white_space(decode_utf8(s, start, &len))) break;
    pos = start;
  }
  return pos;
}

// Length of the run of white space that starts `s` (Rust's `^\s*` match end).
size_t leading_space_len(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t len = 0;
    if (!is_white_space(decode_utf8(s, pos, &len))) break;
    pos += len;
  }
  return pos;
}

}  // namespace

void AddedVocabulary::split(const Piece& piece, bool normalized, std::vector<Piece>& out) const {
  const std::string_view s = piece.text;
  const Trie& trie = normalized ? *normalized_trie_ : *raw_trie_;
  auto emit = [&](int32_t id, size_t begin, size_t end) {
    if (begin >= end) return;  // HF drops empty pieces
    out.push_back(Piece{std::string(s.substr(begin, end - begin)), id, piece.origin_from(begin)});
  };
  if (trie.empty()) {
    emit(-1, 0, s.size());
    return;
  }
  // HF's AddedVocabulary::find_matches, step for step, including its quirks: the scan resumes
  // at the end of the trie match even when rstrip took the spaces after it.
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < s.size()) {
    int32_t id = -1;
    size_t stop = 0;
    if (!trie.longest_at(s, pos, &id, &stop)) {
      ++pos;
      continue;
    }
    size_t start = pos;
    pos = stop;
    const AddedToken& tok = by_id_.at(id);
    if (tok.single_word) {
      const bool space_before = start == 0 || !is_word_char_at_end(s.substr(0, start));
      const bool space_after = stop == s.size() || !is_word_char_at_start(s.substr(stop));
      if (!space_before || !space_after) continue;
    }
    if (tok.lstrip) start = std::max(trailing_space_start(s.substr(0, start)), start_offset);
    if (tok.rstrip) stop += leading_space_len(s.substr(stop));
    if (start_offset < start) emit(-1, start_offset, start);
    emit(id, start, stop);
    start_offset = stop;
  }
  if (start_offset < s.size()) emit(-1, start_offset, s.size());
}

}  // namespace ft::tokenizer
