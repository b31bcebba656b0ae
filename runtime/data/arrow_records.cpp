#include "data/arrow_records.h"

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/ipc/reader.h>
#include <arrow/util/byte_size.h>
#include <fmt/format.h>
#include <parquet/arrow/reader.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "data/streamed_records.h"

namespace ft::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Rows per record batch read from Parquet: a few MB of text, decoded at once (smaller batches keep
// less in flight; the decode is read ahead, so its size hardly matters for speed).
constexpr int64_t kParquetBatchRows = 1024;

// A value with no JSON form (binary, dates, decimals, ...).
struct Unsupported {
  std::string type;
};

void check(const arrow::Status& st, const std::string& path) {
  FT_CHECK_T(FormatError, st.ok(), path, ": ", st.ToString());
}
template <class T>
T check(arrow::Result<T> r, const std::string& path) {
  check(r.status(), path);
  return std::move(r).ValueUnsafe();
}

// JSON text written straight from Arrow's arrays (no JSON tree in between: this runs once per row
// read, beside the tokenizer).
class JsonWriter {
 public:
  explicit JsonWriter(std::string& out) : out_(out) {}

  void value(const arrow::Array& a, int64_t i) {
    if (a.IsNull(i)) {
      out_ += "null";
      return;
    }
    using T = arrow::Type;
    switch (a.type_id()) {
      case T::NA:
        out_ += "null";
        return;
      case T::BOOL:
        out_ += as<arrow::BooleanArray>(a).Value(i) ? "true" : "false";
        return;
      case T::INT8:
        return number(as<arrow::Int8Array>(a).Value(i));
      case T::INT16:
        return number(as<arrow::Int16Array>(a).Value(i));
      case T::INT32:
        return number(as<arrow::Int32Array>(a).Value(i));
      case T::INT64:
        return number(as<arrow::Int64Array>(a).Value(i));
      case T::UINT8:
        return number(as<arrow::UInt8Array>(a).Value(i));
      case T::UINT16:
        return number(as<arrow::UInt16Array>(a).Value(i));
      case T::UINT32:
        return number(as<arrow::UInt32Array>(a).Value(i));
      case T::UINT64:
        return number(as<arrow::UInt64Array>(a).Value(i));
      case T::FLOAT:
        return real(as<arrow::FloatArray>(a).Value(i));
      case T::DOUBLE:
        return real(as<arrow::DoubleArray>(a).Value(i));
      case T::STRING:
        return string(as<arrow::StringArray>(a).GetView(i));
      case T::LARGE_STRING:
        return string(as<arrow::LargeStringArray>(a).GetView(i));
      case T::STRING_VIEW:
        return string(as<arrow::StringViewArray>(a).GetView(i));
      case T::LIST:
        return list(as<arrow::ListArray>(a), i);
      case T::LARGE_LIST:
        return list(as<arrow::LargeListArray>(a), i);
      case T::FIXED_SIZE_LIST:
        return list(as<arrow::FixedSizeListArray>(a), i);
      case T::STRUCT:
        return object(as<arrow::StructArray>(a), i);
      case T::MAP:
        return map(as<arrow::MapArray>(a), i);
      case T::DICTIONARY: {
        // Not DictionaryArray::dictionary(): it boxes the dictionary lazily, unguarded, and rows
        // are read from several threads.
        const auto& d = as<arrow::DictionaryArray>(a);
        return value(*arrow::MakeArray(a.data()->dictionary), d.GetValueIndex(i));
      }
      default:
        throw Unsupported{a.type()->ToString()};
    }
  }

  // JSON's string escapes; bytes >= 0x80 pass through (the record's parser checks UTF-8).
  void string(std::string_view s) {
    out_ += '"';
    for (const char c : s) {
      switch (c) {
        case '"':
          out_ += "\\\"";
          break;
        case '\\':
          out_ += "\\\\";
          break;
        case '\n':
          out_ += "\\n";
          break;
        case '\r':
          out_ += "\\r";
          break;
        case '\t':
          out_ += "\\t";
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            out_ += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
          } else {
            out_ += c;
          }
      }
    }
    out_ += '"';
  }

 private:
  template <class A>
  static const A& as(const arrow::Array& a) {
    return static_cast<const A&>(a);
  }
  template <class N>
  void number(N n) {
    char buf[24];
    const auto r = std::to_chars(buf, buf + sizeof buf, n);
    out_.append(buf, r.ptr);
  }
  // The shortest text that reads back as the same value; JSON has no NaN or infinity: null.
  template <class F>
  void real(F x) {
    if (!std::isfinite(x)) {
      out_ += "null";
      return;
    }
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof buf, x);
    out_.append(buf, r.ptr);
    if (std::find_if(buf, r.ptr, [](char c) { return c == '.' || c == 'e'; }) == r.ptr)
      out_ += ".0";  // a float stays a float
  }
  template <class ListArray>
  void list(const ListArray& a, int64_t i) {
    out_ += '[';
    const arrow::Array& values = *a.values();
    const int64_t begin = a.value_offset(i), n = a.value_length(i);
    for (int64_t k = 0; k < n; ++k) {
      if (k) out_ += ',';
      value(values, begin + k);
    }
    out_ += ']';
  }
  void object(const arrow::StructArray& a, int64_t i) {
    const auto& type = static_cast<const arrow::StructType&>(*a.type());
    out_ += '{';
    for (int f = 0; f < type.num_fields(); ++f) {
      if (f) out_ += ',';
      string(type.field(f)->name());
      out_ += ':';
      value(*a.field(f), i);
    }
    out_ += '}';
  }
  void map(const arrow::MapArray& a, int64_t i) {
    const arrow::Array& keys = *a.keys();
    if (keys.type_id() != arrow::Type::STRING && keys.type_id() != arrow::Type::LARGE_STRING &&
        keys.type_id() != arrow::Type::STRING_VIEW)
      throw Unsupported{"a map whose keys are not strings"};
    out_ += '{';
    const int64_t begin = a.value_offset(i), n = a.value_length(i);
    for (int64_t k = begin; k < begin + n; ++k) {
      if (k > begin) out_ += ',';
      value(keys, k);
      out_ += ':';
      value(*a.items(), k);
    }
    out_ += '}';
  }

  std::string& out_;
};

