// ft's own safetensors reader and writer (the safetensors format (u64 header length, JSON header, data buffer)): memory-mapped, every size and offset
// bounds-checked, sharded checkpoints through model.safetensors.index.json. A SafetensorsFile owns
// its mapping and every tensor it hands out shares that ownership, so views outlive the file
// object. Opened files and indexes are immutable: reading them from many threads at once is safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ft::io {

// The reference implementation refuses larger headers; ft refuses them too, before reading any.
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Tensors of more dimensions than this are refused: no model has them, and a cap keeps a malformed
// header from making ft hold an arbitrarily long shape.
inline constexpr size_t kMaxDims = 64;
// Hugging Face's default shard size ("5GB" in save_pretrained).
inline constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000;
inline constexpr const char* kSingleFileName = "model.safetensors";
inline constexpr const char* kIndexFileName = "model.safetensors.index.json";

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

class MappedFile;

// One .safetensors file, mapped read-only. open() validates the whole header; the data is only
// touched (paged in) when a tensor is read. Every failure on a malformed file is an ft::FormatError
// naming the file and, where there is one, the tensor.
class SafetensorsFile {
 public:
  // Throws FormatError for a malformed file, SystemError when it cannot be opened or mapped.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  // Tensor names in storage order (ascending data_offsets), the order the reference writer chose.
  std::vector<std::string> names() const;
  size_t size() const { return tensors_.size(); }
  bool has(const std::string& name) const { return by_name_.count(name) != 0; }
  // FormatError naming the file and the tensor when the file has no such tensor.
  const TensorInfo& info(const std::string& name) const;
  // The "__metadata__" string map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // A CPU tensor viewing the mapped bytes, no copy. READ-ONLY: the pages are mapped PROT_READ, so
  // writing through it (in-place ops, copy_ into it) faults; clone() or copy_to() to own the data.
  // The only copy made is for an entry whose bytes are not aligned to its element size (a file
  // laid out by another writer), since LibTorch kernels may assume aligned elements. ft's writer
  // replaces files by rename, never in place; a file another program truncates while mapped
  // raises SIGBUS when the lost pages are read, as with any mmap reader.
  at::Tensor tensor(const std::string& name) const;
  // Rows [row_begin, row_end) of dim 0, as a view of their contiguous bytes (same rules as
  // tensor()): what a rank reads when it loads only its shard of a parameter.
  at::Tensor tensor_slice(const std::string& name, int64_t row_begin, int64_t row_end) const;
  // Copies the tensor into `dst` (any device, converting the dtype), outside autograd so a
  // parameter can be the target. FormatError naming file, tensor and both shapes when they differ.
  void copy_to(const std::string& name, const at::Tensor& dst) const;
  // Copies elements [begin, end) of the tensor flattened in C order into `dst` (numel end - begin,
  // any device, converting the dtype). Reads with pread, not through the mapping: straight into
  // `dst` when it is a contiguous CPU tensor of the file's dtype, else through an 8 MiB bounce
  // buffer. The file's pages stay in the page cache and never enter this process's resident set,
  // so a rank loading its slices holds its slices and nothing more. FormatError naming file and
  // tensor for a range outside the tensor or a destination of another size.
  void read_range(const std::string& name, int64_t begin, int64_t end, const at::Tensor& dst) const;

 private:
  SafetensorsFile() = default;
  const TensorInfo& find(const std::string& name) const;
  at::Tensor view_bytes(const TensorInfo& info, uint64_t begin, at::IntArrayRef shape) const;

  std::string path_;
  std::shared_ptr<const MappedFile> map_;  // shared with every tensor handed out
  uint64_t data_start_ = 0;                // file offset of the data buffer: 8 + header length
  std::vector<TensorInfo> tensors_;        // sorted by begin
  std::unordered_map<std::string, size_t> by_name_;  // name -> index into tensors_
  std::map<std::string, std::string> metadata_;
};

