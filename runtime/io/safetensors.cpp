#include "io/safetensors.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.h"

namespace ft::io {

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kHeaderLengthBytes = 8;  // the u64 that precedes the JSON header

struct DtypeSpec {
  const char* name;
  at::ScalarType type;
  uint64_t itemsize;
};

// Every dtype the reference knows whose elements are whole bytes, listed in the order its writer
// stores them (its Dtype enum, reversed): writing in this order reproduces its files byte for byte
// and keeps each tensor aligned to its element size, since wider elements come first.
constexpr DtypeSpec kDtypes[] = {
    {"U64", c10::ScalarType::UInt64, 8},
    {"I64", c10::ScalarType::Long, 8},
    {"F64", c10::ScalarType::Double, 8},
    {"C64", c10::ScalarType::ComplexFloat, 8},
    {"F32", c10::ScalarType::Float, 4},
    {"U32", c10::ScalarType::UInt32, 4},
    {"I32", c10::ScalarType::Int, 4},
    {"BF16", c10::ScalarType::BFloat16, 2},
    {"F16", c10::ScalarType::Half, 2},
    {"U16", c10::ScalarType::UInt16, 2},
    {"I16", c10::ScalarType::Short, 2},
    {"F8_E8M0", c10::ScalarType::Float8_e8m0fnu, 1},
    {"F8_E4M3", c10::ScalarType::Float8_e4m3fn, 1},
    {"F8_E5M2", c10::ScalarType::Float8_e5m2, 1},
    {"I8", c10::ScalarType::Char, 1},
    {"U8", c10::ScalarType::Byte, 1},
    {"BOOL", c10::ScalarType::Bool, 1},
};

const DtypeSpec* spec_by_name(const std::string& name) {
  for (const auto& s : kDtypes)
    if (name == s.name) return &s;
  return nullptr;
}

const DtypeSpec* spec_by_type(at::ScalarType type) {
  for (const auto& s : kDtypes)
    if (type == s.type) return &s;
  return nullptr;
}

size_t write_rank(const DtypeSpec* spec) { return static_cast<size_t>(spec - kDtypes); }

std::string shape_str(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string where_file(const std::string& path) { return "safetensors file '" + path + "': "; }

std::string where_tensor(const std::string& path, const std::string& name) {
  return where_file(path) + "tensor '" + name + "': ";
}

// Builds the TensorInfos straight from the JSON parser's events rather than from a DOM, so a
// malformed header is refused at its first bad token and memory stays proportional to the valid
// entries: a DOM of a 100 MB header of `[0,0,0,...]` would take gigabytes. The lexer guarantees
// well-formed JSON and valid UTF-8; this class checks the shape of the document.
class HeaderParser : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HeaderParser(std::string path) : path_(std::move(path)) {}

  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;

  bool null() override {
    if (state_ == State::kMeta) {  // the reference reads `"__metadata__": null` as no metadata
      state_ = State::kTopKey;
      return true;
    }
    return scalar("null");
  }
  bool boolean(bool) override { return scalar("a boolean"); }
  bool number_integer(number_integer_t v) override {
    // The lexer reports non-negative integers through number_unsigned, so v < 0 here.
    if (state_ == State::kShapeItem) fail_entry("shape has a negative dimension ", v);
    if (state_ == State::kOffsetsItem) fail_entry("data_offsets has a negative value ", v);
    return scalar("a negative number");
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (state_ == State::kShapeItem) {
      if (entry_.shape.size() == kMaxDims) fail_entry("shape has more than ", kMaxDims, " dims");
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail_entry("shape dimension ", v, " is too large");
      entry_.shape.push_back(static_cast<int64_t>(v));
      return true;
    }
    if (state_ == State::kOffsetsItem) {
      if (n_offsets_ == 2) fail_entry("data_offsets must hold exactly two values [begin, end]");
      offsets_[n_offsets_++] = v;
      return true;
    }
    return scalar("a number");
  }
  bool number_float(number_float_t, const string_t& text) override {
    if (state_ == State::kShapeItem || state_ == State::kOffsetsItem)
      fail_entry(state_ == State::kShapeItem ? "shape" : "data_offsets",
                 " must hold non-negative integers, got ", text);
    return scalar("a number");
  }
  bool string(string_t& v) override {
    if (state_ == State::kDtype) {
      spec_ = spec_by_name(v);
      if (!spec_)
        fail_entry(
            "unknown dtype '", v,
            "' (ft reads BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64, C64 "
            "and F8_E4M3 / F8_E5M2 / F8_E8M0)");
      entry_.dtype_name = v;
      entry_.dtype = spec_->type;
      state_ = State::kEntryKey;
      return true;
    }
    if (state_ == State::kMetaValue) {
      metadata[meta_key_] = v;
      state_ = State::kMetaKey;
      return true;
    }
    return scalar("a string");
  }
  bool binary(binary_t&) override { return scalar("binary data"); }

  bool start_object(std::size_t) override {
    switch (state_) {
      case State::kTop:
        state_ = State::kTopKey;
        return true;
      case State::kEntry:
        state_ = State::kEntryKey;
        return true;
      case State::kMeta:
        state_ = State::kMetaKey;
        return true;
      default:
        return start_nested("an object");
    }
  }
  bool key(string_t& k) override {
    switch (state_) {
      case State::kTopKey:
        if (k == "__metadata__") {
          if (seen_metadata_) fail_file("__metadata__ appears twice in the header");
          seen_metadata_ = true;
          state_ = State::kMeta;
        } else {
          if (!names_.insert(k).second) fail_file("tensor '", k, "' appears twice in the header");
          entry_ = TensorInfo{};
          entry_.name = k;
          spec_ = nullptr;
          n_offsets_ = 0;
          has_shape_ = has_offsets_ = false;
          state_ = State::kEntry;
        }
        return true;
      case State::kEntryKey:
        if (k == "dtype") {
          if (spec_) fail_entry("field 'dtype' appears twice");
          state_ = State::kDtype;
        } else if (k == "shape") {
          if (has_shape_) fail_entry("field 'shape' appears twice");
          has_shape_ = true;
          state_ = State::kShape;
        } else if (k == "data_offsets") {
          if (has_offsets_) fail_entry("field 'data_offsets' appears twice");
          has_offsets_ = true;
          state_ = State::kOffsets;
        } else {
          state_ = State::kSkipValue;  // unknown fields are ignored, as the reference does
        }
        return true;
      case State::kMetaKey:
        meta_key_ = k;
        state_ = State::kMetaValue;
        return true;
      default:  // kSkipping: a key inside an ignored value
        return true;
    }
  }
  bool end_object() override {
    switch (state_) {
      case State::kTopKey:
        state_ = State::kDone;
        return true;
      case State::kEntryKey:
        finish_entry();
        state_ = State::kTopKey;
        return true;
      case State::kMetaKey:
        state_ = State::kTopKey;
        return true;
      default:
        return end_nested();
    }
  }
  bool start_array(std::size_t) override {
    switch (state_) {
      case State::kShape:
        state_ = State::kShapeItem;
        return true;
      case State::kOffsets:
        state_ = State::kOffsetsItem;
        return true;
      default:
        return start_nested("an array");
    }
  }
  bool end_array() override {
    switch (state_) {
      case State::kShapeItem:
        state_ = State::kEntryKey;
        return true;
      case State::kOffsetsItem:
        if (n_offsets_ != 2) fail_entry("data_offsets must hold exactly two values [begin, end]");
        state_ = State::kEntryKey;
        return true;
      default:
        return end_nested();
    }
  }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    fail_file("header is not valid JSON: ", ex.what());
  }

