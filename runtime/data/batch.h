// A micro-batch as the training loop consumes it, and the interface of where batches come from.
// Plain data + an interface; implementations document their own thread-safety.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ft::data {

struct Batch {
  at::Tensor input_ids;     // [B, T] int64
  at::Tensor labels;        // [B, T] int64, -100 where a token is not trained on
  at::Tensor position_ids;  // [B, T] int64, restarting at 0 in each packed segment
  at::Tensor segment_ids;   // [B, T] int64 (packed sequences) or undefined
  // Every row holds at most one record followed by padding: plain causal attention then gives
  // every trained token the same result as the segment mask, through the fused (flash) kernel.
  bool single_segment_rows = false;
  // Tokens that carry a loss after the next-token shift (labels[:, 1:] != -100).
  int64_t target_tokens() const;
  // Tokens that are not padding (id 0 in a padding segment); all tokens when unsegmented.
  int64_t input_tokens() const;
  // What attention needs: the segment ids, or undefined when causal attention is exact.
  at::Tensor attention_segments() const { return single_segment_rows ? at::Tensor() : segment_ids; }
  // The same batch with every tensor on `device` (itself when already there).
  Batch to(const at::Device& device) const;
};

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual Batch next() = 0;
  // Samples handed out so far, counted globally (independent of world size): the data position a
  // checkpoint records.
  virtual int64_t samples_consumed() const = 0;
  // The stream's position as a few integers, and going back to one (a resumed run). A position
  // taken from the last rank of a run is valid at any world size (it is where the global stream
  // stands); each rank's own is exact at the same world size.
  virtual std::vector<int64_t> position() const = 0;
  virtual void seek(const std::vector<int64_t>& position) = 0;
};

}  // namespace ft::data
