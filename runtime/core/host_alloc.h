// The host allocator of a worker process: glibc malloc with one arena, and freed blocks kept.
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
// (docs/performance.md). Blocks under 32 MiB (glibc's own ceiling for that threshold) now always
// come from the heap, and up to 256 MiB of free heap top stays with the process. Peak resident
// memory, the planner's figure, does not grow from this: kept pages are reused, not added to.
#pragma once

namespace ft::core {

// Limits this process to one malloc arena unless MALLOC_ARENA_MAX is in the environment (glibc
// then applies the user's value itself). Call first thing in a worker, before it starts threads.
// Returns the limit in force ("1", the user's value, or "" where the C library is not glibc).
const char* limit_malloc_arenas();

// Sets glibc's mmap threshold to 32 MiB and its trim threshold to 256 MiB unless the user set
// either (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment). Returns whether ft
// set them.
bool keep_freed_heap();

// Both of the above: first thing in `ft train`, `ft eval` and the step benchmark.
void configure_host_malloc();

}  // namespace ft::core
