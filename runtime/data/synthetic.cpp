#include "data/synthetic.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace ft::data {
namespace {

// splitmix64: a counter-based generator, so sample i never depends on samples before it.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

SyntheticSource::SyntheticSource(SyntheticOptions options, int64_t start_sample)
    : options_(options), next_sample_(start_sample) {
  FT_CHECK(options_.vocab_size > kSep + 2, "the synthetic task needs a vocabulary of at least ",
           kSep + 3, " tokens, got ", options_.vocab_size);
  FT_CHECK(2 * options_.max_len + 3 <= options_.seq_len, "data.seq_len ", options_.seq_len,
           " is too short for the synthetic task (needs ", 2 * options_.max_len + 3, ")");
  symbols_ = std::min<int64_t>(kMaxSymbols, options_.vocab_size - (kSep + 1));
  permutation_.resize(symbols_);
  std::iota(permutation_.begin(), permutation_.end(), 0);
  uint64_t state = options_.seed;
  for (int64_t i = symbols_ - 1; i > 0; --i) {  // Fisher-Yates with the task seed
    state = mix(state);
    std::swap(permutation_[i], permutation_[state % static_cast<uint64_t>(i + 1)]);
  }
}

void SyntheticSource::seek(const std::vector<int64_t>& position) {
  FT_CHECK(position.size() == 2 && position[0] >= 0 && position[1] >= 0,
           "synthetic data: a position is (row, sample) >= 0; the checkpoint holds another kind");
  next_row_ = position[0];
  next_sample_ = position[1];
}

void SyntheticSource::sample(int64_t index, std::vector<int64_t>& tokens,
                             std::vector<bool>& trained) const {
  uint64_t h = mix(options_.seed ^ mix(static_cast<uint64_t>(index) + 1));
  const int64_t n =
      options_.min_len + static_cast<int64_t>(h % (options_.max_len - options_.min_len + 1));
  tokens.clear();
  trained.clear();
  std::vector<int64_t> prompt(n);
  for (int64_t i = 0; i < n; ++i) {
    h = mix(h);
    prompt[i] = static_cast<int64_t>(h % static_cast<uint64_t>(symbols_));
  }
  const bool p = options_.train_on_prompt;
  tokens.push_back(kBos);
  trained.push_back(false);  // never predicted from a previous sample
  for (int64_t s : prompt) {
    tokens.push_back(kSep + 1 + s);
    trained.push_back(p);
  }
  tokens.push_back(kSep);
  trained.push_back(p);
  for (int64_t s : prompt) {
    tokens.push_back(kSep + 1 + permutation_[s]);
    trained.push_back(true);
  }
  tokens.push_back(kEos);
  trained.push_back(true);
}

Batch SyntheticSource::next() {
  const int64_t B = options_.micro_batch, T = options_.seq_len;
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor ids = at::full({B, T}, kPad, opts), labels = at::full({B, T}, -100, opts);
  at::Tensor pos = at::zeros({B, T}, opts), seg = at::zeros({B, T}, opts);
  auto I = ids.accessor<int64_t, 2>();
  auto L = labels.accessor<int64_t, 2>();
  auto P = pos.accessor<int64_t, 2>();
  auto S = seg.accessor<int64_t, 2>();
  std::vector<int64_t> tok;
  std::vector<bool> trained;
  const int W = options_.world_size;
  for (int64_t b = 0; b < B; ++b) {
    // Global rows are dealt out round-robin; rows of other ranks are generated and dropped, so
    // the rows of all ranks together are the rows one rank would make, whatever the world size.
    for (;;) {
      const bool mine = next_row_ % W == options_.rank;
      ++next_row_;
      int64_t t = 0, segment = 0;
      for (;;) {
        sample(next_sample_, tok, trained);
        if (t + static_cast<int64_t>(tok.size()) > T) break;  // starts the next row instead
        for (size_t i = 0; mine && i < tok.size(); ++i) {
          I[b][t + i] = tok[i];
          L[b][t + i] = trained[i] ? tok[i] : -100;
          P[b][t + i] = static_cast<int64_t>(i);
          S[b][t + i] = segment;
        }
        t += static_cast<int64_t>(tok.size());
        ++segment;
        ++next_sample_;
        if (!options_.pack) break;
      }
      if (!mine) continue;
      for (; t < T; ++t) S[b][t] = segment;  // padding: its own segment, no loss
      break;
    }
  }
  return {ids, labels, pos, seg};
}

}  // namespace ft::data