  bool done() const { return state_ == State::kDone; }

 private:
  // Where the parser stands: what the next event may be.
  enum class State : unsigned {
    kTop,          // the header object itself
    kTopKey,       // a tensor name, "__metadata__", or the header's end
    kEntry,        // a tensor's entry object
    kEntryKey,     // a field of the entry, or its end
    kDtype,        // the dtype string
    kShape,        // the shape array
    kShapeItem,    // a dimension, or the shape's end
    kOffsets,      // the data_offsets array
    kOffsetsItem,  // an offset, or the array's end
    kMeta,         // the __metadata__ object
    kMetaKey,      // a metadata key, or its end
    kMetaValue,    // a metadata string
    kSkipValue,    // the value of an unknown entry field
    kSkipping,     // inside that value, skip_depth_ levels deep
    kDone,
  };

  template <typename... Args>
  [[noreturn]] void fail_file(Args&&... args) const {
    throw FormatError(detail::cat(where_file(path_), std::forward<Args>(args)...));
  }
  template <typename... Args>
  [[noreturn]] void fail_entry(Args&&... args) const {
    throw FormatError(detail::cat(where_tensor(path_, entry_.name), std::forward<Args>(args)...));
  }

  // A value of the wrong kind where the state expects something else.
  [[noreturn]] void unexpected(const char* got) const {
    switch (state_) {
      case State::kTop:
        fail_file("header must be a JSON object, got ", got);
      case State::kEntry:
        fail_entry("entry must be an object with dtype, shape and data_offsets, got ", got);
      case State::kDtype:
        fail_entry("dtype must be a string, got ", got);
      case State::kShape:
      case State::kShapeItem:
        fail_entry("shape must be an array of non-negative integers, got ", got);
      case State::kOffsets:
      case State::kOffsetsItem:
        fail_entry("data_offsets must be [begin, end] of non-negative integers, got ", got);
      case State::kMeta:
        fail_file("__metadata__ must be an object of strings, got ", got);
      case State::kMetaValue:
        fail_file("__metadata__ value of '", meta_key_, "' must be a string, got ", got);
      default:
        fail_file("unexpected ", got, " in the header");
    }
  }
  bool scalar(const char* got) {
    if (state_ == State::kSkipValue) {
      state_ = State::kEntryKey;
      return true;
    }
    if (state_ == State::kSkipping) return true;
    unexpected(got);
  }
  bool start_nested(const char* got) {
    if (state_ == State::kSkipValue) {
      state_ = State::kSkipping;
      skip_depth_ = 1;
      return true;
    }
    if (state_ == State::kSkipping) {
      ++skip_depth_;
      return true;
    }
    unexpected(got);
  }
  bool end_nested() {
    // The lexer pairs brackets, so only an ignored value can end here.
    FT_ASSERT(state_ == State::kSkipping, "header parser ended a container in state ",
              static_cast<unsigned>(state_));
    if (--skip_depth_ == 0) state_ = State::kEntryKey;
    return true;
  }

