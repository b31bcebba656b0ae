#include "parallel/layout.h"

#include <algorithm>

#include "core/error.h"

namespace ft::parallel {

FlatLayout FlatLayout::of(int64_t numel, int shards) {
  FT_ASSERT(numel >= 0 && shards >= 1, "flat group of ", numel, " elements over ", shards,
            " shards");
  FlatLayout l;
  l.numel = numel;
  l.shards = shards;
  l.padded = (numel + shards - 1) / shards * shards;
  l.shard_numel = l.padded / shards;
  return l;
}

Range FlatLayout::shard(int s) const {
  FT_ASSERT(s >= 0 && s < shards, "shard ", s, " of ", shards);
  return {s * shard_numel, (s + 1) * shard_numel};
}

ShardPiece intersect(int64_t tensor_offset, int64_t tensor_numel, Range held, int64_t shard_begin) {
  const int64_t lo = std::max(tensor_offset, held.begin);
  const int64_t hi = std::min(tensor_offset + tensor_numel, held.end);
  if (hi <= lo) return {};
  return {lo - tensor_offset, hi - tensor_offset, lo - shard_begin};
}

ShardPiece intersect(const FlatLayout& layout, int s, int64_t tensor_offset, int64_t tensor_numel) {
  const Range shard = layout.shard(s);
  return intersect(tensor_offset, tensor_numel, shard, shard.begin);
}

Range share_of(Range r, int parts, int part) {
  FT_ASSERT(parts >= 1 && part >= 0 && part < parts, "part ", part, " of ", parts);
  const int64_t per = (r.size() + parts - 1) / parts;
  const int64_t begin = std::min(r.end, r.begin + part * per);
  return {begin, std::min(r.end, begin + per)};
}

}  // namespace ft::parallel
