// Unit tests of the flat-group layout (parallel/layout.h): which elements of a member tensor a
// shard, or one copy's share of a shard, holds — inside, across either edge, disjoint, an empty
// shard, the last rank's padded shard — and that the shards hand out every element exactly once.
#include "parallel/layout.h"

#include <catch2/catch.hpp>
#include <vector>

using namespace ft::parallel;

namespace {

bool same(const ShardPiece& p, int64_t begin, int64_t end, int64_t shard_offset) {
  return p.begin == begin && p.end == end && p.shard_offset == shard_offset;
}

}  // namespace

TEST_CASE("layout: a group is padded to a multiple of the shards and cut into equal shards",
          "[unit]") {
  const FlatLayout l = FlatLayout::of(10, 4);
  CHECK(l.padded == 12);
  CHECK(l.shard_numel == 3);
  CHECK(l.shard(0).begin == 0);
  CHECK(l.shard(3).begin == 9);
  CHECK(l.shard(3).end == 12);  // two of its three elements are padding
  const FlatLayout whole = FlatLayout::of(10, 1);
  CHECK(whole.padded == 10);
  CHECK(whole.shard(0).size() == 10);
  const FlatLayout exact = FlatLayout::of(12, 4);
  CHECK(exact.padded == 12);
  CHECK(exact.shard_numel == 3);
}

TEST_CASE("layout: the piece of a tensor a shard holds, at every overlap", "[unit]") {
  // 4 shards of 6 elements: shard 1 holds group elements [6, 12).
  const FlatLayout l = FlatLayout::of(24, 4);
  SECTION("the tensor lies inside the shard") { CHECK(same(intersect(l, 1, 7, 3), 0, 3, 1)); }
  SECTION("the tensor starts before the shard") { CHECK(same(intersect(l, 1, 2, 6), 4, 6, 0)); }
  SECTION("the tensor runs past the shard's end") { CHECK(same(intersect(l, 1, 10, 5), 0, 2, 4)); }
  SECTION("the tensor covers the shard and more on both sides") {
    CHECK(same(intersect(l, 1, 0, 24), 6, 12, 0));
  }
  SECTION("disjoint: before, touching either edge, after") {
    CHECK(intersect(l, 1, 0, 3).empty());
    CHECK(same(intersect(l, 1, 0, 6), 0, 0, 0));
    CHECK(same(intersect(l, 1, 12, 4), 0, 0, 0));
    CHECK(intersect(l, 1, 18, 6).empty());
  }
  SECTION("an empty tensor holds nothing anywhere") { CHECK(same(intersect(l, 1, 8, 0), 0, 0, 0)); }
}

TEST_CASE("layout: empty shards and the last rank's padded shard", "[unit]") {
  SECTION("a group of no elements: every shard is empty") {
    const FlatLayout l = FlatLayout::of(0, 4);
    CHECK(l.padded == 0);
    CHECK(l.shard_numel == 0);
    for (int s = 0; s < 4; ++s) {
      CHECK(l.shard(s).empty());
      CHECK(intersect(l, s, 0, 0).empty());
    }
  }
  SECTION("fewer elements than shards: the last shards hold padding only") {
    const FlatLayout l = FlatLayout::of(2, 4);  // shards of 1: [0,1) [1,2) [2,3) [3,4)
    CHECK(same(intersect(l, 1, 0, 2), 1, 2, 0));
    CHECK(intersect(l, 2, 0, 2).empty());
    CHECK(intersect(l, 3, 0, 2).empty());
  }
  SECTION("the last tensor ends inside the last shard, before its padding") {
    const FlatLayout l = FlatLayout::of(10, 4);  // shard 3 is [9, 12): 10 and 11 are padding
    CHECK(same(intersect(l, 3, 8, 2), 1, 2, 0));
    CHECK(same(intersect(l, 2, 8, 2), 0, 1, 2));
  }
}

TEST_CASE("layout: the shards hand out every element of every member exactly once", "[unit]") {
  const std::vector<int64_t> members = {5, 1, 0, 13, 4};  // side by side: 23 elements
  for (int shards : {1, 2, 3, 4, 8, 30}) {
    const FlatLayout l = FlatLayout::of(23, shards);
    int64_t offset = 0;
    for (int64_t numel : members) {
      int64_t next = 0;  // the tensor element the next shard's piece must start at
      for (int s = 0; s < shards; ++s) {
        const ShardPiece p = intersect(l, s, offset, numel);
        if (p.empty()) continue;
        CHECK(p.begin == next);
        CHECK(p.shard_offset + p.numel() <= l.shard_numel);
        CHECK(l.shard(s).begin + p.shard_offset == offset + p.begin);
        next = p.end;
      }
      CHECK(next == numel);
      offset += numel;
    }
  }
}

TEST_CASE("layout: copies of a shard share it out in near-equal consecutive parts", "[unit]") {
  const Range shard{6, 11};  // 5 elements over 2 copies: 3 and 2
  CHECK(share_of(shard, 2, 0).begin == 6);
  CHECK(share_of(shard, 2, 0).end == 9);
  CHECK(share_of(shard, 2, 1).begin == 9);
  CHECK(share_of(shard, 2, 1).end == 11);
  // More copies than elements: the last ones get nothing.
  const Range small{3, 5};
  CHECK(share_of(small, 4, 0).size() == 1);
  CHECK(share_of(small, 4, 1).size() == 1);
  CHECK(share_of(small, 4, 2).empty());
  CHECK(share_of(small, 4, 3).empty());
  // A share is a held range inside the shard: the piece's offset is still from the shard's start.
  const FlatLayout l = FlatLayout::of(24, 4);     // shard 1: [6, 12)
  const Range held = share_of(l.shard(1), 2, 1);  // [9, 12)
  CHECK(same(intersect(7, 4, held, l.shard(1).begin), 2, 4, 3));
  CHECK(intersect(0, 9, held, l.shard(1).begin).empty());
}
