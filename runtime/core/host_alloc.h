// The host allocator of a worker process: LibTorch's blocks of 1 MiB and more from the step pool
// (below), everything else from glibc malloc with one arena and freed blocks kept.
//
// Arenas. glibc gives each thread that meets a locked arena an arena of its own, up to 8 per core,
// and every arena keeps the blocks freed into it for reuse. A training rank allocates from its main
// thread, LibTorch's OpenMP threads, Gloo's threads and the checkpoint writer; with an arena each,
// freed tensors of one step stay resident beside those of the next. Measured on the CPU matrix of
// bench/plan_accuracy.py (fsdp FULL_SHARD with activation checkpointing, 4 ranks): peak resident
// memory 722-751 MiB per rank with glibc's default, 632-675 MiB with one arena, at no measurable
// cost in step time (the step allocates from its main thread). ft plan's prediction assumes it.
//
// Freed blocks. By default glibc hands the top of its heap back to the kernel once more than twice
// its (self-adjusting) mmap threshold is free there, a few MiB for a small model: every step then
// frees its activations and gradients, shrinks the heap, and faults the same pages in again (zeroed
// by the kernel) on the next step's first writes. On the overhead-bound model of
// bench/train_step.sh that was 8% of the main thread's time in the kernel and 9% of the step
// (docs/performance-log.md). Blocks under 32 MiB (glibc's own ceiling for that threshold) now always
// come from the heap, and up to 256 MiB of free heap top stays with the process. (Since the step
// pool, LibTorch's blocks of 1 MiB and more no longer reach glibc; these settings serve the rest.)
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <memory>

namespace ft::core {

// Limits this process to one malloc arena unless MALLOC_ARENA_MAX is in the environment (glibc
// then applies the user's value itself). Call first thing in a worker, before it starts threads.
// Returns the limit in force ("1", the user's value, or "" where the C library is not glibc).
const char* limit_malloc_arenas();

// Sets glibc's mmap threshold to 32 MiB and its trim threshold to 256 MiB unless the user set
// either (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment). Returns whether ft
// set them.
bool keep_freed_heap();

// LibTorch's CPU allocator in a worker: the step pool. Blocks of kStepPoolMinBytes and more are
// mapped one by one (page-rounded). One allocated while the pool is keeping (inside a training
// step: set_step_pool_keeping) stays mapped when freed, whenever and by whichever thread, for the
// next request of the same size; one allocated outside a step (loading, a checkpoint's snapshot)
// is unmapped when freed. An evaluation keeps blocks for the batches of one shape (evaluate.cpp).
// Smaller requests go to glibc as before.
//
// Why. With glibc's heap (above), a sharded CPU job's per-step blocks of 1-32 MiB (activations,
// gathered units, Gloo's flat copies) were carved from one heap in an order the threads' timing
// decided; the holes left grew the heap by 100-165 MiB a rank, differently each run, and still
// growing at step 8 (docs/performance-log.md). Blocks kept by size are found again whatever the order:
// a rank's resident set is its blocks' high-water mark per size, the same every run, and no page
// is faulted in twice. release_step_pool() unmaps the idle blocks (before an evaluation, a
// checkpoint's snapshot, the final save).
constexpr size_t kStepPoolMinBytes = size_t{1} << 20;
void install_step_pool();
void set_step_pool_keeping(bool on);
void release_step_pool();
struct StepPoolStats {
  size_t live_bytes = 0, idle_bytes = 0;  // the pool's blocks in use / kept
  size_t peak_bytes = 0;                  // of live + idle, since reset_step_pool_peak()
  size_t mapped = 0, reused = 0;          // requests served by a new mapping / a kept block
};
StepPoolStats step_pool_stats();
void reset_step_pool_peak();  // peak_bytes from now on
// Keeping for its lifetime: around a training step (TrainingRun::step, the step benchmark).
struct StepPoolScope {
  StepPoolScope() { set_step_pool_keeping(true); }
  ~StepPoolScope() { set_step_pool_keeping(false); }
  StepPoolScope(const StepPoolScope&) = delete;
  StepPoolScope& operator=(const StepPoolScope&) = delete;
};

// All of the above: first thing in `ft train`, `ft eval` and the step benchmark.
void configure_host_malloc();

// Keeps the host blocks of a few large per-step tensors between uses. Blocks above glibc's mmap
// threshold (32 MiB, above) are mapped by the kernel on every allocation, zero-filled page by page
// on first write and unmapped on free: the LM head's fp32 logits chunk and its weight's gradient
// (128 MiB each at a 32k vocabulary and 1024 tokens) were 64k page faults and 110 ms of CPU time in
// every step of bench/train_step.sh's GEMM-bound model. A tensor from empty() of at least
// `min_bytes` returns its block here when the last reference goes (from any thread); the next
// empty() of the same byte size takes it back, unzeroed (the caller writes every element). Smaller
// requests are plain at::empty: glibc's heap recycles those blocks for the backward's own
// temporaries, which a kept block would not be, so keeping them would raise the step's peak. A
// request of another size first frees every kept block, so the process never holds an idle block
// beside a new one; at most `max_blocks` are kept. release() frees them now (before a checkpoint's
// snapshot or an evaluation: the planner's peak counts these blocks inside the step only). Tensors
// outlive the cache safely.
class HostBlockCache {
 public:
  explicit HostBlockCache(size_t max_blocks = 4, size_t min_bytes = size_t{32} << 20);
  ~HostBlockCache();
  HostBlockCache(const HostBlockCache&) = delete;
  HostBlockCache& operator=(const HostBlockCache&) = delete;

  // A contiguous CPU tensor of `sizes` and `dtype`, its contents undefined.
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
  void release();
  size_t kept_blocks() const;
  size_t kept_bytes() const;
  // Allocations served from a kept block / from the C library, since construction.
  size_t reused() const;
  size_t allocated() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
  size_t min_bytes_;
};

}  // namespace ft::core
