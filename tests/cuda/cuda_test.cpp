// The CUDA room without a GPU: the device choice for every combination of setting, build and
// machine; the loader's errors; the library of this build loading and exporting its table, and
// forming an NCCL group through it (refused with no GPU visible).
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "cuda/device.h"
#include "cuda/loader.h"
#include "comm/process_group.h"
#include "support/subprocess.h"

using namespace ft;
using namespace ft::test;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {
cuda::DeviceProbe probe(bool compiled, int gpus) {
  cuda::DeviceProbe p;
  p.cuda_compiled = compiled;
  p.visible_gpus = gpus;
  p.gpu_name = gpus ? "Test GPU" : "";
  return p;
}
}  // namespace

TEST_CASE("hardware.device: cpu is cpu, auto is cuda:LOCAL_RANK only with CUDA and a GPU") {
  CHECK(cuda::choose_device("cpu", 3, probe(true, 8)).device == c10::Device(c10::kCPU));
  CHECK(cuda::choose_device("auto", 0, probe(true, 0)).device == c10::Device(c10::kCPU));
  CHECK_THAT(cuda::choose_device("auto", 0, probe(true, 0)).reason, Contains("no GPU visible"));
  const auto no_build = cuda::choose_device("auto", 1, probe(false, 8));
  CHECK(no_build.device == c10::Device(c10::kCPU));
  CHECK_THAT(no_build.reason, Contains("built without CUDA"));
  const auto gpu = cuda::choose_device("auto", 1, probe(true, 2));
  CHECK(gpu.device == c10::Device(c10::kCUDA, 1));
  CHECK_THAT(gpu.reason, Contains("2 GPU(s) visible"));
  CHECK(cuda::choose_device("cuda", 7, probe(true, 8)).device == c10::Device(c10::kCUDA, 7));
}

TEST_CASE("hardware.device=cuda is refused, saying why and what to do, where it cannot be had") {
  CHECK_THROWS_AS(cuda::choose_device("cuda", 0, probe(false, 8)), ConfigError);
  CHECK_THROWS_WITH(cuda::choose_device("cuda", 0, probe(false, 8)),
                    Contains("hardware.device=cuda") && Contains("built without CUDA") &&
                        Contains("hardware.device=cpu"));
  CHECK_THROWS_WITH(cuda::choose_device("cuda", 0, probe(true, 0)),
                    Contains("hardware.device=cuda") && Contains("shows no GPU") &&
                        Contains("CUDA_VISIBLE_DEVICES") && Contains("hardware.device=cpu"));
  // One GPU per worker: a rank past the visible GPUs is refused, under auto too (never half a job
  // on CPU).
  CHECK_THROWS_WITH(
      cuda::choose_device("cuda", 2, probe(true, 2)),
      Contains("LOCAL_RANK 2 needs cuda:2 but 2 GPU(s)") && Contains("--nproc-per-node 2"));
  CHECK_THROWS_AS(cuda::choose_device("auto", 4, probe(true, 4)), ConfigError);
  CHECK_THROWS_WITH(cuda::choose_device("gpu", 0, probe(true, 1)),
                    Contains("hardware.device must be auto, cpu or cuda, got 'gpu'"));
}

TEST_CASE("the loader names the library and the loader's error when it cannot open it") {
  const std::string dir = make_temp_dir();
  CHECK_THROWS_AS(cuda::open_library(dir + "/missing.so"), ConfigError);
  CHECK_THROWS_WITH(cuda::open_library(dir + "/missing.so"),
                    Contains(dir + "/missing.so") && Contains("No such file"));
  {
    std::ofstream f(dir + "/text.so");
    f << "not a shared library\n";
  }
  CHECK_THROWS_WITH(cuda::open_library(dir + "/text.so"), Contains(dir + "/text.so"));
  // A real shared library that is not ft's: refused for lacking the entry point.
  CHECK_THROWS_WITH(cuda::open_library("libm.so.6"),
                    Contains("does not export ft_cuda_api") && Contains("FT_CUDA_LIBRARY"));

  ::setenv("FT_CUDA_LIBRARY", (dir + "/text.so").c_str(), 1);
  CHECK(cuda::library_paths() == std::vector<std::string>{dir + "/text.so"});
  ::unsetenv("FT_CUDA_LIBRARY");
  // Beside the running program: build/bin/<test> -> build/lib/libft_cuda.so.
  const auto paths = cuda::library_paths();
  REQUIRE_FALSE(paths.empty());
  CHECK(fs::path(paths.front()).filename() == "libft_cuda.so");
  CHECK(fs::path(paths.front()).parent_path().filename() == "lib");
}

#ifdef FT_CUDA_LIB
TEST_CASE("libft_cuda.so of this build loads and exports its table") {
  // Loading it runs libtorch_cuda's static initialisers; no GPU or driver is needed for that.
  const cuda::Api& api = cuda::open_library(FT_CUDA_LIB);
  CHECK(api.version == cuda::kApiVersion);
  for (const void* fn :
       {reinterpret_cast<const void*>(api.device_count),
        reinterpret_cast<const void*>(api.set_device),
        reinterpret_cast<const void*>(api.make_nccl_backend),
        reinterpret_cast<const void*>(api.synchronize), reinterpret_cast<const void*>(api.memory),
        reinterpret_cast<const void*>(api.manual_seed),
        reinterpret_cast<const void*>(api.generator_state),
        reinterpret_cast<const void*>(api.set_generator_state)})
    CHECK(fn != nullptr);
  // The CUDA runtime and the driver probe agree on the GPUs (none on a CPU machine).
  CHECK(api.device_count() == cuda::probe_devices().visible_gpus);
  // The path the runtime finds by itself is this very library.
  CHECK(fs::equivalent(cuda::library_paths().front(), FT_CUDA_LIB));
  CHECK(&cuda::api() == &api);
}

TEST_CASE("an NCCL group with no GPU visible is a BackendError naming NCCL") {
  // Hidden before anything in this process starts the CUDA runtime, so this holds on GPU machines.
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
  comm::DistEnv env;  // world size 1: an in-process store
  comm::ProcessGroupOptions o;
  o.device = c10::Device(c10::kCUDA, 0);
  CHECK_THROWS_AS(comm::ProcessGroup(env, o), BackendError);
  CHECK_THROWS_WITH(comm::ProcessGroup(env, o), Contains("cannot form the NCCL process group"));
}
#endif