  void finish_entry() {
    const char* missing = !spec_          ? "dtype"
                          : !has_shape_   ? "shape"
                          : !has_offsets_ ? "data_offsets"
                                          : nullptr;
    if (missing) fail_entry("entry lacks '", missing, "'");
    entry_.begin = offsets_[0];
    entry_.end = offsets_[1];
    if (entry_.begin > entry_.end)
      fail_entry("data_offsets [", entry_.begin, ", ", entry_.end, "] has begin > end");
    // Left to right with overflow checks, as the reference folds it.
    uint64_t numel = 1;
    const uint64_t limit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    for (int64_t d : entry_.shape) {
      auto dim = static_cast<uint64_t>(d);
      if (dim != 0 && numel > limit / dim)
        fail_entry("shape ", shape_str(entry_.shape), " has more elements than fit in 64 bits");
      numel *= dim;
    }
    if (numel > limit / spec_->itemsize)
      fail_entry("shape ", shape_str(entry_.shape), " of ", entry_.dtype_name,
                 " is larger than 2^63 bytes");
    uint64_t nbytes = numel * spec_->itemsize;
    if (entry_.end - entry_.begin != nbytes)
      fail_entry("data_offsets [", entry_.begin, ", ", entry_.end, "] span ",
                 entry_.end - entry_.begin, " bytes but shape ", shape_str(entry_.shape), " of ",
                 entry_.dtype_name, " needs ", nbytes);
    tensors.push_back(std::move(entry_));
  }

  std::string path_;
  State state_ = State::kTop;
  TensorInfo entry_;                 // the entry being parsed
  const DtypeSpec* spec_ = nullptr;  // its dtype, once seen
  uint64_t offsets_[2] = {0, 0};
  int n_offsets_ = 0;
  bool has_shape_ = false;
  bool has_offsets_ = false;  // with exactly two values: end_array checks the count
  std::string meta_key_;
  int64_t skip_depth_ = 0;
  bool seen_metadata_ = false;
  std::set<std::string> names_;
};

// Writes a file under `path + ".tmp"` and renames it over `path` once complete and on disk; the
// temporary is removed if anything fails before commit().
class AtomicWriter {
 public:
  explicit AtomicWriter(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ == -1) throw_errno("open '" + tmp_ + "' for writing", __FILE__, __LINE__);
  }
  AtomicWriter(const AtomicWriter&) = delete;
  AtomicWriter& operator=(const AtomicWriter&) = delete;
  ~AtomicWriter() {
    if (fd_ != -1) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }

  void write(const void* data, uint64_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (size > 0) {
      // Linux moves at most ~2 GiB per write(); loop over short writes too.
      size_t chunk = static_cast<size_t>(std::min<uint64_t>(size, 1ull << 30));
      ssize_t n = ::write(fd_, p, chunk);
      if (n == -1) {
        if (errno == EINTR) continue;
        throw_errno("write '" + tmp_ + "'", __FILE__, __LINE__);
      }
      p += n;
      size -= static_cast<uint64_t>(n);
    }
  }

  void commit() {
    if (::fsync(fd_) == -1) throw_errno("fsync '" + tmp_ + "'", __FILE__, __LINE__);
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) == -1) throw_errno("close '" + tmp_ + "'", __FILE__, __LINE__);
    if (::rename(tmp_.c_str(), path_.c_str()) == -1)
      throw_errno("rename '" + tmp_ + "' to '" + path_ + "'", __FILE__, __LINE__);
    committed_ = true;
    sync_parent_dir(path_);
  }

  // Makes a rename or unlink in the directory durable.
  static void sync_parent_dir(const std::string& path) {
    std::string dir = fs::path(path).parent_path().string();
    if (dir.empty()) dir = ".";
    int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd == -1) throw_errno("open directory '" + dir + "'", __FILE__, __LINE__);
    int rc = ::fsync(fd);
    int err = errno;
    ::close(fd);
    errno = err;
    if (rc == -1) throw_errno("fsync directory '" + dir + "'", __FILE__, __LINE__);
  }

 private:
  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Reads a small text file whole (an index), refusing one larger than `cap` bytes.
