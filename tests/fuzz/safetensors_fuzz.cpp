// Fuzzes the safetensors reader. An input that starts with '{' is a model directory's
// model.safetensors.index.json, opened by SafetensorsIndex::open beside two fixed shards and every
// tensor it maps read; anything else is a whole .safetensors file: parse_header, and for a file it
// accepts, the header encoded again must parse to the same entries, and every tensor is read back
// through SafetensorsFile (view, row slice, pread copy).
#include <ATen/ATen.h>

#include <algorithm>
#include <tuple>

#include "fuzz_support.h"
#include "io/safetensors.h"

namespace {

using namespace ft;

// The model directory of index inputs, with its two shards written once.
const std::string& model_dir() {
  static const std::string dir = [] {
    const std::string d = fuzz::scratch_dir() + "/model";
    std::filesystem::create_directories(d);
    io::write_safetensors(d + "/model-00001-of-00002.safetensors",
                          {{"embed.weight", at::arange(6, at::kFloat).reshape({3, 2})},
                           {"norm.weight", at::ones({2}, at::kBFloat16)}});
    io::write_safetensors(d + "/model-00002-of-00002.safetensors",
                          {{"lm_head.weight", at::arange(4, at::kLong).reshape({2, 2})}});
    return d;
  }();
  return dir;
}

void read_all(const io::SafetensorsFile& f) {
  for (const std::string& name : f.names()) {
    const io::TensorInfo& info = f.info(name);
    at::Tensor t = f.tensor(name);
    fuzz::require(t.numel() == info.numel(), "tensor() of " + name + " has the header's numel");
    (void)t.clone();  // touches every byte of the view
    if (!info.shape.empty()) (void)f.tensor_slice(name, 0, info.shape[0]).clone();
    at::Tensor dst = at::empty({info.numel()}, at::TensorOptions().dtype(info.dtype));
    f.read_range(name, 0, info.numel(), dst);
  }
}

void fuzz_index(std::string_view text) {
  const std::string& dir = model_dir();
  fuzz::write_file(dir + "/" + io::kIndexFileName, text);
  fuzz::expect_ft_errors([&] {
    const io::SafetensorsIndex idx = io::SafetensorsIndex::open(dir);
    for (const std::string& name : idx.names()) {
      const io::TensorInfo& info = idx.info(name);
      (void)idx.tensor(name).clone();
      at::Tensor dst = at::empty({info.numel()}, at::TensorOptions().dtype(info.dtype));
      idx.read_range(name, 0, info.numel(), dst);
    }
  });
}

std::vector<io::TensorInfo> by_name(std::vector<io::TensorInfo> v) {
  std::sort(v.begin(), v.end(),
            [](const io::TensorInfo& a, const io::TensorInfo& b) { return a.name < b.name; });
  return v;
}

bool same(const io::TensorInfo& a, const io::TensorInfo& b) {
  return std::tie(a.name, a.dtype_name, a.shape, a.begin, a.end) ==
         std::tie(b.name, b.dtype_name, b.shape, b.begin, b.end);
}

void fuzz_file(const uint8_t* data, size_t size) {
  fuzz::expect_ft_errors([&] {
    const io::Header h = io::parse_header("input.safetensors", data, size);
    // What the writer would make of the same entries reads back as them.
    std::string again = io::encode_header("again.safetensors", h.tensors, h.metadata);
    again.append(reinterpret_cast<const char*>(data) + h.data_start, size - h.data_start);
    const io::Header h2 = io::parse_header(
        "again.safetensors", reinterpret_cast<const uint8_t*>(again.data()), again.size());
    const auto a = by_name(h.tensors), b = by_name(h2.tensors);
    fuzz::require(a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), same) &&
                      h.metadata == h2.metadata,
                  "an accepted header encodes back to the same entries");

    const std::string path = fuzz::scratch_dir() + "/input.safetensors";
    fuzz::write_file(path, fuzz::as_text(data, size));
    read_all(io::SafetensorsFile::open(path));
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 0 && data[0] == '{') {
    fuzz_index(fuzz::as_text(data, size));
  } else {
    fuzz_file(data, size);
  }
  return 0;
}
