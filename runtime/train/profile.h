// Profiling a few optimizer steps with LibTorch's profiler (Kineto): where a step's time goes,
// op by op. Set by output.profile_steps; rank 0 only. Not thread-safe: the training thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace torch::autograd::profiler {
struct ProfilerResult;
}

namespace ft::train {

class StepProfiler {
 public:
  // Profiles steps first..first+count-1 (1-based optimizer steps, at most up to `total`) into
  // `dir`; count 0: never. `cuda`: record the GPU's kernels too.
  StepProfiler(int64_t first, int64_t count, int64_t total, bool cuda, std::string dir);
  ~StepProfiler();
  // Around each optimizer step; `step` is the step about to run / just run.
  void before_step(int64_t step);
  void after_step(int64_t step);

 private:
  void finish(double wall_s);

  int64_t first_, last_;
  bool cuda_, active_ = false;
  std::string dir_;
  double started_s_ = 0;
};

// The table `ft train` prints for a profile: the `top` names with the most time, device kernels
// for a GPU job (each kernel's own time), operators for a CPU job by self time (less the ops they
// call), their inclusive time beside it.
std::string profile_table(const torch::autograd::profiler::ProfilerResult& result, bool cuda,
                          double wall_s, int64_t steps, size_t top = 20);

}  // namespace ft::train