std::string read_text(const std::string& path, uint64_t cap) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_errno("open '" + path + "'", __FILE__, __LINE__);
  std::error_code ec;
  uint64_t size = fs::file_size(path, ec);
  FT_CHECK_T(FormatError, !ec && size <= cap, "'", path, "' is ", size, " bytes, larger than the ",
             cap, "-byte limit for an index");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Mapping

// A whole file mapped PROT_READ / MAP_PRIVATE; unmapped when the last tensor viewing it is gone.
class MappedFile {
 public:
  static std::shared_ptr<const MappedFile> open(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd == -1) throw_errno("open '" + path + "'", __FILE__, __LINE__);
    struct stat st {};
    if (::fstat(fd, &st) == -1) {
      int err = errno;
      ::close(fd);
      errno = err;
      throw_errno("fstat '" + path + "'", __FILE__, __LINE__);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw FormatError(where_file(path) + "not a regular file");
    }
    std::shared_ptr<MappedFile> m(new MappedFile());
    m->size_ = static_cast<uint64_t>(st.st_size);
    if (m->size_ > 0) {  // mmap refuses length 0; the header check reports an empty file
      void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        int err = errno;
        ::close(fd);
        errno = err;
        throw_errno("mmap '" + path + "'", __FILE__, __LINE__);
      }
      m->data_ = static_cast<const uint8_t*>(p);
    }
    m->fd_ = fd;  // kept for pread_exact
    m->path_ = path;
    return m;
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    if (fd_ != -1) ::close(fd_);
  }

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // Reads [offset, offset + len) of the file with pread, past the mapping: the bytes go through
  // the page cache, never into this process's resident set. SystemError naming the file.
  void pread_exact(uint64_t offset, uint64_t len, void* dst) const {
    auto* out = static_cast<uint8_t*>(dst);
    while (len > 0) {
      const ssize_t n = ::pread(fd_, out, std::min<uint64_t>(len, 1u << 30),
                                static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw_errno("read '" + path_ + "'", __FILE__, __LINE__);
      if (n == 0) throw FormatError(where_file(path_) + "ends early (truncated while open?)");
      out += n;
      offset += static_cast<uint64_t>(n);
      len -= static_cast<uint64_t>(n);
    }
  }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  int fd_ = -1;
  std::string path_;
};

// ---------------------------------------------------------------------------------------------
// Reading

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // cannot overflow: checked when the header was parsed
  return n;
}

