#include "io/safetensors_header.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "core/error.h"
#include "core/json.h"

namespace ft::io {

using msg::shape_str;
using msg::where_file;
using msg::where_tensor;

namespace {

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

}  // namespace

namespace msg {

std::string shape_str(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string where_file(const std::string& path) { return "safetensors file '" + path + "': "; }

std::string where_tensor(const std::string& path, const std::string& name) {
  return where_file(path) + "tensor '" + name + "': ";
}

}  // namespace msg

const DtypeSpec* dtype_spec(at::ScalarType type) {
  for (const auto& s : kDtypes)
    if (type == s.type) return &s;
  return nullptr;
}

size_t write_rank(const DtypeSpec& spec) { return static_cast<size_t>(&spec - kDtypes); }

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // cannot overflow: checked when the header was parsed
  return n;
}

std::string safetensors_dtype_name(at::ScalarType dtype) {
  const DtypeSpec* spec = dtype_spec(dtype);
  if (!spec)
    throw Error(detail::cat("dtype ", c10::toString(dtype), " cannot be stored in safetensors"));
  return spec->name;
}

Header parse_header(const std::string& path, const uint8_t* data, uint64_t size) {
  Header h;
  const std::string where = where_file(path);

  FT_CHECK_T(FormatError, size >= kHeaderLengthBytes, where, "file is ", size,
             " bytes, too short to hold the 8-byte header length (truncated, or not safetensors)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];  // little-endian on any host
  FT_CHECK_T(FormatError, n <= kMaxHeaderBytes, where, "header length ", n, " exceeds the ",
             kMaxHeaderBytes,
             "-byte limit of the safetensors format (corrupt, or not safetensors)");
  FT_CHECK_T(FormatError, n <= size - kHeaderLengthBytes, where, "header length ", n,
             " runs past the end of the ", size, "-byte file (truncated, or not safetensors)");

  HeaderParser parser(path);
  const auto* json_begin = reinterpret_cast<const char*>(data + kHeaderLengthBytes);
  const size_t deep = json_too_deep_at(std::string_view(json_begin, n));
  FT_CHECK_T(FormatError, deep == std::string_view::npos, where, "header JSON nested deeper than ",
             kMaxJsonDepth, " levels (at byte ", kHeaderLengthBytes + deep,
             "): corrupt, or not safetensors");
  nlohmann::json::sax_parse(json_begin, json_begin + n, &parser);
  FT_ASSERT(parser.done(), "header parser stopped early on '", path, "'");
  h.data_start = kHeaderLengthBytes + n;
  h.metadata = std::move(parser.metadata);
  h.tensors = std::move(parser.tensors);

  // The reference requires the tensors to tile the data buffer exactly: no gap, no overlap, no
  // trailing bytes. Checking the same catches truncation and overlapping entries alike.
  const uint64_t buffer = size - h.data_start;
  for (const TensorInfo& t : h.tensors)
    FT_CHECK_T(FormatError, t.end <= buffer, where_tensor(path, t.name), "data_offsets [", t.begin,
               ", ", t.end, "] run past the end of the ", buffer,
               "-byte data buffer (the file is truncated or corrupt)");
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const TensorInfo& t = h.tensors[i];
    FT_CHECK_T(FormatError, t.begin >= covered, where_tensor(path, t.name), "data_offsets [",
               t.begin, ", ", t.end, "] overlap tensor '", h.tensors[i - 1].name, "'");
    FT_CHECK_T(FormatError, t.begin == covered, where_tensor(path, t.name), "data_offsets [",
               t.begin, ", ", t.end, "] leave a gap of ", t.begin - covered,
               " bytes after the previous tensor (safetensors tensors cover the buffer densely)");
    covered = t.end;
  }
  FT_CHECK_T(FormatError, covered == buffer, where, "data buffer holds ", buffer - covered,
             " bytes after the last tensor (corrupt, or two files joined)");
  return h;
}

std::string encode_header(const std::string& path, const std::vector<TensorInfo>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  // Key order matters to reproduce the reference: __metadata__ first, then entries in data order,
  // each as dtype, shape, data_offsets.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const TensorInfo& t : tensors) {
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = t.dtype_name;
    entry["shape"] = t.shape;
    entry["data_offsets"] = nlohmann::ordered_json::array({t.begin, t.end});
    header[t.name] = std::move(entry);
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
  std::string out(kHeaderLengthBytes, '\0');
  for (size_t i = 0; i < kHeaderLengthBytes; ++i)
    out[i] = static_cast<char>(static_cast<uint8_t>(text.size() >> (8 * i)));
  return out + text;
}

}  // namespace ft::io
