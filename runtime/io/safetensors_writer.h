// Writing safetensors as the reference writer and save_pretrained lay it out: one file, or a model
// directory sharded past a size, tensors made one at a time as their turn comes; every file is a
// DurableFile. Stateless; thread-safe as long as two calls do not write the same file or directory.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ft::io {

// Hugging Face's default shard size ("5GB" in save_pretrained).
inline constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000;

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