std::string safetensors_dtype_name(at::ScalarType dtype) {
  const DtypeSpec* spec = spec_by_type(dtype);
  if (!spec)
    throw Error(detail::cat("dtype ", c10::toString(dtype), " cannot be stored in safetensors"));
  return spec->name;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  f.map_ = MappedFile::open(path);
  const uint64_t size = f.map_->size();
  const std::string where = where_file(path);

  FT_CHECK_T(FormatError, size >= kHeaderLengthBytes, where, "file is ", size,
             " bytes, too short to hold the 8-byte header length (truncated, or not safetensors)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | f.map_->data()[i];  // little-endian on any host
  FT_CHECK_T(FormatError, n <= kMaxHeaderBytes, where, "header length ", n, " exceeds the ",
             kMaxHeaderBytes,
             "-byte limit of the safetensors format (corrupt, or not safetensors)");
  FT_CHECK_T(FormatError, n <= size - kHeaderLengthBytes, where, "header length ", n,
             " runs past the end of the ", size, "-byte file (truncated, or not safetensors)");

  HeaderParser parser(path);
  const auto* json_begin = reinterpret_cast<const char*>(f.map_->data() + kHeaderLengthBytes);
  nlohmann::json::sax_parse(json_begin, json_begin + n, &parser);
  FT_ASSERT(parser.done(), "header parser stopped early on '", path, "'");
  f.data_start_ = kHeaderLengthBytes + n;
  f.metadata_ = std::move(parser.metadata);
  f.tensors_ = std::move(parser.tensors);

  // The reference requires the tensors to tile the data buffer exactly: no gap, no overlap, no
  // trailing bytes. Checking the same catches truncation and overlapping entries alike.
  const uint64_t buffer = size - f.data_start_;
  for (const TensorInfo& t : f.tensors_)
    FT_CHECK_T(FormatError, t.end <= buffer, where_tensor(path, t.name), "data_offsets [", t.begin,
               ", ", t.end, "] run past the end of the ", buffer,
               "-byte data buffer (the file is truncated or corrupt)");
  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (size_t i = 0; i < f.tensors_.size(); ++i) {
    const TensorInfo& t = f.tensors_[i];
    FT_CHECK_T(FormatError, t.begin >= covered, where_tensor(path, t.name), "data_offsets [",
               t.begin, ", ", t.end, "] overlap tensor '", f.tensors_[i - 1].name, "'");
    FT_CHECK_T(FormatError, t.begin == covered, where_tensor(path, t.name), "data_offsets [",
               t.begin, ", ", t.end, "] leave a gap of ", t.begin - covered,
               " bytes after the previous tensor (safetensors tensors cover the buffer densely)");
    covered = t.end;
    f.by_name_.emplace(t.name, i);
  }
  FT_CHECK_T(FormatError, covered == buffer, where, "data buffer holds ", buffer - covered,
             " bytes after the last tensor (corrupt, or two files joined)");
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

const TensorInfo& SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  FT_CHECK_T(FormatError, it != by_name_.end(), where_tensor(path_, name),
             "no such tensor in the file (it holds ", tensors_.size(), ")");
  return tensors_[it->second];
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const { return find(name); }

at::Tensor SafetensorsFile::view_bytes(const TensorInfo& info, uint64_t begin,
                                       at::IntArrayRef shape) const {
  const uint8_t* p = map_->data() + data_start_ + begin;
  auto options = at::TensorOptions().dtype(info.dtype).device(at::kCPU);
  if (reinterpret_cast<uintptr_t>(p) % c10::elementSize(info.dtype) != 0) {
    at::Tensor out = at::empty(shape, options);
    if (out.nbytes() > 0) std::memcpy(out.data_ptr(), p, out.nbytes());  // empty: data_ptr null
    return out;
  }
  // The deleter owns a reference to the mapping: the bytes stay mapped while any view lives.
  std::shared_ptr<const MappedFile> keep = map_;
  return at::from_blob(
      const_cast<uint8_t*>(p), shape, [keep](void*) mutable { keep.reset(); }, options);
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo& info = find(name);
  return view_bytes(info, info.begin, info.shape);
}

at::Tensor SafetensorsFile::tensor_slice(const std::string& name, int64_t row_begin,
                                         int64_t row_end) const {
  const TensorInfo& info = find(name);
  FT_CHECK_T(FormatError, !info.shape.empty(), where_tensor(path_, name),
             "is a scalar; it has no rows to slice");
  const int64_t rows = info.shape[0];
  FT_CHECK_T(FormatError, 0 <= row_begin && row_begin <= row_end && row_end <= rows,
             where_tensor(path_, name), "rows [", row_begin, ", ", row_end,
             ") are not within its dim 0 of ", rows, " (shape ", shape_str(info.shape), ")");
  const uint64_t row_bytes = rows == 0 ? 0 : info.nbytes() / static_cast<uint64_t>(rows);
  std::vector<int64_t> shape = info.shape;
  shape[0] = row_end - row_begin;
  return view_bytes(info, info.begin + static_cast<uint64_t>(row_begin) * row_bytes, shape);
}

void SafetensorsFile::copy_to(const std::string& name, const at::Tensor& dst) const {
  const TensorInfo& info = find(name);
  FT_CHECK_T(FormatError, dst.defined(), where_tensor(path_, name),
             "copy_to was given an undefined destination");
  FT_CHECK_T(FormatError, dst.sizes() == at::IntArrayRef(info.shape), where_tensor(path_, name),
             "has shape ", shape_str(info.shape), " (", info.dtype_name,
             ") but the destination has shape ", shape_str(dst.sizes()));
  c10::NoGradGuard no_grad;
  dst.copy_(tensor(name));
}

void SafetensorsFile::read_range(const std::string& name, int64_t begin, int64_t end,
                                 const at::Tensor& dst) const {
  const TensorInfo& info = find(name);
  FT_CHECK_T(FormatError, 0 <= begin && begin <= end && end <= info.numel(),
             where_tensor(path_, name), "elements [", begin, ", ", end,
             ") are not within its ", info.numel(), " elements (shape ", shape_str(info.shape), ")");
  FT_CHECK_T(FormatError, dst.defined() && dst.numel() == end - begin, where_tensor(path_, name),
             "read_range of ", end - begin, " elements was given a destination of ",
             dst.defined() ? dst.numel() : 0, " elements");
  FT_ASSERT(dst.is_contiguous(), "read_range needs a contiguous destination");
  if (end == begin) return;
  const int64_t item = static_cast<int64_t>(c10::elementSize(info.dtype));
  const uint64_t off = data_start_ + info.begin + static_cast<uint64_t>(begin * item);
  c10::NoGradGuard no_grad;
  if (dst.is_cpu() && dst.is_contiguous() && dst.scalar_type() == info.dtype) {
    map_->pread_exact(off, static_cast<uint64_t>((end - begin) * item), dst.data_ptr());
    return;
  }
  // Another dtype or device: through a bounce buffer of at most kChunk bytes.
  constexpr int64_t kChunk = 8 << 20;
  const int64_t per = std::max<int64_t>(1, kChunk / item);
  at::Tensor flat = dst.view({-1});
  at::Tensor bounce = at::empty({std::min(per, end - begin)}, at::TensorOptions().dtype(info.dtype));
  for (int64_t i = 0; i < end - begin; i += per) {
    const int64_t n = std::min(per, end - begin - i);
    at::Tensor part = bounce.narrow(0, 0, n);
    map_->pread_exact(off + static_cast<uint64_t>(i * item), static_cast<uint64_t>(n * item),
                      part.data_ptr());
    flat.narrow(0, i, n).copy_(part);  // pageable host-to-device: returns once part is consumed
  }
}

// ---------------------------------------------------------------------------------------------
// Model directories

SafetensorsIndex SafetensorsIndex::open(const std::string& dir) {
  SafetensorsIndex idx;
  idx.dir_ = dir;
  std::error_code ec;
  FT_CHECK_T(FormatError, fs::is_directory(dir, ec), "model directory '", dir,
             "' does not exist or is not a directory");
  const std::string single = (fs::path(dir) / kSingleFileName).string();
  const std::string index = (fs::path(dir) / kIndexFileName).string();

  if (fs::exists(single, ec)) {
    idx.files_.push_back(SafetensorsFile::open(single));
    for (const auto& name : idx.files_[0].names()) idx.shard_of_.emplace(name, 0);
    return idx;
  }
  FT_CHECK_T(FormatError, fs::exists(index, ec), "model directory '", dir, "' has neither ",
             kSingleFileName, " nor ", kIndexFileName);

  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(read_text(index, kMaxHeaderBytes));
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(detail::cat("index '", index, "' is not valid JSON: ", e.what()));
  }
  FT_CHECK_T(FormatError, doc.is_object() && doc.contains("weight_map"), "index '", index,
             "' lacks \"weight_map\"");
  const auto& weight_map = doc["weight_map"];
  FT_CHECK_T(FormatError, weight_map.is_object(), "index '", index,
             "': \"weight_map\" must be an object of tensor name -> shard file");

  std::map<std::string, size_t> file_slot;  // shard file name -> index into files_
  for (const auto& [name, file] : weight_map.items()) {
    FT_CHECK_T(FormatError, file.is_string(), "index '", index, "': tensor '", name, "' maps to ",
               file.dump(), ", not a file name");
    const std::string shard = file.get<std::string>();
    auto it = file_slot.find(shard);
    if (it == file_slot.end()) {
      // Shards live beside the index; a path elsewhere is a corrupt or hostile index.
      FT_CHECK_T(
          FormatError,
          !shard.empty() && shard.find('/') == std::string::npos && shard != "." && shard != "..",
          "index '", index, "': tensor '", name, "' maps to '", shard,
          "', which is not a file name in the model directory");
      const std::string shard_path = (fs::path(dir) / shard).string();
      FT_CHECK_T(FormatError, fs::exists(shard_path, ec), "index '", index, "' places tensor '",
                 name, "' in '", shard_path, "', which does not exist");
      idx.files_.push_back(SafetensorsFile::open(shard_path));
      it = file_slot.emplace(shard, idx.files_.size() - 1).first;
    }
    const SafetensorsFile& f = idx.files_[it->second];
    FT_CHECK_T(FormatError, f.has(name), "index '", index, "' places tensor '", name, "' in '",
               f.path(), "', which has no such tensor");
    idx.shard_of_.emplace(name, it->second);
  }
  return idx;
}

std::vector<std::string> SafetensorsIndex::names() const {
  std::vector<std::string> out;
  out.reserve(shard_of_.size());
  for (const auto& [name, slot] : shard_of_) out.push_back(name);
  return out;
}

const SafetensorsFile& SafetensorsIndex::file_of(const std::string& name) const {
  auto it = shard_of_.find(name);
  FT_CHECK_T(FormatError, it != shard_of_.end(), "model directory '", dir_, "': no tensor '", name,
             "' in its safetensors files");
  return files_[it->second];
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

struct PlannedTensor {
  const DeferredTensor* tensor;
  const DtypeSpec* spec;
  uint64_t nbytes;
};

PlannedTensor plan_one(const DeferredTensor& t) {
  const DtypeSpec* spec = spec_by_type(t.dtype);
  FT_CHECK_T(Error, spec, "cannot write tensor '", t.name, "': dtype ", c10::toString(t.dtype),
             " has no safetensors equivalent");
  int64_t numel = 1;
  for (int64_t d : t.shape) {
    FT_CHECK_T(Error, d >= 0, "cannot write tensor '", t.name, "': negative dimension in ",
               shape_str(t.shape));
    numel *= d;
  }
  return {&t, spec, static_cast<uint64_t>(numel) * spec->itemsize};
}

// The tensors of one file checked and in the order their data is laid out (and made).
std::vector<PlannedTensor> file_order(const std::string& path,
                                      const std::vector<const DeferredTensor*>& tensors) {
  std::vector<PlannedTensor> plan;
  plan.reserve(tensors.size());
  std::set<std::string> seen;
  for (const DeferredTensor* t : tensors) {
    FT_CHECK_T(Error, t->name != "__metadata__", "cannot write a tensor named '__metadata__' to '",
               path, "': the name is reserved for the metadata map");
    FT_CHECK_T(Error, seen.insert(t->name).second, "cannot write '", path, "': tensor '", t->name,
               "' is given twice");
    plan.push_back(plan_one(*t));
  }
  std::stable_sort(plan.begin(), plan.end(), [](const PlannedTensor& a, const PlannedTensor& b) {
    size_t ra = write_rank(a.spec), rb = write_rank(b.spec);
    return ra != rb ? ra < rb : a.tensor->name < b.tensor->name;
  });
  return plan;
}

void write_one_file(const std::string& path, const std::vector<const DeferredTensor*>& tensors,
                    const std::map<std::string, std::string>& metadata) {
  const std::vector<PlannedTensor> plan = file_order(path, tensors);

  // Key order matters to reproduce the reference: __metadata__ first, then entries in data order,
  // each as dtype, shape, data_offsets.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& p : plan) {
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = p.spec->name;
    entry["shape"] = p.tensor->shape;
    entry["data_offsets"] = nlohmann::ordered_json::array({offset, offset + p.nbytes});
    header[p.tensor->name] = std::move(entry);
    offset += p.nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::cat("cannot write '", path, "': a tensor name or metadata entry is not ",
                            "valid UTF-8 (", e.what(), ")"));
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the reference pads so the data is 8-aligned
  FT_CHECK_T(Error, text.size() <= kMaxHeaderBytes, "cannot write '", path, "': its header is ",
             text.size(), " bytes, over the ", kMaxHeaderBytes, "-byte limit readers enforce");

  AtomicWriter out(path);
  uint8_t len[kHeaderLengthBytes];
  for (size_t i = 0; i < kHeaderLengthBytes; ++i)
    len[i] = static_cast<uint8_t>(text.size() >> (8 * i));
  out.write(len, sizeof len);
  out.write(text.data(), text.size());
  for (const auto& p : plan) {
    // One tensor at a time, made only now, so neither a model on the GPU nor one being converted
    // from a checkpoint ever needs a second full copy in host memory.
    const DeferredTensor& d = *p.tensor;
    at::Tensor t = d.make();
    FT_ASSERT(t.defined() && t.scalar_type() == d.dtype && t.sizes() == at::IntArrayRef(d.shape),
              "tensor '", d.name, "' was made as ", t.defined() ? t.sizes() : at::IntArrayRef{},
              " ", t.defined() ? c10::toString(t.scalar_type()) : "undefined", ", planned ",
              shape_str(d.shape), " ", c10::toString(d.dtype));
    at::Tensor c = t.detach().to(at::kCPU).resolve_conj().resolve_neg().contiguous();
    FT_ASSERT(c.nbytes() == p.nbytes, "tensor '", d.name, "' holds ", c.nbytes(),
              " bytes, planned ", p.nbytes);
    out.write(c.data_ptr(), p.nbytes);
  }
  out.commit();
}

struct ShardSplit {
  std::vector<std::vector<const DeferredTensor*>> shards;
  std::vector<uint64_t> bytes;
  uint64_t total_bytes = 0;
};

// huggingface_hub's split_torch_state_dict_into_shards: fill shards in the given order; a tensor
// over the limit gets a shard of its own at the point it appears.
ShardSplit split_shards(const std::string& dir, const DeferredTensors& tensors,
                        uint64_t max_shard_bytes) {
  ShardSplit out;
  std::vector<const DeferredTensor*> current;
  uint64_t current_bytes = 0;
  std::set<std::string> seen;
  for (const auto& t : tensors) {
    FT_CHECK_T(Error, seen.insert(t.name).second, "cannot write to '", dir, "': tensor '", t.name,
               "' is given twice");
    uint64_t nbytes = plan_one(t).nbytes;
    out.total_bytes += nbytes;
    if (nbytes > max_shard_bytes) {
      out.shards.push_back({&t});
      out.bytes.push_back(nbytes);
      continue;
    }
    if (current_bytes + nbytes > max_shard_bytes) {
      out.shards.push_back(std::move(current));
      out.bytes.push_back(current_bytes);
      current.clear();
      current_bytes = 0;
    }
    current.push_back(&t);
    current_bytes += nbytes;
  }
  if (!current.empty() || out.shards.empty()) {
    out.shards.push_back(std::move(current));
    out.bytes.push_back(current_bytes);
  }
  return out;
}

}  // namespace

