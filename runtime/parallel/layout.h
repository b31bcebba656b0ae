// Where a parameter's elements live when the engine splits a flat group over S ranks: the group
// (its members side by side, padded to a multiple of S) in S equal shards, and which elements of
// which member a shard, or a share of one, holds. Pure values and functions; thread-safe.
#pragma once

#include <cstdint>

namespace ft::parallel {

// Elements [begin, end).
struct Range {
  int64_t begin = 0, end = 0;
  bool empty() const { return end <= begin; }
  int64_t size() const { return empty() ? 0 : end - begin; }
};

// A flat group of `numel` elements split over `shards` ranks (1: replicated, one shard of all).
struct FlatLayout {
  int64_t numel = 0;        // the members' elements, side by side
  int shards = 1;           // S
  int64_t padded = 0;       // numel rounded up to a multiple of S
  int64_t shard_numel = 0;  // padded / S: every shard, the last one's tail being padding

  static FlatLayout of(int64_t numel, int shards);
  // The group elements shard `s` holds: [s * shard_numel, (s + 1) * shard_numel).
  Range shard(int s) const;
};

// The part of one member tensor that a range of a shard holds.
struct ShardPiece {
  int64_t begin = 0, end = 0;  // elements of the tensor (flattened in C order); {0, 0}: none
  int64_t shard_offset = 0;    // where tensor element `begin` sits in the shard (0 when none)
  bool empty() const { return end <= begin; }
  int64_t numel() const { return end - begin; }
};

// The elements of the tensor at group elements [tensor_offset, tensor_offset + tensor_numel) that
// lie in `held`, a range of group elements within the shard whose first group element is
// `shard_begin`.
ShardPiece intersect(int64_t tensor_offset, int64_t tensor_numel, Range held, int64_t shard_begin);
// The elements of that tensor that shard `s` holds.
ShardPiece intersect(const FlatLayout& layout, int s, int64_t tensor_offset, int64_t tensor_numel);

// Part `part` (0-based) of `parts` near-equal consecutive parts of `r`, each ceil(size / parts)
// long but the last ones, which may be shorter or empty: how the ranks holding copies of the same
// elements share them out.
Range share_of(Range r, int parts, int part);

}  // namespace ft::parallel
