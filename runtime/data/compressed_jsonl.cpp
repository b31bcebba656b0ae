#include "data/compressed_jsonl.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "data/streamed_records.h"

namespace ft::data {
namespace {

constexpr size_t kChunk = size_t{1} << 20;
// A block: this many records, or fewer that reach kBlockBytes.
constexpr size_t kBlockRecords = 4096, kBlockBytes = size_t{4} << 20;

// The file's bytes, decompressed, in pieces. Throws FormatError (without a line: LineReader adds
// it) for corrupt or truncated data.
class Decompressor {
 public:
  explicit Decompressor(const std::string& path) : path_(path) {
    file_ = std::fopen(path.c_str(), "rb");
    FT_CHECK_T(FormatError, file_ != nullptr, path,
               ": cannot open the data file: ", std::strerror(errno));
  }
  virtual ~Decompressor() {
    if (file_) std::fclose(file_);
  }
  // Up to `n` decompressed bytes into `out`; 0 at the end of the data.
  virtual size_t read(char* out, size_t n) = 0;
  uint64_t compressed_read() const { return consumed_; }

 protected:
  // Refills the input buffer when it is empty; false at the end of the file.
  bool fill() {
    if (in_pos_ < in_len_) return true;
    in_len_ = std::fread(in_.data(), 1, in_.size(), file_);
    in_pos_ = 0;
    consumed_ += in_len_;
    FT_CHECK_T(FormatError, !std::ferror(file_), "read failed: ", std::strerror(errno));
    return in_len_ > 0;
  }
  std::string path_;
  std::FILE* file_ = nullptr;
  std::vector<unsigned char> in_ = std::vector<unsigned char>(kChunk);
  size_t in_len_ = 0, in_pos_ = 0;
  uint64_t consumed_ = 0;
};

class GzipReader final : public Decompressor {
 public:
  explicit GzipReader(const std::string& path) : Decompressor(path) {
    // 15 + 32: a gzip or zlib header, detected.
    FT_CHECK(inflateInit2(&z_, 15 + 32) == Z_OK, "zlib: cannot initialise: out of memory");
  }
  ~GzipReader() override { inflateEnd(&z_); }
  size_t read(char* out, size_t n) override {
    z_.next_out = reinterpret_cast<Bytef*>(out);
    z_.avail_out = static_cast<uInt>(n);
    while (z_.avail_out == n) {
      if (!fill()) {
        FT_CHECK_T(FormatError, !mid_stream_, "the gzip data ends early (a truncated file)");
        return 0;
      }
      z_.next_in = in_.data() + in_pos_;
      z_.avail_in = static_cast<uInt>(in_len_ - in_pos_);
      const int rc = inflate(&z_, Z_NO_FLUSH);
      in_pos_ = in_len_ - z_.avail_in;
      mid_stream_ = true;
      if (rc == Z_STREAM_END) {
        inflateReset(&z_);  // another gzip member may follow (cat a.gz b.gz)
        mid_stream_ = false;
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        throw FormatError(
            detail::cat("corrupt gzip data (zlib: ", z_.msg ? z_.msg : "error ", rc, ")"));
      }
    }
    return n - z_.avail_out;
  }

 private:
  z_stream z_{};
  bool mid_stream_ = false;
};

class ZstdReader final : public Decompressor {
 public:
  explicit ZstdReader(const std::string& path) : Decompressor(path), z_(ZSTD_createDStream()) {
    FT_CHECK(z_ != nullptr, "zstd: cannot create a decompression stream: out of memory");
  }
  ~ZstdReader() override { ZSTD_freeDStream(z_); }
  size_t read(char* out, size_t n) override {
    ZSTD_outBuffer o{out, n, 0};
    while (o.pos == 0) {
      if (!fill()) {
        FT_CHECK_T(FormatError, !mid_frame_, "the zstd data ends early (a truncated file)");
        return 0;
      }
      ZSTD_inBuffer i{in_.data(), in_len_, in_pos_};
      const size_t rc = ZSTD_decompressStream(z_, &o, &i);
      in_pos_ = i.pos;
      FT_CHECK_T(FormatError, !ZSTD_isError(rc), "corrupt zstd data (zstd: ", ZSTD_getErrorName(rc),
                 ")");
      mid_frame_ = rc != 0;  // 0: a frame just ended
    }
    return o.pos;
  }