std::vector<size_t> write_order(const DeferredTensors& tensors, uint64_t max_shard_bytes) {
  FT_CHECK_T(Error, max_shard_bytes > 0, "write_sharded: max_shard_bytes must be > 0");
  std::vector<size_t> order;
  for (const auto& shard : split_shards("", tensors, max_shard_bytes).shards)
    for (const auto& p : file_order("", shard))
      order.push_back(static_cast<size_t>(p.tensor - tensors.data()));
  return order;
}

DeferredTensors defer(const NamedTensors& tensors) {
  DeferredTensors out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    FT_CHECK_T(Error, t.defined(), "cannot write tensor '", name, "': it is undefined");
    FT_CHECK_T(Error, t.layout() == at::kStrided, "cannot write tensor '", name,
               "': safetensors holds dense tensors only, not sparse or other layouts");
    out.push_back({name, t.sizes().vec(), t.scalar_type(), [t] { return t; }});
  }
  return out;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const DeferredTensors deferred = defer(tensors);
  std::vector<const DeferredTensor*> all;
  for (const auto& t : deferred) all.push_back(&t);
  write_one_file(path, all, metadata);
}

std::vector<std::string> write_sharded(const std::string& dir, const NamedTensors& tensors,
                                       uint64_t max_shard_bytes,
                                       const std::map<std::string, std::string>& metadata) {
  return write_sharded_deferred(dir, defer(tensors), max_shard_bytes, metadata);
}

