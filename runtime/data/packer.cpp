#include "data/packer.h"

namespace ft::data {

Batch pack_rows(const PackOptions& o, const std::function<const TokenizedRecord&()>& peek,
                const std::function<void()>& pop) {
  constexpr int64_t kPad = 0, kIgnore = -100;
  const int64_t B = o.micro_batch, T = o.seq_len;
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor ids = at::full({B, T}, kPad, opts), labels = at::full({B, T}, kIgnore, opts);
  at::Tensor pos = at::zeros({B, T}, opts), seg = at::zeros({B, T}, opts);
  auto I = ids.accessor<int64_t, 2>();
  auto L = labels.accessor<int64_t, 2>();
  auto P = pos.accessor<int64_t, 2>();
  auto S = seg.accessor<int64_t, 2>();
  bool single = true;
  for (int64_t b = 0; b < B; ++b) {
    int64_t t = 0, segment = 0;
    for (;;) {
      const TokenizedRecord& r = peek();
      const int64_t len = static_cast<int64_t>(r.ids.size());
      if (t + len > T) break;  // starts the next row instead (len <= T after truncation)
      for (int64_t i = 0; i < len; ++i, ++t) {
        I[b][t] = r.ids[i];
        L[b][t] = r.labels[i];
        P[b][t] = i;
        S[b][t] = segment;
      }
      ++segment;
      pop();
      if (!o.pack) break;
    }
    for (; t < T; ++t) S[b][t] = segment;  // padding: its own segment, no loss
    single = single && segment <= 1;
  }
  Batch batch{ids, labels, pos, seg};
  batch.single_segment_rows = single;
  return batch;
}

void RowCount::add(int64_t length) {
  if (length <= 0) return;
  if (open_ && (!pack_ || filled_ + length > seq_len_)) {
    ++rows_;
    filled_ = 0;
  }
  filled_ += length;
  tokens_ += length;
  open_ = true;
}

}  // namespace ft::data
