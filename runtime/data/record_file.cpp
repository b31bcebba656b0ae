#include "data/record_file.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "data/arrow_records.h"
#include "data/compressed_jsonl.h"
#include "data/json_array.h"
#include "data/jsonl.h"

namespace ft::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kAccepted =
    "ft reads JSONL (.jsonl, also compressed: .jsonl.gz, .jsonl.zst), a JSON array of records "
    "(.json, as LLaMA-Factory's datasets), Parquet (.parquet), Arrow IPC (.arrow), folders of "
    "such files (shards, read in name order) and folders written by datasets' save_to_disk";

// Plain JSONL: the line index, read with pread.
class JsonlRecords final : public RecordFile {
 public:
  explicit JsonlRecords(const std::string& path) : RecordFile(path), index_(path) {}
  const char* kind() const override { return "JSONL"; }
  int64_t size() const override { return index_.size(); }
  std::string read(int64_t i) const override { return index_.read(i).text; }
  std::string origin(int64_t i) const override {
    return detail::cat(path(), ":", index_.line_of(i));
  }
  bool random_access() const override { return true; }

 private:
  JsonlIndex index_;
};

// A JSON array of records (LLaMA-Factory's and Alpaca's .json files): the element index.
class JsonArrayRecords final : public RecordFile {
 public:
  explicit JsonArrayRecords(const std::string& path) : RecordFile(path), index_(path) {}
  const char* kind() const override { return "JSON array"; }
  int64_t size() const override { return index_.size(); }
  std::string read(int64_t i) const override { return index_.read(i); }
  std::string origin(int64_t i) const override { return index_.origin(i); }
  bool random_access() const override { return true; }

 private:
  JsonArrayIndex index_;
};

// The files of a folder, one after the other: a dataset in shards (the Hugging Face hub's
// train-00000-of-00004.parquet, ...), read in name order. A record's origin is its shard's.
class ShardedRecords final : public RecordFile {
 public:
  ShardedRecords(const std::string& path, std::vector<std::unique_ptr<RecordFile>> shards)
      : RecordFile(path), shards_(std::move(shards)) {
    starts_.push_back(0);
    for (const auto& s : shards_) starts_.push_back(starts_.back() + s->size());
  }
  const char* kind() const override { return shards_.front()->kind(); }
  int64_t size() const override { return starts_.back(); }
  std::string read(int64_t i) const override {
    const size_t k = shard_of(i);
    return shards_[k]->read(i - starts_[k]);
  }
  std::string origin(int64_t i) const override {
    const size_t k = shard_of(i);
    return shards_[k]->origin(i - starts_[k]);
  }
  bool random_access() const override {
    return std::all_of(shards_.begin(), shards_.end(),
                       [](const auto& s) { return s->random_access(); });
  }

 private:
  size_t shard_of(int64_t i) const {
    return static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) -
                               starts_.begin() - 1);
  }
  std::vector<std::unique_ptr<RecordFile>> shards_;
  std::vector<int64_t> starts_;  // shard k holds records [starts_[k], starts_[k + 1])
};

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// A folder: what datasets' save_to_disk wrote, or data files in shards.
std::unique_ptr<RecordFile> open_folder(const std::string& path) {
  const fs::path dir(path);
  if (fs::exists(dir / "state.json") || fs::exists(dir / "dataset_dict.json"))
    return open_arrow(path);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = lower(e.path().filename().string());
    const bool data = ends_with(name, ".parquet") || ends_with(name, ".arrow") ||
                      ends_with(name, ".jsonl") || ends_with(name, ".jsonl.gz") ||
                      ends_with(name, ".jsonl.zst");
    if (e.is_regular_file() && data) files.push_back(e.path().string());
  }
  FT_CHECK_T(FormatError, !files.empty(), path,
             " is a folder with neither state.json (datasets' save_to_disk) nor data files "
             "(*.parquet, *.arrow, *.jsonl, *.jsonl.gz, *.jsonl.zst) in it; ",
             kAccepted);
  std::sort(files.begin(), files.end());
  std::vector<std::unique_ptr<RecordFile>> shards;
  for (const std::string& f : files) shards.push_back(open_record_file(f));
  return std::make_unique<ShardedRecords>(path, std::move(shards));
}

}  // namespace

std::unique_ptr<RecordFile> open_record_file(const std::string& path) {
  std::error_code ec;
  FT_CHECK_T(FormatError, fs::exists(path, ec), path, ": no such file or folder");
  if (fs::is_directory(path, ec)) return open_folder(path);
  unsigned char head[8] = {};
  {
    std::ifstream in(path, std::ios::binary);
    FT_CHECK_T(FormatError, in.good(), path, ": cannot open the data file: ", std::strerror(errno));
    in.read(reinterpret_cast<char*>(head), sizeof head);
  }
  // The bytes decide; the name only where they say nothing (text).
  if (head[0] == 0x1f && head[1] == 0x8b) return open_compressed_jsonl(path, Compression::kGzip);
  if (head[0] == 0x28 && head[1] == 0xb5 && head[2] == 0x2f && head[3] == 0xfd)
    return open_compressed_jsonl(path, Compression::kZstd);
  if (std::memcmp(head, "PAR1", 4) == 0) return open_parquet(path);
  if (std::memcmp(head, "ARROW1", 6) == 0 || std::memcmp(head, "\xff\xff\xff\xff", 4) == 0)
    return open_arrow(path);
  const std::string name = lower(path);
  for (const char* ext : {".parquet", ".arrow", ".gz", ".zst"}) {
    FT_CHECK_T(FormatError, !ends_with(name, ext), path, ": named ", ext,
               " but its first bytes are not that format's (a damaged or mislabelled file)");
  }
  for (const char* ext : {".csv", ".tsv", ".xlsx", ".bz2", ".xz", ".lz4", ".zip", ".tar", ".orc",
                          ".avro", ".pkl", ".npy", ".txt"}) {
    FT_CHECK_T(FormatError, !ends_with(name, ext), path, ": a ", ext + 1,
               " file is not a format ft reads; ", kAccepted,
               ". Convert it, e.g. with datasets: load_dataset(...).to_json('train.jsonl')");
  }
  // A text file: one JSON array of records, or JSON Lines, by its first character.
  if (starts_json_array(path)) return std::make_unique<JsonArrayRecords>(path);
  return std::make_unique<JsonlRecords>(path);
}

DataIdentity data_identity(const std::string& path) {
  DataIdentity id;
  auto add = [&](const std::string& p) {
    struct stat st {};
    FT_CHECK(::stat(p.c_str(), &st) == 0, "cannot stat ", p, ": ", std::strerror(errno));
    id.bytes += static_cast<uint64_t>(st.st_size);
    id.mtime_ns = std::max(
        id.mtime_ns, static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec);
  };
  add(path);
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec))
      if (e.is_regular_file()) add(e.path().string());
  }
  return id;
}

}  // namespace ft::data
