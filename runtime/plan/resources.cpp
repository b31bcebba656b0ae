#include "plan/resources.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/strings.h"
#include "train/optimizer.h"

namespace ft::plan {

namespace fs = std::filesystem;

namespace {

int64_t meminfo(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string k;
  int64_t v = 0;
  std::string unit;
  while (in >> k >> v) {
    std::getline(in, unit);
    if (k == key + ":") return v * 1024;
  }
  return 0;
}

int64_t status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key + ":", 0) == 0) return std::atoll(line.c_str() + key.size() + 1) * 1024;
  return 0;
}

// A number from a cgroup file; 0 for "max", a missing file or a huge v1 "no limit".
int64_t cgroup_number(const fs::path& file) {
  std::ifstream in(file);
  std::string v;
  if (!(in >> v) || v == "max") return 0;
  const long double n = std::strtold(v.c_str(), nullptr);
  if (n <= 0 || n > 1e18) return 0;
  return static_cast<int64_t>(n);
}

// The memory a cgroup still lets this process use (limit - usage), and which file said so.
int64_t cgroup_room(std::string* from) {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) == 0) {  // v2
      const fs::path dir = fs::path("/sys/fs/cgroup") / line.substr(4);
      const int64_t limit = cgroup_number(dir / "memory.max");
      if (limit > 0) {
        *from = (dir / "memory.max").string();
        return std::max<int64_t>(0, limit - cgroup_number(dir / "memory.current"));
      }
    }
  }
  const fs::path v1 = "/sys/fs/cgroup/memory";
  const int64_t limit = cgroup_number(v1 / "memory.limit_in_bytes");
  if (limit > 0) {
    *from = (v1 / "memory.limit_in_bytes").string();
    return std::max<int64_t>(0, limit - cgroup_number(v1 / "memory.usage_in_bytes"));
  }
  return 0;
}

// NVML, opened at run time: free memory of each visible GPU without creating a CUDA context.
struct NvmlMemory {
  unsigned long long total, free, used;
};

// CUDA_VISIBLE_DEVICES as NVML indices, when it is a list of numbers; every one of the `n` GPUs
// otherwise (UUIDs or MIG names: every GPU counts).
std::vector<unsigned> visible_gpus(unsigned n) {
  std::vector<unsigned> visible;
  bool indices = true;
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::stringstream ss(v);
    std::string tok;
    while (std::getline(ss, tok, ',')) {
      if (tok.empty()) continue;
      if (!std::all_of(tok.begin(), tok.end(), ::isdigit)) indices = false;
      if (indices && tok.size() < 9) visible.push_back(static_cast<unsigned>(std::stoul(tok)));
    }
  }
  if (!std::getenv("CUDA_VISIBLE_DEVICES") || !indices) {
    visible.clear();
    for (unsigned i = 0; i < n; ++i) visible.push_back(i);
  }
  visible.erase(std::remove_if(visible.begin(), visible.end(), [n](unsigned i) { return i >= n; }),
                visible.end());
  return visible;
}

// NVML opened and initialised: its GPU count and handles, and `sym` for the other entry points;
// `why` says what is missing when !ok(). Shuts NVML down when it goes.
struct Nvml {
  void* lib = nullptr;
  unsigned n = 0;
  std::string why;
  int (*handle_fn)(unsigned, void**) = nullptr;
  int (*shutdown_fn)() = nullptr;
  bool inited = false;
  Nvml() {
    lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      why = "no NVML (libnvidia-ml.so.1) on this machine";
      return;
    }
    auto init = sym<int (*)()>("nvmlInit_v2");
    auto count = sym<int (*)(unsigned*)>("nvmlDeviceGetCount_v2");
    handle_fn = sym<int (*)(unsigned, void**)>("nvmlDeviceGetHandleByIndex_v2");
    shutdown_fn = sym<int (*)()>("nvmlShutdown");
    inited = init && count && handle_fn && init() == 0;
    if (!inited || count(&n) != 0 || n == 0) why = "NVML found no GPU";
  }
  ~Nvml() {
    if (inited && shutdown_fn) shutdown_fn();
  }
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;
  bool ok() const { return why.empty(); }
  template <class F>
  F sym(const char* name) const {
    return lib ? reinterpret_cast<F>(dlsym(lib, name)) : nullptr;
  }
  // The visible GPUs' handles (CUDA_VISIBLE_DEVICES), in order.
  std::vector<void*> handles() const {
    std::vector<void*> h;
    for (unsigned i : visible_gpus(n)) {
      void* d = nullptr;
      if (handle_fn(i, &d) == 0) h.push_back(d);
    }
    return h;
  }
};

