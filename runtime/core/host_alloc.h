// The host allocator of a worker process: glibc malloc with one arena.
//
// glibc gives each thread that meets a locked arena an arena of its own, up to 8 per core, and
// every arena keeps the blocks freed into it for reuse. A training rank allocates from its main
// thread, LibTorch's OpenMP threads, Gloo's threads and the checkpoint writer; with an arena each,
// freed tensors of one step stay resident beside those of the next. Measured on the CPU matrix of
// bench/plan_accuracy.py (fsdp FULL_SHARD with activation checkpointing, 4 ranks): peak resident
// memory 722-751 MiB per rank with glibc's default, 632-675 MiB with one arena, at no measurable
// cost in step time (the step allocates from its main thread). ft plan's prediction assumes it.
#pragma once

namespace ft::core {

// Limits this process to one malloc arena unless MALLOC_ARENA_MAX is in the environment (glibc
// then applies the user's value itself). Call first thing in a worker, before it starts threads.
// Returns the limit in force ("1", the user's value, or "" where the C library is not glibc).
const char* limit_malloc_arenas();

}  // namespace ft::core
