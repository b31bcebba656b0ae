#include "data/streamed_records.h"

#include <algorithm>
#include <future>

#include "core/error.h"

namespace ft::data {

void StreamedRecordFile::set_layout(int64_t records, std::vector<int64_t> segment_starts) {
  FT_ASSERT(!segment_starts.empty() && segment_starts[0] == 0, "segments of ", path());
  records_ = records;
  segment_starts_ = std::move(segment_starts);
}

std::string StreamedRecordFile::read(int64_t i) const {
  FT_ASSERT(i >= 0 && i < records_, "record ", i, " of ", records_);
  int64_t first = 0;
  std::shared_ptr<const RecordBlock> block;
  {
    std::lock_guard<std::mutex> lock(mu_);
    block = block_of(i, &first);
  }
  return block->text(static_cast<size_t>(i - first));
}

std::shared_ptr<const RecordBlock> StreamedRecordFile::block_of(int64_t i, int64_t* first) const {
  auto it = cache_.upper_bound(i);
  if (it != cache_.begin()) {
    --it;
    if (i < it->first + static_cast<int64_t>(it->second.block->size())) {
      it->second.used = ++clock_;
      *first = it->first;
      return it->second.block;
    }
  }
  const size_t segment =
      static_cast<size_t>(std::upper_bound(segment_starts_.begin(), segment_starts_.end(), i) -
                          segment_starts_.begin() - 1);
  if (!reader_ || reader_segment_ != segment || reader_next_ > i) {
    if (ahead_.valid()) ahead_.wait();  // its block, or its error, is not wanted
    ahead_ = {};
    reader_ = open_segment(segment);
    reader_segment_ = segment;
    reader_next_ = segment_starts_[segment];
  }
  for (;;) {
    std::shared_ptr<const RecordBlock> block = ahead_.valid() ? ahead_.get() : reader_->next();
    if (block && reader_next_ + static_cast<int64_t>(block->size()) < records_) {
      ahead_ = std::async(std::launch::async, [r = reader_.get()] { return r->next(); });
    }
    FT_CHECK_T(FormatError, block && block->size() > 0, path(), ": the file ended before record ",
               i, " (it holds fewer records than when ft ",
               "opened it: was it changed while being read?)");
    const int64_t start = reader_next_;
    reader_next_ += static_cast<int64_t>(block->size());
    cached_bytes_ += block->bytes();
    cache_[start] = {block, ++clock_};
    evict_beyond_budget(start);
    if (i < reader_next_) {
      *first = start;
      return block;
    }
  }
}

void StreamedRecordFile::evict_beyond_budget(int64_t keep) const {
  while (cached_bytes_ > cache_bytes_ && cache_.size() > 1) {
    auto oldest = cache_.end();
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->first == keep) continue;
      if (oldest == cache_.end() || it->second.used < oldest->second.used) oldest = it;
    }
    cached_bytes_ -= oldest->second.block->bytes();
    cache_.erase(oldest);
  }
}

}  // namespace ft::data
