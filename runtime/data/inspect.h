// What `ft data show` prints: records as the trainer sees them (the rendered text, the token ids,
// which tokens carry the loss) and statistics of a whole JSONL dataset under a preset's data
// settings (records, tokens, truncated and malformed records, packing efficiency, lengths).
// Plain functions over a JsonlSource; not thread-safe (the source is not).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/jsonl_source.h"

namespace ft::data {

struct DataStats {
  int64_t records = 0;     // records in the file
  int64_t covered = 0;     // records the statistics cover: all, or those before stopped_origin
  int64_t malformed = 0;   // skipped under data.on_bad_record=skip
  int64_t empty = 0;       // records that give no token
  int64_t tokens = 0;      // of the usable records, whole
  int64_t trained = 0;     // tokens that carry a loss, after truncation
  int64_t truncated = 0;   // records longer than seq_len: cut to it for training
  int64_t cut_tokens = 0;  // tokens those lose
  int64_t seq_len = 0;
  int64_t rows = 0;        // rows of seq_len one epoch packs into
  int64_t row_tokens = 0;  // tokens in those rows (the rest is padding)
  int64_t shortest = 0, longest = 0, median = 0;
  // Records per length bucket: [1, 2), [2, 4), ... [2^k, 2^(k+1)), as (lower bound, count).
  std::vector<std::pair<int64_t, int64_t>> histogram;
  // Under data.on_bad_record=error, the first malformed record ("FILE:LINE") and its error: the
  // statistics cover the records before it. Empty when there is none.
  std::string stopped_origin, stopped_error;
  // Set by the caller: the settings an optimizer step has, and where they come from ("preset
  // lora-7b"), for the steps an epoch makes.
  int64_t micro_batch = 1, grad_accum = 1;
  std::string settings_from;
  double packing_efficiency() const {
    return rows > 0 ? static_cast<double>(row_tokens) / static_cast<double>(rows * seq_len) : 0;
  }
};

// Statistics of every record (tokenized once, on all cores; `progress` as scan_epoch's); under
// data.on_bad_record=error, of the records before the first malformed one (named in the result).
DataStats data_stats(JsonlSource& source, const std::function<void(int64_t, int64_t)>& progress);
std::string format_stats(const DataStats& stats);

// Record `record` (file order) as the trainer sees it: where it comes from, the rendered text
// (decoded from the ids) and the ids, the ones that carry the loss highlighted (ANSI colours
// when `color`, else between ⟦ and ⟧), and what seq_len cuts off. Without a tokenizer
// (pre-tokenized data), the ids only.
std::string show_record(const JsonlSource& source, int64_t record, bool color);

}  // namespace ft::data