void probe_gpus(Machine& m) {
  const Nvml nvml;
  auto mem = nvml.sym<int (*)(void*, NvmlMemory*)>("nvmlDeviceGetMemoryInfo");
  if (!nvml.ok() || !mem) {
    m.gpu_from = nvml.ok() ? "NVML found no GPU" : nvml.why;
    return;
  }
  for (void* h : nvml.handles()) {
    NvmlMemory info{};
    if (mem(h, &info) != 0) continue;
    m.gpus++;
    const auto free_bytes = static_cast<int64_t>(info.free);
    m.gpu_free = m.gpu_free == 0 ? free_bytes : std::min(m.gpu_free, free_bytes);
  }
  m.gpu_from = fmt::format("NVML: the least free memory of {} visible GPU(s)", m.gpus);
}

}  // namespace

GpuLinks probe_gpu_links() {
  GpuLinks g;
  const Nvml nvml;
  auto ancestor = nvml.sym<int (*)(void*, void*, int*)>("nvmlDeviceGetTopologyCommonAncestor");
  auto p2p = nvml.sym<int (*)(void*, void*, int, int*)>("nvmlDeviceGetP2PStatus");
  if (!nvml.ok() || !ancestor || !p2p) {
    g.from = nvml.ok() ? "this NVML has no topology queries" : nvml.why;
    return g;
  }
  const std::vector<void*> h = nvml.handles();
  g.gpus = static_cast<int>(h.size());
  // NVML's P2P capability indices (READ = 0, NVLINK = 2) and status (OK = 0); the common ancestor's
  // levels (INTERNAL 0, SINGLE 10, MULTIPLE 20, HOSTBRIDGE 30, NODE 40, SYSTEM 50).
  constexpr int kRead = 0, kNvlink = 2, kOk = 0;
  for (int a = 0; a < g.gpus; ++a)
    for (int b = 0; b < g.gpus; ++b) {
      int status = -1, level = -1;
      std::string path = "X";
      bool read = a == b;
      if (a != b) {
        if (p2p(h[a], h[b], kNvlink, &status) == 0 && status == kOk) {
          path = "NVLink";
        } else if (ancestor(h[a], h[b], &level) == 0) {
          path = level <= 0    ? "same board"
                 : level <= 10 ? "PIX"
                 : level <= 20 ? "PXB"
                 : level <= 30 ? "PHB"
                 : level <= 40 ? "NODE"
                               : "SYS";
        } else {
          path = "?";
        }
        read = p2p(h[a], h[b], kRead, &status) == 0 && status == kOk;
      }
      g.path.push_back(path);
      g.p2p_read.push_back(read);
    }
  g.from = "NVML";
  return g;
}

Machine probe_machine(const std::string& output_dir) {
  Machine m;
  const int64_t avail = meminfo("MemAvailable");
  std::string cg_from;
  const int64_t room = cgroup_room(&cg_from);
  m.host_available = avail;
  m.host_from = "this machine's MemAvailable";
  if (room > 0 && (avail == 0 || room < avail)) {
    m.host_available = room;
    m.host_from = "the cgroup limit " + cg_from + " less its usage";
  }
  probe_gpus(m);
  if (!output_dir.empty()) {
    fs::path dir = fs::absolute(output_dir);
    std::error_code ec;
    while (!dir.empty() && !fs::exists(dir, ec) && dir != dir.parent_path())
      dir = dir.parent_path();
    struct statvfs sv {};
    if (::statvfs(dir.c_str(), &sv) == 0) {
      m.disk_free = static_cast<int64_t>(sv.f_bavail) * static_cast<int64_t>(sv.f_frsize);
      m.disk_from = "free space of " + dir.string();
    }
  }
  m.process_bytes = status_bytes("VmRSS");
  return m;
}

