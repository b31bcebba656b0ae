// Packing tokenized records into [B, T] rows, shared by every record stream (one JSONL file, a
// mixture of several): pack_rows fills a batch, RowCount counts the rows the same rule gives from
// record lengths alone (an epoch's size). Plain functions and a value type; thread-safe.
#pragma once

#include <cstdint>
#include <functional>

#include "data/batch.h"
#include "data/records.h"

namespace ft::data {

struct PackOptions {
  int64_t micro_batch = 1;
  int64_t seq_len = 0;
  bool pack = true;  // several records per row; false: one record per row, padded
};

// A batch of micro_batch rows of seq_len tokens. `peek()` gives the next record (cut to seq_len,
// its first label -100; the same record until `pop()`), `pop()` consumes it once it is placed; a
// record that does not fit the current row starts the next one, so a record is never split.
// Padding is id 0 in its own segment with no loss.
Batch pack_rows(const PackOptions& o, const std::function<const TokenizedRecord&()>& peek,
                const std::function<void()>& pop);

// The rows pack_rows fills from records of the lengths add() is given, in order.
class RowCount {
 public:
  explicit RowCount(const PackOptions& o) : seq_len_(o.seq_len), pack_(o.pack) {}
  // A record of `length` tokens (already cut to seq_len); <= 0 takes no room.
  void add(int64_t length);
  int64_t rows() const { return rows_ + (open_ ? 1 : 0); }
  int64_t tokens() const { return tokens_; }  // tokens placed (the rest of the rows is padding)

 private:
  int64_t seq_len_;
  bool pack_;
  int64_t rows_ = 0, tokens_ = 0, filled_ = 0;
  bool open_ = false;
};

}  // namespace ft::data
