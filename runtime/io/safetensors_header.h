// The safetensors header (a u64 little-endian length, then a JSON object of tensor entries and
// "__metadata__"): the dtype table, parsing a file's header and checking it against the file's
// size, and encoding one for the writer. Pure functions over bytes the caller owns; thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ft::io {

// The u64 that precedes the JSON header.
inline constexpr uint64_t kHeaderLengthBytes = 8;
// The reference implementation refuses larger headers; ft refuses them too, before reading any.
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Tensors of more dimensions than this are refused: no model has them, and a cap keeps a malformed
// header from making ft hold an arbitrarily long shape.
inline constexpr size_t kMaxDims = 64;

// One header entry, checked against the file: the byte range lies inside the data buffer and holds
// exactly numel() * itemsize bytes.
struct TensorInfo {
  std::string name;
  std::string dtype_name;  // safetensors spelling: "BF16", "F32", "I64", ...
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;  // C order; empty for a scalar
  uint64_t begin = 0;          // [begin, end): bytes relative to the start of the data buffer
  uint64_t end = 0;

  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

// The safetensors name of a LibTorch dtype ("BF16" for at::kBFloat16); throws ft::Error for a dtype
// safetensors cannot hold (complex double, quantized types ...).
std::string safetensors_dtype_name(at::ScalarType dtype);

// A dtype safetensors stores: its name, LibTorch type and element size in bytes.
struct DtypeSpec {
  const char* name;
  at::ScalarType type;
  uint64_t itemsize;
};
// The spec of `type`; nullptr when safetensors has no equivalent.
const DtypeSpec* dtype_spec(at::ScalarType type);
// Where the reference writer puts this dtype's tensors in the data buffer (lower first: wider
// elements come first, which keeps every tensor aligned to its element size).
size_t write_rank(const DtypeSpec& spec);

// A file's header, parsed and checked.
struct Header {
  uint64_t data_start = 0;          // file offset of the data buffer: 8 + header length
  std::vector<TensorInfo> tensors;  // sorted by begin; they tile the data buffer exactly
  std::map<std::string, std::string> metadata;  // "__metadata__" (empty when absent)
};

// Parses the header of the `size` bytes at `data` (a whole file) and checks every entry against
// the file: FormatError naming `path` and, where there is one, the tensor.
Header parse_header(const std::string& path, const uint8_t* data, uint64_t size);

// The bytes that precede a file's data buffer (length, JSON, space padding to a multiple of 8),
// laid out as the reference writer lays them out: `__metadata__` first, then `tensors` in the
// given (data) order, each as dtype, shape, data_offsets. ft::Error naming `path` for a name or
// metadata entry that is not valid UTF-8, or a header over kMaxHeaderBytes.
std::string encode_header(const std::string& path, const std::vector<TensorInfo>& tensors,
                          const std::map<std::string, std::string>& metadata);

namespace msg {
// Pieces of the messages about a file: "[2, 3]", "safetensors file 'p': ", "... tensor 'n': ".
std::string shape_str(at::IntArrayRef shape);
std::string where_file(const std::string& path);
std::string where_tensor(const std::string& path, const std::string& name);
}  // namespace msg

}  // namespace ft::io
