// NF4 (model/nf4.h, issue 33) against bitsandbytes: for every case of tests/model/fixtures/nf4
// (make_nf4_fixtures.py: fp32, bf16 and fp16 weights, a short last block, an odd count, a block of
// zeros, several blocks of 256 absmax values), ft's quantization gives bitsandbytes' bytes without
// and with double quantization, and its dequantization bitsandbytes' values, both from ft's own
// quantization and from the stored state.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <ATen/Parallel.h>

#include <filesystem>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/nf4.h"

namespace {

std::vector<std::string> cases() {
  std::vector<std::string> out;
  for (const auto& e :
       std::filesystem::directory_iterator(std::string(FT_TEST_DIR) + "/model/fixtures/nf4"))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The first element where a and b differ, for the failure message.
std::string first_difference(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.flatten().to(at::kDouble), y = b.flatten().to(at::kDouble);
  if (x.numel() != y.numel()) return "different sizes";
  const at::Tensor d = at::nonzero(x.ne(y));
  if (d.numel() == 0) return "none";
  const int64_t i = d[0][0].item<int64_t>();
  return "element " + std::to_string(i) + ": " + std::to_string(x[i].item<double>()) + " vs " +
         std::to_string(y[i].item<double>()) + " (" + std::to_string(d.size(0)) + " differ)";
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.numel() == b.numel() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

}  // namespace

TEST_CASE("NF4 quantization and dequantization equal bitsandbytes", "[unit]") {
  const auto files = cases();
  REQUIRE(files.size() == 7);
  const int threads_before = at::get_num_threads();
  for (const auto& path : files)
    for (const int threads : {1, 2}) {
      INFO(path << ", " << threads << " thread(s)");
      at::set_num_threads(threads);
      auto f = ft::io::SafetensorsFile::open(path);
      const at::Tensor w = f.tensor("input");
      for (const bool dq : {false, true}) {
        INFO("double quantization " << dq);
        const std::string p = dq ? "dq." : "";
        const ft::model::Nf4Weight q = ft::model::quantize_nf4(w, dq);
        CHECK(same_bytes(q.packed, f.tensor(p + "packed")));
        CHECK(same_bytes(q.absmax, f.tensor(p + "absmax")));
        if (dq) {
          CHECK(same_bytes(q.nested_absmax, f.tensor("dq.nested_absmax")));
          CHECK(same_bytes(q.nested_code, f.tensor("dq.nested_code")));
          CHECK(q.offset == f.tensor("dq.offset").item<float>());
        }
        const at::Tensor want = f.tensor(p + "dequantized");
        const at::Tensor got = ft::model::dequantize_nf4(q, w.scalar_type());
        INFO("dequantized: first difference " << first_difference(got, want));
        CHECK(same_bytes(got, want));
        // From the stored state, as a checkpoint saved by transformers + bitsandbytes gives it.
        ft::model::Nf4Weight stored;
        stored.shape = w.sizes().vec();
        stored.packed = f.tensor(p + "packed");
        stored.absmax = f.tensor(p + "absmax");
        if (dq) {
          stored.nested_absmax = f.tensor("dq.nested_absmax");
          stored.nested_code = f.tensor("dq.nested_code");
          stored.offset = f.tensor("dq.offset").item<float>();
        }
        CHECK(same_bytes(ft::model::dequantize_nf4(stored, w.scalar_type()), want));
      }
    }
  at::set_num_threads(threads_before);
}

TEST_CASE("NF4: the code, the dynamic map and refusals", "[unit]") {
  const auto& c = ft::model::nf4_code();
  CHECK(c.front() == -1.0f);
  CHECK(c[7] == 0.0f);
  CHECK(c.back() == 1.0f);
  CHECK(std::is_sorted(c.begin(), c.end()));
  const at::Tensor m = ft::model::dynamic_map();
  REQUIRE(m.numel() == 256);
  CHECK(m[255].item<float>() == 1.0f);
  CHECK(at::equal(std::get<0>(m.sort()), m));
  CHECK_THROWS_WITH(ft::model::quantize_nf4(at::zeros({4, 4}, at::kInt), false),
                    Catch::Contains("NF4 quantizes fp32, bf16 or fp16 host tensors"));
  CHECK_THROWS_WITH(ft::model::quantize_nf4(at::zeros({64}), false, 48),
                    Catch::Contains("NF4 block size must be a power of two from 32 to 4096"));
  ft::model::Nf4Weight bad = ft::model::quantize_nf4(at::randn({128}), false);
  bad.shape = {256};
  CHECK_THROWS_WITH(ft::model::dequantize_nf4(bad, at::kFloat),
                    Catch::Contains("needs 128 packed bytes and 4 absmax values, got 64 and 2"));
}
