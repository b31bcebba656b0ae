// The records of a dataset file, whatever its format: JSONL (plain, gzip or zstd), Parquet, an
// Arrow IPC file or a `datasets.save_to_disk` folder. Each record is given as the JSON text a
// JSONL line would hold (a Parquet or Arrow row becomes the object of its columns), so the record
// formats (records.h) read every file alike. Files are read in pieces, never loaded whole.
// Implementations are thread-safe: read() and origin() may be called from several threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace ft::data {

class RecordFile {
 public:
  virtual ~RecordFile() = default;
  RecordFile(const RecordFile&) = delete;
  RecordFile& operator=(const RecordFile&) = delete;

  const std::string& path() const { return path_; }
  // What the file is, for messages: "JSONL", "JSON array", "gzip JSONL", "Parquet", "Arrow".
  virtual const char* kind() const = 0;
  virtual int64_t size() const = 0;
  // Record i (0 <= i < size()) as one JSON text. FormatError naming origin(i) when the file
  // cannot give it (a read error, corrupt compressed data, a value JSON cannot hold).
  virtual std::string read(int64_t i) const = 0;
  // Where record i is, for error messages: "train.jsonl:17" (1-based line), "train.json:42
  // (element 17)", "train.parquet: row 17" (0-based, as datasets indexes rows). Cheap: reads
  // nothing.
  virtual std::string origin(int64_t i) const = 0;
  // False when reading records out of file order costs re-reading much of the file (compressed
  // JSONL has no random access; a Parquet file larger than its row-group cache decodes a row group
  // per miss): training then reads it through the tokenized cache (token_cache.h). Reading in
  // file order (ft data show, ft data prepare, ft eval) is cheap for every file.
  virtual bool random_access() const = 0;

 protected:
  explicit RecordFile(std::string path) : path_(std::move(path)) {}

 private:
  std::string path_;
};

// Opens `path` by its name and first bytes: *.jsonl / *.json (or any other text: one JSON array
// of records when it begins with '[', else JSON Lines), *.gz, *.zst,
// *.parquet, *.arrow (IPC file or stream), or a folder `datasets.save_to_disk` wrote. A file ft
// cannot read (.csv, a DatasetDict folder, ...) is a FormatError naming what is accepted.
std::unique_ptr<RecordFile> open_record_file(const std::string& path);

// The bytes and newest modification time of the data at `path` (a file, or a folder's files),
// what a tokenized cache of it is valid for.
struct DataIdentity {
  uint64_t bytes = 0;
  int64_t mtime_ns = 0;
};
DataIdentity data_identity(const std::string& path);

}  // namespace ft::data