// Row `row` of `batch` as one JSON object text; FormatError naming `origin` for a value with no
// JSON form.
std::string row_json(const arrow::RecordBatch& batch, int64_t row, const std::string& origin) {
  std::string out = "{";
  JsonWriter w(out);
  for (int c = 0; c < batch.num_columns(); ++c) {
    const std::string& name = batch.column_name(c);
    if (c) out += ',';
    w.string(name);
    out += ':';
    try {
      w.value(*batch.column(c), row);
    } catch (const Unsupported& u) {
      throw FormatError(detail::cat(origin, ": column '", name, "' holds ", u.type,
                                    ", which has no JSON form; ft reads strings, numbers, ",
                                    "booleans, nulls, lists, structs and maps of them"));
    }
  }
  out += '}';
  return out;
}

std::string row_origin(const std::string& path, int64_t row) {
  return detail::cat(path, ": row ", row);
}

// A decoded record batch whose rows are records first .. first + num_rows - 1 of `path`.
class BatchBlock final : public RecordBlock {
 public:
  BatchBlock(std::shared_ptr<arrow::RecordBatch> batch, std::string path, int64_t first)
      : batch_(std::move(batch)), path_(std::move(path)), first_(first) {}
  size_t size() const override { return static_cast<size_t>(batch_->num_rows()); }
  std::string text(size_t k) const override {
    const int64_t row = static_cast<int64_t>(k);
    return row_json(*batch_, row, row_origin(path_, first_ + row));
  }
  size_t bytes() const override {
    return static_cast<size_t>(arrow::util::TotalBufferSize(*batch_));
  }

 private:
  std::shared_ptr<arrow::RecordBatch> batch_;
  std::string path_;
  int64_t first_;
};

