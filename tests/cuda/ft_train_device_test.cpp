// `ft train` as a user runs it, about the device: hardware.device=cuda refused where no GPU is
// visible (exit 2, nothing written), auto falling back to the CPU there.
#include <catch2/catch.hpp>
#include <filesystem>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {
#ifdef FT_WITH_CUDA
constexpr bool kCudaBuild = true;
#else
constexpr bool kCudaBuild = false;
#endif

// `ft train` on tiny-demo with no GPU visible to it (an empty CUDA_VISIBLE_DEVICES hides every
// GPU from the driver, so this holds on GPU machines too).
int train_without_gpu(const std::vector<std::string>& sets, const std::string& out,
                      const std::string& log) {
  return run_to_end(ft_train_argv({"--preset", "tiny-demo", "--output", out}, sets),
                    {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}, {"CUDA_VISIBLE_DEVICES", ""}}, log,
                    240)
      .code;
}
}  // namespace

TEST_CASE("ft train with hardware.device=cuda and no GPU exits 2 and writes nothing",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  CHECK(train_without_gpu({"hardware.device=cuda", "train.max_steps=2"}, dir + "/run",
                          dir + "/cuda.log") == 2);
  const std::string log = read_file(dir + "/cuda.log");
  CHECK_THAT(log, Contains("hardware.device=cuda"));
  CHECK_THAT(log, Contains(kCudaBuild ? "the CUDA driver shows no GPU" : "built without CUDA"));
  CHECK_THAT(log, Contains("--set hardware.device=cpu"));
  CHECK_FALSE(fs::exists(dir + "/run"));
}

TEST_CASE("ft train with hardware.device=auto trains on CPU where no GPU is visible",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  REQUIRE(train_without_gpu({"hardware.device=auto", "train.max_steps=2"}, dir + "/run",
                            dir + "/auto.log") == 0);
  const std::string log = read_file(dir + "/auto.log");
  CHECK_THAT(log, Contains("ft train: device cpu (hardware.device=auto: "));
  CHECK_THAT(read_file(dir + "/run/preset.json"), Contains("\"device\": \"auto\""));
  // CPU runs report no GPU memory.
  CHECK_THAT(read_file(dir + "/run/metrics.jsonl"), !Contains("cuda_allocated_bytes"));
}
