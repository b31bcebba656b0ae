// The weights of a model directory, as transformers lays them out: a lone `model.safetensors`, or
// shards listed by `model.safetensors.index.json` (tensor name -> shard file). Owns one
// SafetensorsFile per shard. An opened index is immutable: reading it from many threads is safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "io/safetensors_file.h"

namespace ft::io {

inline constexpr const char* kSingleFileName = "model.safetensors";
inline constexpr const char* kIndexFileName = "model.safetensors.index.json";

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
  void read_range(const std::string& name, int64_t begin, int64_t end,
                  const at::Tensor& dst) const {
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

}  // namespace ft::io
