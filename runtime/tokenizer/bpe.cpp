#include "tokenizer/bpe.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <queue>

#include "tokenizer/unicode.h"

namespace ft::tokenizer {

namespace {

// One merge step of a word's symbol list, in HF's order: lowest rank first, then leftmost.
struct Candidate {
  int32_t rank;
  int32_t pos;
  int32_t new_id;
  bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

// A symbol of the word being merged: a doubly linked list over an array, as in HF's Word, so
// a merge is O(1) and stale queue entries can be recognised.
struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  int32_t len;  // bytes covered; 0 marks a symbol merged into its left neighbour
};

std::string optional_string(const JsonFields& f, const Json& model, const std::string& key,
                            const char* name) {
  const Json* v = f.optional(model, name);
  if (v == nullptr) return {};
  if (!v->is_string()) f.fail(JsonFields::join(key, name), "expected a string or null");
  return v->get<std::string>();
}

}  // namespace

BpeModel::BpeModel(const Json& model, const std::string& key, const JsonFields& f) {
  const std::string type = f.type_of(model, key);
  if (type != "BPE") f.unsupported(key, "model", type, "BPE");

  if (const Json* dropout = f.optional(model, "dropout")) {
    if (!dropout->is_number() || dropout->get<double>() != 0.0) {
      f.fail(JsonFields::join(key, "dropout"),
             "BPE dropout makes tokenization random; ft supports only null or 0");
    }
  }
  fuse_unk_ = f.boolean(model, key, "fuse_unk", false);
  byte_fallback_ = f.boolean(model, key, "byte_fallback", false);
  ignore_merges_ = f.boolean(model, key, "ignore_merges", false);
  continuing_subword_prefix_ = optional_string(f, model, key, "continuing_subword_prefix");
  end_of_word_suffix_ = optional_string(f, model, key, "end_of_word_suffix");

  // Vocabulary. tokens_ is filled completely before vocab_ takes views into it.
  const Json& vocab = f.object(model, key, "vocab");
  const std::string vocab_key = JsonFields::join(key, "vocab");
  tokens_.reserve(vocab.size());
  std::vector<int32_t> ids;
  ids.reserve(vocab.size());
  int64_t max_id = -1;
  for (const auto& [token, id_json] : vocab.items()) {
    // id_to_index_ has a slot per id up to the largest: a bound keeps a corrupt id from costing
    // gigabytes. No model's vocabulary comes near it (model.vocab_size allows 2^24 too).
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 ||
        id_json.get<int64_t>() >= kMaxVocab) {
      f.fail(vocab_key + "[\"" + token + "\"]",
             "expected an id in [0, " + std::to_string(kMaxVocab) + "), got " + id_json.dump());
    }
    if (find_invalid_utf8(token) != std::string::npos) {
      f.fail(vocab_key, "token \"" + token + "\" is not valid UTF-8");
    }
    tokens_.push_back(token);
    ids.push_back(static_cast<int32_t>(id_json.get<int64_t>()));
    max_id = std::max<int64_t>(max_id, ids.back());
  }
  id_to_index_.assign(static_cast<size_t>(max_id + 1), -1);
  vocab_.reserve(tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i) {
    int32_t& slot = id_to_index_[ids[i]];
    if (slot != -1) {
      f.fail(vocab_key, "tokens \"" + tokens_[slot] + "\" and \"" + tokens_[i] + "\" share id " +
                            std::to_string(ids[i]));
    }
    slot = static_cast<int32_t>(i);
    vocab_.emplace(tokens_[i], ids[i]);
  }

  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    const auto id = token_to_id(name);
    byte_ids_[b] = id ? *id : -1;
  }

  if (const Json* unk = f.optional(model, "unk_token")) {
    if (!unk->is_string()) f.fail(JsonFields::join(key, "unk_token"), "expected a string or null");
    unk_id_ = token_to_id(unk->get<std::string>());
    if (!unk_id_) {
      f.fail(JsonFields::join(key, "unk_token"),
             "\"" + unk->get<std::string>() + "\" is not in " + vocab_key);
    }
  }

  // Merges: ["a b", ...] (before tokenizers 0.20) or [["a", "b"], ...]. The rank is the
  // position; a pair listed twice keeps its last rank, as HF's map insertion does.
  const Json& merges = f.array(model, key, "merges");
  const std::string merges_key = JsonFields::join(key, "merges");
  merges_.reserve(merges.size());
  int32_t rank = 0;
  for (size_t i = 0; i < merges.size(); ++i) {
    const Json& m = merges[i];
    const std::string mkey = JsonFields::index(merges_key, i);
    std::string a;
    std::string b;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      if (s.rfind("#version", 0) == 0) continue;  // header line of merges.txt files
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        f.fail(mkey, "expected \"left right\" with exactly one space, got \"" + s + "\"");
      }
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      f.fail(mkey, "expected \"left right\" or [\"left\", \"right\"], got " + m.dump());
    }
    const auto a_id = token_to_id(a);
    const auto b_id = token_to_id(b);
    if (!a_id) f.fail(mkey, "\"" + a + "\" is not in " + vocab_key);
    if (!b_id) f.fail(mkey, "\"" + b + "\" is not in " + vocab_key);
    // With a continuing-subword prefix ("##"), the right part carries it and the merged token
    // does not; HF strips that many bytes unconditionally, so a right part without it is refused.
    const std::string& prefix = continuing_subword_prefix_;
    if (!prefix.empty() && b.compare(0, prefix.size(), prefix) != 0) {
      f.fail(mkey, "right part \"" + b + "\" lacks continuing_subword_prefix \"" + prefix + "\"");
    }
    const std::string merged = a + b.substr(prefix.size());
    const auto new_id = token_to_id(merged);
    if (!new_id) f.fail(mkey, "merged token \"" + merged + "\" is not in " + vocab_key);
    merges_[pair_key(*a_id, *b_id)] = Merge{rank, *new_id};
    ++rank;
  }
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_index_.size() || id_to_index_[id] < 0) {
    return nullptr;
  }
  return &tokens_[id_to_index_[id]];
}