// The weights of a model directory: `model.safetensors`, or the shards that
// `model.safetensors.index.json` lists. Every shard is opened (mapped, header checked) by open(),
// so a missing shard or a tensor missing from its shard fails at once rather than mid-load.
class SafetensorsIndex {
 public:
  // Like transformers, a single `model.safetensors` takes precedence over an index when a directory
  // has both. FormatError naming the path for: neither file, a malformed index, an index naming a
  // missing shard or a shard outside the directory, a tensor absent from the shard the index names.
  static SafetensorsIndex open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  // Sorted tensor names.
  std::vector<std::string> names() const;
  size_t size() const { return shard_of_.size(); }
  bool has(const std::string& name) const { return shard_of_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const { return file_of(name).info(name); }
  at::Tensor tensor(const std::string& name) const { return file_of(name).tensor(name); }
  at::Tensor tensor_slice(const std::string& name, int64_t row_begin, int64_t row_end) const {
    return file_of(name).tensor_slice(name, row_begin, row_end);
  }
  void copy_to(const std::string& name, const at::Tensor& dst) const {
    file_of(name).copy_to(name, dst);
  }
  void read_range(const std::string& name, int64_t begin, int64_t end, const at::Tensor& dst) const {
    file_of(name).read_range(name, begin, end, dst);
  }
  // The shard holding `name`; FormatError naming the directory and the tensor when none does.
  const SafetensorsFile& file_of(const std::string& name) const;
  const std::vector<SafetensorsFile>& files() const { return files_; }

 private:
  std::string dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> shard_of_;  // tensor name -> index into files_
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Writes `tensors` (any device, any strides; stored C-order contiguous) as one safetensors file
// laid out as the reference writer lays it out: data ordered by dtype width then name, header JSON
// padded with spaces to a multiple of 8. Atomic: the bytes go to `path + ".tmp"`, are fsync'ed,
// renamed over `path`, and the directory is fsync'ed, so `path` is either the old file or the
// complete new one. ft::Error for a duplicate or reserved name or an unsupported dtype; SystemError
// for I/O.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `tensors` into `dir` (created if missing) the way transformers' save_pretrained does:
// shards of at most `max_shard_bytes` (a larger tensor gets a shard of its own) named
// `model-0000k-of-0000N.safetensors` plus `model.safetensors.index.json`, or a lone
// `model.safetensors` without an index when everything fits in one shard. `metadata` goes into
// every file. Each file is written atomically; stale model shards, single file or index from an
// earlier save are removed afterwards so the directory cannot mix two saves. Returns the file names
// written.
std::vector<std::string> write_sharded(const std::string& dir, const NamedTensors& tensors,
                                       uint64_t max_shard_bytes = kDefaultMaxShardBytes,
                                       const std::map<std::string, std::string>& metadata = {});

// A tensor to write whose values are made only when its bytes are written: its name, shape and
// dtype are known up front (they go into the headers), `make` is called once, as its turn comes,
// and what it returns is released before the next tensor is made. Writing a model converted from
// a checkpoint this way holds one tensor at a time, never the whole model.
struct DeferredTensor {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  std::function<at::Tensor()> make;  // exactly `shape` and `dtype`; any device and strides
};
using DeferredTensors = std::vector<DeferredTensor>;
// The tensors as deferred ones that hand out themselves; ft::Error naming an undefined or
// non-dense one.
DeferredTensors defer(const NamedTensors& tensors);
// Told after each file of a sharded save is durable: its name, its place (1-based) among `count`
// files, and its data bytes.
using ShardWritten =
    std::function<void(const std::string& file, size_t number, size_t count, uint64_t bytes)>;

// write_sharded for deferred tensors: the same files, split the same way, each tensor made while
// its shard is written. A `make` that throws stops the save with that error; the files of the
// shards before it stay on disk (the caller removes its directory).
std::vector<std::string> write_sharded_deferred(
    const std::string& dir, const DeferredTensors& tensors,
    uint64_t max_shard_bytes = kDefaultMaxShardBytes,
    const std::map<std::string, std::string>& metadata = {}, const ShardWritten& on_written = {});

// The order in which write_sharded_deferred(dir, tensors, max_shard_bytes) calls the tensors'
// `make` (indices into `tensors`). When every `make` is a collective that all ranks must take
// part in, the ranks that do not write walk this order to call theirs in step.
std::vector<size_t> write_order(const DeferredTensors& tensors,
                                uint64_t max_shard_bytes = kDefaultMaxShardBytes);

}  // namespace ft::io
