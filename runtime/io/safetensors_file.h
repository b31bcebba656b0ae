// One safetensors file, memory-mapped read-only and bounds-checked when opened. It owns its mapping
// and every tensor it hands out shares that ownership, so views outlive the object. Immutable once
// opened: reading it from many threads at once is safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/safetensors_header.h"

namespace ft::io {

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

}  // namespace ft::io