class ParquetBatches final : public BlockReader {
 public:
  ParquetBatches(std::unique_ptr<arrow::RecordBatchReader> reader, std::string path, int64_t first)
      : reader_(std::move(reader)), path_(std::move(path)), next_(first) {}
  std::shared_ptr<const RecordBlock> next() override {
    std::shared_ptr<arrow::RecordBatch> batch;
    check(reader_->ReadNext(&batch), path_);
    if (!batch) return nullptr;
    auto block = std::make_shared<BatchBlock>(batch, path_, next_);
    next_ += batch->num_rows();
    return block;
  }

 private:
  std::unique_ptr<arrow::RecordBatchReader> reader_;
  std::string path_;
  int64_t next_;
};

class ParquetRecords final : public StreamedRecordFile {
 public:
  explicit ParquetRecords(const std::string& path) : StreamedRecordFile(path, kDefaultCacheBytes) {
    // Arrow's default pool (the wheel's jemalloc unless ARROW_DEFAULT_MEMORY_POOL says
    // otherwise): it returns freed batches to the system, where glibc's arenas, one per thread
    // that reads ahead, kept them (bench/data_files.sh: 225 MB peak against 250).
    arrow::MemoryPool* pool = arrow::default_memory_pool();
    parquet::ReaderProperties props(pool);
    // Pages are read as they are decoded, not whole column chunks (a row group may be GBs).
    props.enable_buffered_stream();
    props.set_buffer_size(int64_t{1} << 20);
    parquet::ArrowReaderProperties arrow_props(/*use_threads=*/false);
    arrow_props.set_batch_size(kParquetBatchRows);
    arrow_props.set_pre_buffer(false);
    try {
      auto file = check(arrow::io::ReadableFile::Open(path, pool), path);
      reader_ = check(parquet::arrow::FileReader::Make(
                          pool, parquet::ParquetFileReader::Open(file, props), arrow_props),
                      path);
    } catch (const parquet::ParquetException& e) {
      throw FormatError(detail::cat(path, ": not a readable Parquet file: ", e.what()));
    }
    const auto meta = reader_->parquet_reader()->metadata();
    std::vector<int64_t> starts;
    int64_t rows = 0;
    for (int g = 0; g < meta->num_row_groups(); ++g) {
      starts.push_back(rows);
      rows += meta->RowGroup(g)->num_rows();
      decoded_bytes_ += meta->RowGroup(g)->total_byte_size();
    }
    if (starts.empty()) starts.push_back(0);
    set_layout(rows, std::move(starts));
  }
  const char* kind() const override { return "Parquet"; }
  std::string origin(int64_t i) const override { return row_origin(path(), i); }
  // A file whose decoded data fits the cache (with room to spare) stays in it once read.
  bool random_access() const override {
    return static_cast<size_t>(decoded_bytes_) <= cache_bytes() / 2;
  }

 protected:
  std::unique_ptr<BlockReader> open_segment(size_t segment) const override {
    const int g = static_cast<int>(segment);
    auto reader = check(reader_->GetRecordBatchReader({g}), path());
    int64_t first = 0;
    const auto meta = reader_->parquet_reader()->metadata();
    for (int k = 0; k < g; ++k) first += meta->RowGroup(k)->num_rows();
    return std::make_unique<ParquetBatches>(std::move(reader), path(), first);
  }

 private:
  std::unique_ptr<parquet::arrow::FileReader> reader_;
  int64_t decoded_bytes_ = 0;
};