double measure_read_throughput(const std::string& model_dir, std::string* from) {
  if (model_dir.empty()) return 0;
  fs::path best;
  std::error_code ec;
  uintmax_t size = 0;
  for (const auto& e : fs::directory_iterator(model_dir, ec))
    if (e.path().extension() == ".safetensors" && e.file_size(ec) > size) {
      size = e.file_size(ec);
      best = e.path();
    }
  if (best.empty()) return 0;
  const int fd = ::open(best.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const size_t want = std::min<uintmax_t>(size, 64u << 20);
  ::posix_fadvise(fd, 0, static_cast<off_t>(want), POSIX_FADV_DONTNEED);
  std::vector<char> buf(4 << 20);
  size_t done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (done < want) {
    const ssize_t n =
        ::pread(fd, buf.data(), std::min(buf.size(), want - done), static_cast<off_t>(done));
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  if (done < (1u << 20) || s <= 0) return 0;
  if (from)
    *from = fmt::format("measured on {} of {}", human_bytes(static_cast<int64_t>(done)),
                        best.filename().string());
  return static_cast<double>(done) / s;
}

double measure_init_rate() {
  at::Tensor t = at::empty({1 << 22}, at::kFloat);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  t.normal_(0, 0.02, gen);  // first touch
  const auto t0 = std::chrono::steady_clock::now();
  t.normal_(0, 0.02, gen);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s > 0 ? static_cast<double>(t.numel()) / s : 0;
}

namespace {
// The best of three timed steps of ft's host AdamW as the trainer runs it (clip factor, zeroing
// and a bf16 copy-out in one pass) over n fp32 parameters on `threads` threads, after one that
// touches the memory first.
double host_adamw_step_s(int64_t n, int threads) {
  struct Threads {
    int before = at::get_num_threads();
    ~Threads() { at::set_num_threads(before); }
  } restore;
  at::set_num_threads(threads);
  at::Tensor p = at::zeros({n}, at::kFloat);
  p.mutable_grad() = at::full({n}, 1e-3, at::kFloat);
  train::AdamW opt({train::AdamW::Param(p, true, at::empty({n}, at::kBFloat16))}, {});
  opt.step(1e-4, 0.5, true);  // first touch of the moments
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    opt.step(1e-4, 0.5, true);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = i == 0 ? s : std::min(best, s);
  }
  return best;
}
}  // namespace

double measure_host_adamw_ns() {
  const int64_t n = int64_t{1} << 21;
  return host_adamw_step_s(n, 1) * 1e9 / static_cast<double>(n);
}

double measure_host_memory_bps() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cores = ::sched_getaffinity(0, sizeof set, &set) == 0
                        ? CPU_COUNT(&set)
                        : static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  const int64_t n = int64_t{1} << 24;
  try {
    const double s = host_adamw_step_s(n, std::max(1, cores));
    return s > 0 ? 34.0 * static_cast<double>(n) / s : 0;
  } catch (const std::exception&) {
    return 0;  // (288 MiB not to be had: unknown, as the plan says)
  }
}

int64_t parse_size(const std::string& text, const std::string& flag) {
  std::string t;
  for (char ch : text)
    if (!std::isspace(static_cast<unsigned char>(ch))) t += ch;
  const char* p = t.c_str();
  char* end = nullptr;
  errno = 0;
  const long double v = std::strtold(p, &end);
  const std::string unit(end ? end : "");
  static const std::vector<std::pair<std::string, long double>> units = {
      {"", 1},
      {"B", 1},
      {"KB", 1e3},
      {"MB", 1e6},
      {"GB", 1e9},
      {"TB", 1e12},
      {"KiB", 1024.0L},
      {"MiB", 1024.0L * 1024},
      {"GiB", 1024.0L * 1024 * 1024},
      {"TiB", 1024.0L * 1024 * 1024 * 1024},
      {"K", 1024.0L},
      {"M", 1024.0L * 1024},
      {"G", 1024.0L * 1024 * 1024},
      {"T", 1024.0L * 1024 * 1024 * 1024}};
  long double scale = -1;
  for (const auto& [u, f] : units)
    if (u == unit) scale = f;
  FT_CHECK(end != p && errno == 0 && scale > 0, flag, " ", text,
           ": not a size; write a number with a unit, e.g. 80GiB, 768GB, 512MiB (units: B, KB, "
           "MB, GB, TB, KiB, MiB, GiB, TiB; K, M, G, T are binary)");
  const long double bytes = v * scale;
  FT_CHECK(std::isfinite(static_cast<double>(bytes)) && bytes >= 1, flag, " ", text,
           ": a size must be positive");
  FT_CHECK(bytes < 9.2e18L, flag, " ", text, ": too large");
  return static_cast<int64_t>(bytes);
}

}  // namespace ft::plan