 private:
  ZSTD_DStream* z_;
  bool mid_frame_ = false;
};

std::unique_ptr<Decompressor> open_stream(const std::string& path, Compression codec) {
  if (codec == Compression::kGzip) return std::make_unique<GzipReader>(path);
  return std::make_unique<ZstdReader>(path);
}

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }

// The non-blank lines of the decompressed text, with their 1-based numbers. A decompression error
// becomes a FormatError naming the file and the last line read.
class LineReader {
 public:
  LineReader(const std::string& path, Compression codec)
      : path_(path), in_(open_stream(path, codec)) {}
  bool next(std::string& text, int64_t& line) {
    for (;;) {
      const char* begin = buf_.data() + pos_;
      const char* nl =
          len_ > pos_ ? static_cast<const char*>(std::memchr(begin, '\n', len_ - pos_)) : nullptr;
      if (!nl && !eof_) {
        refill();
        continue;
      }
      const size_t end = nl ? static_cast<size_t>(nl - buf_.data()) : len_;
      if (end == pos_ && !nl) return false;  // the end, after a final newline
      text.assign(buf_.data() + pos_, end - pos_);
      pos_ = nl ? end + 1 : len_;
      line = ++line_;
      if (!text.empty() && text.back() == '\r') text.pop_back();
      if (!std::all_of(text.begin(), text.end(), is_blank)) return true;
    }
  }
  uint64_t compressed_read() const { return in_->compressed_read(); }

 private:
  void refill() {
    buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(pos_));
    len_ -= pos_;
    pos_ = 0;
    buf_.resize(std::max(buf_.size(), len_ + kChunk));
    size_t got = 0;
    try {
      got = in_->read(buf_.data() + len_, kChunk);
    } catch (const FormatError& e) {
      throw FormatError(detail::cat(path_, ": after line ", line_, ": ", e.what()));
    }
    len_ += got;
    eof_ = got == 0;
  }
  std::string path_;
  std::unique_ptr<Decompressor> in_;
  std::vector<char> buf_;
  size_t pos_ = 0, len_ = 0;
  int64_t line_ = 0;
  bool eof_ = false;
};

class BlockLines final : public BlockReader {
 public:
  BlockLines(const std::string& path, Compression codec) : lines_(path, codec) {}
  std::shared_ptr<const RecordBlock> next() override {
    auto block = std::make_shared<TextBlock>();
    std::string text;
    int64_t line = 0;
    while (block->texts.size() < kBlockRecords && block->held < kBlockBytes &&
           lines_.next(text, line)) {
      block->held += text.size() + sizeof(std::string);
      block->texts.push_back(std::move(text));
    }
    return block->texts.empty() ? nullptr : block;
  }

 private:
  LineReader lines_;
};

class CompressedJsonl final : public StreamedRecordFile {
 public:
  CompressedJsonl(const std::string& path, Compression codec)
      : StreamedRecordFile(path, kDefaultCacheBytes), codec_(codec) {
    set_layout(count_records(), {0});
  }
  const char* kind() const override {
    return codec_ == Compression::kGzip ? "gzip JSONL" : "zstd JSONL";
  }
  std::string origin(int64_t i) const override {
    // The last record at or before i that does not follow its predecessor's line.
    auto it = std::upper_bound(jumps_.begin(), jumps_.end(), std::make_pair(i, INT64_MAX));
    const auto& [record, line] = *(it - 1);
    return detail::cat(path(), ":", line + (i - record));
  }
  bool random_access() const override { return false; }

 protected:
  std::unique_ptr<BlockReader> open_segment(size_t) const override {
    return std::make_unique<BlockLines>(path(), codec_);
  }

 private:
  // One pass over the file: the records and where blank lines shift their line numbers.
  int64_t count_records() {
    struct stat st {};
    const double mb = ::stat(path().c_str(), &st) == 0 ? static_cast<double>(st.st_size) / 1e6 : 0;
    const auto start = std::chrono::steady_clock::now();
    auto last = start;
    LineReader lines(path(), codec_);
    std::string text;
    int64_t line = 0, records = 0;
    jumps_ = {{0, 1}};
    while (lines.next(text, line)) {
      if (line != records + 1 + (jumps_.back().second - 1 - jumps_.back().first))
        jumps_.emplace_back(records, line);
      ++records;
      if ((records & 0xfff) != 0) continue;
      const auto now = std::chrono::steady_clock::now();
      if (now - last < std::chrono::seconds(10)) continue;
      last = now;
      fmt::print(stderr,
                 "ft: counting the records of {}: {} so far, {:.0f} of {:.0f} MB ({:.0f} s)\n",
                 path(), records, static_cast<double>(lines.compressed_read()) / 1e6, mb,
                 std::chrono::duration<double>(now - start).count());
    }
    return records;
  }

  Compression codec_;
  // (record, its line) where a record's line is not the previous record's + 1; first (0, 1).
  std::vector<std::pair<int64_t, int64_t>> jumps_;
};

}  // namespace

std::unique_ptr<RecordFile> open_compressed_jsonl(const std::string& path, Compression codec) {
  return std::make_unique<CompressedJsonl>(path, codec);
}

}  // namespace ft::data
