// What this machine has, for the plan's checks: host memory (MemAvailable and the cgroup's limit),
// each visible GPU's free memory (NVML, opened at run time; no CUDA context is created), free disk
// where the run writes, the model files' read throughput and the random init's draw rate, and the
// resident memory of an ft process before it allocates. Reads /proc, /sys and the files; each
// figure says where it came from. Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/plan.h"

namespace ft::plan {

struct Machine {
  int64_t host_available = 0;  // bytes; 0 unknown
  std::string host_from;
  int gpus = 0;          // visible GPUs NVML reports
  int64_t gpu_free = 0;  // the smallest free memory among them; 0 unknown
  std::string gpu_from;
  int64_t disk_free = 0;
  std::string disk_from;
  int64_t process_bytes = 0;  // this process's resident memory now
};

// Host memory, GPUs and this process's resident memory; `output_dir`'s filesystem (its nearest
// existing parent) when not empty.
Machine probe_machine(const std::string& output_dir);

// The read throughput of the model directory's largest safetensors file, measured on up to 64 MiB
// of it with the page cache dropped for that range first; 0 when it cannot be measured.
double measure_read_throughput(const std::string& model_dir, std::string* from);

// How each pair of this machine's visible GPUs is connected, through NVML (no CUDA context): the
// path as `nvidia-smi topo -m` names it, and whether peer-to-peer reads work. `ft doctor` shows it.
struct GpuLinks {
  int gpus = 0;
  // gpus x gpus, row-major: "X" (itself), "NVLink", "PIX" (one PCIe switch), "PXB" (several),
  // "PHB" (the host bridge), "NODE" (host bridges of one NUMA node), "SYS" (across the CPU
  // interconnect), "?" (NVML could not say).
  std::vector<std::string> path;
  std::vector<bool> p2p_read;  // peer-to-peer reads possible (NVML's P2P status)
  std::string from;            // "NVML" or why there is nothing
};
GpuLinks probe_gpu_links();

// Random-init values drawn per second on one thread (about 20 ms of drawing).
double measure_init_rate();
// ns per parameter of ft's host AdamW step (train/optimizer.h: clip factor, zeroing and a bf16
// copy-out in its pass) on one thread, over 2^21 fp32 parameters (about 20 ms).
double measure_host_adamw_ns();
// Bytes per second through this machine's memory in the host step's pattern: the same AdamW pass
// (34 B per parameter read and written) on every core this process may run on, over 2^24
// parameters (288 MiB, past the last-level cache of most hosts; about 0.3 s with the first touch).
// What the ranks of a node share when their host steps run at once. 0 when the memory for it
// cannot be had.
double measure_host_memory_bps();

// "80GiB", "768 GB", "1.5TiB", "512MiB", "1e9": bytes. ConfigError naming `flag` for anything
// else (unknown units, negative or zero sizes, overflow).
int64_t parse_size(const std::string& text, const std::string& flag);

}  // namespace ft::plan
