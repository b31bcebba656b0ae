// A RecordFile that can only be read forward, segment by segment (a compressed JSONL file is one
// segment, a Parquet file one per row group): records come in blocks, kept in a cache bounded in
// bytes. A read inside a cached block is a copy; one after the open reader's position reads
// forward to it (the next block is read ahead on its own thread); one before it reopens its
// segment. Thread-safe: one mutex guards the reader and
// the cache (blocks are decoded under it, so two threads never decode the same one); a record's
// text is made outside it, so threads convert rows in parallel.
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/record_file.h"

namespace ft::data {

// Consecutive records of a file, decoded. Immutable once made: read from several threads.
class RecordBlock {
 public:
  virtual ~RecordBlock() = default;
  virtual size_t size() const = 0;
  // Record k of the block as JSON text; FormatError naming it when it has none.
  virtual std::string text(size_t k) const = 0;
  virtual size_t bytes() const = 0;  // memory held
};

// A block of lines already in JSON text.
class TextBlock final : public RecordBlock {
 public:
  std::vector<std::string> texts;
  size_t held = 0;  // bytes of the texts
  size_t size() const override { return texts.size(); }
  std::string text(size_t k) const override { return texts[k]; }
  size_t bytes() const override { return held; }
};

// Reads one segment forward.
class BlockReader {
 public:
  virtual ~BlockReader() = default;
  // The next block of the segment (after the previous one), or null at its end.
  virtual std::shared_ptr<const RecordBlock> next() = 0;
};

class StreamedRecordFile : public RecordFile {
 public:
  static constexpr size_t kDefaultCacheBytes = size_t{16} << 20;

  int64_t size() const override { return records_; }
  std::string read(int64_t i) const override;

 protected:
  StreamedRecordFile(std::string path, size_t cache_bytes)
      : RecordFile(std::move(path)), cache_bytes_(cache_bytes) {}
  // `records` in all; segment k starts at record segment_starts[k] (the first at 0).
  void set_layout(int64_t records, std::vector<int64_t> segment_starts);
  virtual std::unique_ptr<BlockReader> open_segment(size_t segment) const = 0;
  size_t cache_bytes() const { return cache_bytes_; }

 private:
  struct Cached {
    std::shared_ptr<const RecordBlock> block;
    uint64_t used = 0;  // the cache's clock at its last read: the least recent goes first
  };
  // The block holding record i, read (forward, or from its segment's start) when not cached.
  // Caller holds mu_.
  std::shared_ptr<const RecordBlock> block_of(int64_t i, int64_t* first) const;
  void evict_beyond_budget(int64_t keep) const;

  int64_t records_ = 0;
  std::vector<int64_t> segment_starts_;
  size_t cache_bytes_;
  mutable std::mutex mu_;
  mutable std::map<int64_t, Cached> cache_;  // by first record
  mutable size_t cached_bytes_ = 0;
  mutable uint64_t clock_ = 0;
  mutable std::unique_ptr<BlockReader> reader_;
  mutable size_t reader_segment_ = 0;
  mutable int64_t reader_next_ = 0;  // the first record of the block the reader gives next
  // That block, being read on another thread while the records before it are used (reading in
  // file order then never waits for a decode). Declared after reader_: destroyed (waited for)
  // first.
  mutable std::future<std::shared_ptr<const RecordBlock>> ahead_;
};

}  // namespace ft::data
