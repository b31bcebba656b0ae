#include "comm/comm_check.h"

#include <ATen/ATen.h>

#include <chrono>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/process_group.h"

namespace ft::comm {

CommCheckResult run_comm_check(const DistEnv& env, int iters, int64_t numel) {
  ProcessGroup pg(env);
  CommCheckResult r;
  r.rank = pg.rank();
  r.world_size = pg.size();
  r.expected = r.world_size * (r.world_size + 1) / 2.0;

  std::vector<at::Tensor> t = {at::full({1}, static_cast<double>(r.rank + 1), at::kDouble)};
  pg.backend().allreduce(t)->wait();
  r.sum = t[0].item<double>();

  std::vector<at::Tensor> payload = {at::ones({numel}, at::kFloat)};
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) pg.backend().allreduce(payload)->wait();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  pg.backend().barrier()->wait();
  return r;
}

}  // namespace ft::comm
