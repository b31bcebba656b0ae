// host_addmm (model/host_blas.h) against at::addmm_: the same bits for every layout ft's linear
// layers use (forward x W^T, input gradient g W, weight gradient g^T x), odd sizes, leading
// dimensions wider than the matrix, 1 and 2 threads; and nothing done where it declines.
#include "model/host_blas.h"

#include <ATen/Parallel.h>

#include "support/catch_torch.h"

using ft::model::host_addmm;
using ft::model::host_zeros;

namespace {

at::Tensor rand(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::kFloat);
}

// A [rows, cols] matrix whose rows are `pad` values further apart than its width.
at::Tensor padded(int64_t rows, int64_t cols, int64_t pad, uint64_t seed) {
  return rand({rows, cols + pad}, seed).narrow(1, 0, cols);
}

}  // namespace

TEST_CASE("host_addmm: at::addmm_'s bits for the linear layer's products", "[unit]") {
  const int threads = at::get_num_threads();
  for (const int t : {1, 2}) {
    at::set_num_threads(t);
    for (const auto& [M, K, N] : std::vector<std::array<int64_t, 3>>{{64, 256, 256},
                                                                     {64, 256, 688},
                                                                     {64, 688, 256},
                                                                     {7, 13, 5},
                                                                     {1024, 96, 33},
                                                                     {3, 2, 2}}) {
      for (const int64_t pad : {0, 3}) {
        INFO(t << " threads, M " << M << " K " << K << " N " << N << ", row padding " << pad);
        const at::Tensor x = padded(M, K, pad, 1), w = padded(N, K, pad, 2),
                         g = padded(M, N, pad, 3);
        // (a, b, what): the forward, the input gradient, the weight gradient.
        const std::vector<std::tuple<at::Tensor, at::Tensor, const char*>> cases = {
            {x, w.t(), "x W^T"}, {g, w, "g W"}, {g.t(), x, "g^T x"}};
        for (const auto& [a, b, what] : cases) {
          INFO(what);
          const at::Tensor base = rand({a.size(0), b.size(1)}, 4);
          at::Tensor ref = base.clone(), got = base.clone();
          ref.addmm_(a, b);
          REQUIRE(host_addmm(got, a, b));
          CHECK(at::equal(got, ref));
          // Into zeros, as the layer's products are computed.
          at::Tensor zref = at::zeros_like(base),
                     zgot = host_zeros(a.size(0), b.size(1), base.options());
          CHECK(at::equal(zgot, zref));
          zref.addmm_(a, b);
          REQUIRE(host_addmm(zgot, a, b));
          CHECK(at::equal(zgot, zref));
          CHECK(at::equal(zref, at::mm(a, b)));  // and at::mm's (beta 0) bits
        }
      }
    }
  }
  at::set_num_threads(threads);
}

TEST_CASE("host_addmm declines what it does not cover and leaves the result alone", "[unit]") {
  const at::Tensor a = rand({8, 4}, 1), b = rand({4, 6}, 2);
  const at::Tensor c0 = rand({8, 6}, 3);
  auto declines = [&](const at::Tensor& c, const at::Tensor& x, const at::Tensor& y) {
    const at::Tensor before = c.clone();
    const bool done = host_addmm(c, x, y);
    return !done && at::equal(c, before);
  };
  CHECK(declines(c0.to(at::kDouble), a.to(at::kDouble), b.to(at::kDouble)));  // not fp32
  CHECK(declines(c0.t().contiguous().t(), a, b));             // result not row-major
  CHECK(declines(c0.narrow(0, 0, 1), a.narrow(0, 0, 1), b));  // a size of 1
  CHECK(declines(c0, a.narrow(1, 0, 1).expand({8, 4}), b));   // a stride of 0
  CHECK(declines(c0, a.unsqueeze(0), b));                     // not 2-D
  CHECK(declines(c0, rand({8, 5}, 4), b));                    // sizes disagree
}

TEST_CASE("host_zeros fills small and large results with zeros", "[unit]") {
  for (const int64_t cols : {3, 1 << 12, 1 << 16}) {
    at::Tensor t = host_zeros(17, cols, at::TensorOptions().dtype(at::kFloat));
    CHECK(t.sizes() == at::IntArrayRef({17, cols}));
    CHECK(t.is_contiguous());
    CHECK(t.abs().max().item<float>() == 0.0f);
  }
}