// Arrow IPC data: every batch of every file, memory-mapped (batches are views of the mapping).
class ArrowRecords final : public RecordFile {
 public:
  ArrowRecords(const std::string& path, const std::vector<std::string>& files) : RecordFile(path) {
    for (const std::string& f : files) add_file(f);
  }
  const char* kind() const override { return "Arrow"; }
  int64_t size() const override { return starts_.empty() ? 0 : starts_.back(); }
  std::string read(int64_t i) const override {
    const size_t b = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) -
                                         starts_.begin() - 1);
    return row_json(*batches_[b], i - starts_[b], origin(i));
  }
  std::string origin(int64_t i) const override { return row_origin(path(), i); }
  bool random_access() const override { return true; }

 private:
  void add_file(const std::string& file) {
    auto mapped = check(arrow::io::MemoryMappedFile::Open(file, arrow::io::FileMode::READ), file);
    char magic[6] = {};
    const int64_t got = check(mapped->ReadAt(0, 6, magic), file);
    check(mapped->Seek(0), file);
    if (got == 6 && std::string(magic, 6) == "ARROW1") {
      auto reader = check(arrow::ipc::RecordBatchFileReader::Open(mapped), file);
      for (int k = 0; k < reader->num_record_batches(); ++k)
        add_batch(check(reader->ReadRecordBatch(k), file));
    } else {
      auto reader = check(arrow::ipc::RecordBatchStreamReader::Open(mapped), file);
      for (;;) {
        std::shared_ptr<arrow::RecordBatch> batch;
        check(reader->ReadNext(&batch), file);
        if (!batch) break;
        add_batch(batch);
      }
    }
    files_.push_back(mapped);
  }
  void add_batch(std::shared_ptr<arrow::RecordBatch> batch) {
    if (batch->num_rows() == 0) return;
    if (starts_.empty()) starts_.push_back(0);
    starts_.push_back(starts_.back() + batch->num_rows());
    batches_.push_back(std::move(batch));
  }

  std::vector<std::shared_ptr<arrow::io::MemoryMappedFile>> files_;
  std::vector<std::shared_ptr<arrow::RecordBatch>> batches_;
  std::vector<int64_t> starts_;  // batch k holds records [starts_[k], starts_[k + 1])
};

// The data files `datasets.save_to_disk` lists in DIR/state.json, in order.
std::vector<std::string> saved_dataset_files(const std::string& dir) {
  const fs::path d(dir);
  if (fs::exists(d / "dataset_dict.json")) {
    std::vector<std::string> splits;
    for (const auto& e : fs::directory_iterator(d))
      if (fs::exists(e.path() / "state.json")) splits.push_back((d / e.path().filename()).string());
    std::sort(splits.begin(), splits.end());
    std::string list;
    for (const std::string& s : splits) list += (list.empty() ? "" : ", ") + s;
    throw FormatError(detail::cat(dir,
                                  " holds a DatasetDict (dataset_dict.json): give one of its "
                                  "splits as --data: ",
                                  list.empty() ? "(none found)" : list));
  }
  const std::string state_path = (d / "state.json").string();
  FT_CHECK_T(FormatError, fs::exists(state_path), dir,
             " is a folder without state.json: ft reads a folder that datasets' save_to_disk "
             "wrote (state.json, dataset_info.json, data-*.arrow)");
  std::ifstream in(state_path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const json state = parse_json<FormatError>(text, state_path);
  FT_CHECK_T(FormatError, state.contains("_data_files") && state["_data_files"].is_array(),
             state_path, ": no _data_files list");
  std::vector<std::string> files;
  for (const json& f : state["_data_files"]) {
    FT_CHECK_T(FormatError, f.is_object() && f.contains("filename") && f["filename"].is_string(),
               state_path, ": an entry of _data_files has no filename");
    const std::string name = f["filename"].get<std::string>();
    FT_CHECK_T(FormatError, name.find('/') == std::string::npos && name != "..", state_path,
               ": _data_files names '", name, "', not a file of the folder");
    files.push_back((d / name).string());
    FT_CHECK_T(FormatError, fs::exists(files.back()), state_path, " lists ", name,
               ", which the folder lacks");
  }
  return files;
}

}  // namespace

std::unique_ptr<RecordFile> open_parquet(const std::string& path) {
  return std::make_unique<ParquetRecords>(path);
}

std::unique_ptr<RecordFile> open_arrow(const std::string& path) {
  const std::vector<std::string> files =
      fs::is_directory(path) ? saved_dataset_files(path) : std::vector<std::string>{path};
  return std::make_unique<ArrowRecords>(path, files);
}

}  // namespace ft::data
