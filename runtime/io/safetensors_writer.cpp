#include "io/safetensors_writer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "core/error.h"
#include "io/durable_file.h"
#include "io/safetensors_header.h"
#include "io/safetensors_index.h"

namespace ft::io {

namespace fs = std::filesystem;

using msg::shape_str;

namespace {

struct PlannedTensor {
  const DeferredTensor* tensor;
  const DtypeSpec* spec;
  uint64_t nbytes;
};

PlannedTensor plan_one(const DeferredTensor& t) {
  const DtypeSpec* spec = dtype_spec(t.dtype);
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
    size_t ra = write_rank(*a.spec), rb = write_rank(*b.spec);
    return ra != rb ? ra < rb : a.tensor->name < b.tensor->name;
  });
  return plan;
}

void write_one_file(const std::string& path, const std::vector<const DeferredTensor*>& tensors,
                    const std::map<std::string, std::string>& metadata) {
  const std::vector<PlannedTensor> plan = file_order(path, tensors);

  std::vector<TensorInfo> entries;
  entries.reserve(plan.size());
  uint64_t offset = 0;
  for (const auto& p : plan) {
    entries.push_back({p.tensor->name, p.spec->name, p.tensor->dtype, p.tensor->shape, offset,
                       offset + p.nbytes});
    offset += p.nbytes;
  }
  const std::string header = encode_header(path, entries, metadata);

  DurableFile out(path, header.size() + offset);
  out.write(header);
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
    out.push_back({name, t.sizes().vec(), t.scalar_type(), [t = t] { return t; }});
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
    fsync_dir(dir);
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
  write_file_durably((root / kIndexFileName).string(), text);
  written.push_back(kIndexFileName);
  return written;
}

}  // namespace ft::io