std::vector<std::string> write_sharded_deferred(const std::string& dir,
                                                const DeferredTensors& tensors,
                                                uint64_t max_shard_bytes,
                                                const std::map<std::string, std::string>& metadata,
                                                const ShardWritten& on_written) {
  FT_CHECK_T(Error, max_shard_bytes > 0, "write_sharded: max_shard_bytes must be > 0");
  std::error_code ec;
  fs::create_directories(dir, ec);
  FT_CHECK_T(SystemError, !ec, "cannot create directory '", dir, "': ", ec.message());

  const ShardSplit split = split_shards(dir, tensors, max_shard_bytes);
  const auto& shards = split.shards;
  const auto& shard_bytes = split.bytes;
  const uint64_t total_bytes = split.total_bytes;

  const fs::path root(dir);
  const std::regex shard_pattern(R"(model-\d{5}-of-\d{5}\.safetensors)");
  // A stale file left behind could be loaded with the new ones: failing to remove one is an error.
  auto remove_file = [](const fs::path& path) {
    std::error_code err;
    fs::remove(path, err);  // a missing file is no error
    FT_CHECK_T(SystemError, !err, "cannot remove '", path.string(), "': ", err.message());
  };
  auto remove_stale = [&](const std::set<std::string>& keep) {
    std::vector<fs::path> stale;
    std::error_code err;
    for (const auto& entry : fs::directory_iterator(root, err)) {
      std::string name = entry.path().filename().string();
      bool ours = name == kSingleFileName || name == kIndexFileName ||
                  std::regex_match(name, shard_pattern);
      if (ours && !keep.count(name)) stale.push_back(entry.path());
    }
    FT_CHECK_T(SystemError, !err, "cannot list '", dir, "': ", err.message());
    for (const auto& path : stale) remove_file(path);
    AtomicWriter::sync_parent_dir((root / kSingleFileName).string());
  };

  if (shards.size() == 1) {
    write_one_file((root / kSingleFileName).string(), shards[0], metadata);
    if (on_written) on_written(kSingleFileName, 1, 1, shard_bytes[0]);
    remove_stale({kSingleFileName});
    return {kSingleFileName};
  }

  // An old index would pair new shards with old ones while this save is under way: drop it first,
  // and the old single file (which readers prefer to an index) before the new index appears, so an
  // interrupted save leaves the old single file or a directory that fails to load, never a mix.
  remove_file(root / kIndexFileName);
  std::vector<std::string> written;
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    write_one_file((root / file).string(), shards[i], metadata);
    for (const DeferredTensor* t : shards[i]) weight_map[t->name] = file;
    written.push_back(file);
    if (on_written) on_written(file, i + 1, shards.size(), shard_bytes[i]);
  }
  remove_stale(std::set<std::string>(written.begin(), written.end()));
  nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  // transformers writes json.dumps(index, indent=2, sort_keys=True) + "\n"; std::map sorts alike.
  std::string text = index.dump(2) + "\n";
  {
    AtomicWriter out((root / kIndexFileName).string());
    out.write(text.data(), text.size());
    out.commit();
  }
  written.push_back(kIndexFileName);
  return written;
}

}  // namespace ft::io