const BpeModel::Merge* BpeModel::find_merge(int32_t a, int32_t b) const {
  const auto it = merges_.find(pair_key(a, b));
  return it == merges_.end() ? nullptr : &it->second;
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&](int32_t id, size_t len) {
    const auto n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back(Symbol{id, n - 1, -1, static_cast<int32_t>(len)});
  };

  // Characters to initial symbols (HF's BPE::merge_word). Unknown characters become their
  // <0xNN> byte tokens when every byte has one, else the unk token, consecutive unks fused
  // into one when fuse_unk is set; without an unk token they are dropped, as in HF.
  int32_t unk_pending = -1;  // id of an unk not yet added, -1 if none
  size_t unk_pending_len = 0;
  std::string piece;
  for (size_t pos = 0; pos < word.size();) {
    const size_t len = utf8_len(static_cast<unsigned char>(word[pos]));
    std::string_view ch = word.substr(pos, len);
    const bool first = pos == 0;
    pos += len;
    const bool last = pos >= word.size();
    if ((!first && !continuing_subword_prefix_.empty()) || (last && !end_of_word_suffix_.empty())) {
      piece.clear();
      if (!first) piece += continuing_subword_prefix_;
      piece += ch;
      if (last) piece += end_of_word_suffix_;
      ch = piece;
    }
    if (const auto id = token_to_id(ch)) {
      if (unk_pending >= 0) {
        add(unk_pending, unk_pending_len);
        unk_pending = -1;
      }
      add(*id, len);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (const char c : ch) all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        // HF adds these without flushing a pending unk first; the order is kept.
        for (const char c : ch) add(byte_ids_[static_cast<unsigned char>(c)], 1);
        continue;
      }
    }
    if (unk_id_) {
      if (unk_pending >= 0 && fuse_unk_) {
        unk_pending_len += len;
      } else {
        if (unk_pending >= 0) add(unk_pending, unk_pending_len);
        unk_pending = *unk_id_;
        unk_pending_len = len;
      }
    }
  }
  if (unk_pending >= 0) add(unk_pending, unk_pending_len);

  // Merge loop (HF's Word::merge_all): a min-queue of candidate merges; an entry whose pair has
  // changed since it was queued is recognised by its result id and skipped.
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const Merge* m = find_merge(symbols[i].id, symbols[i + 1].id)) {
      queue.push(Candidate{m->rank, static_cast<int32_t>(i), m->new_id});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& cur = symbols[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const Symbol right = symbols[cur.next];
    const Merge* now = find_merge(cur.id, right.id);
    if (now == nullptr || now->new_id != top.new_id) continue;

    symbols[cur.next].len = 0;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;

    if (cur.prev >= 0) {
      if (const Merge* m = find_merge(symbols[cur.prev].id, cur.id)) {
        queue.push(Candidate{m->rank, cur.prev, m->new_id});
      }
    }
    if (cur.next >= 0) {
      if (const Merge* m = find_merge(cur.id, symbols[cur.next].id)) {
        queue.push(Candidate{m->rank, top.pos, m->new_id});
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.len != 0) out.push_back(s.id);
  }
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    // Llama 3: a word that is itself a token is taken whole, whatever the merges would make.
    if (const auto id = token_to_id(word)) {
      out.push_back(*id);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    // One key buffer per thread: a lookup allocates nothing once it has grown.
    thread_local std::string key;
    key.assign(word);
    std::shared_lock<std::shared_mutex> lock(cache_mu_);
    const auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::unique_lock<std::shared_mutex> lock(cache_mu_);
    if (cache_.size() < kCacheCapacity) {
      cache_.emplace(std::string(word), std::vector<int32_t>(out.begin() + start, out.end()));
    }
  }
}

}  // namespace ft::tokenizer
