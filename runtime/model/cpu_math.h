// Bit-identical results from one process to the next on a CPU.
//
// LibTorch's CPU kernels for exp, log, cos, sin, tanh and a few other functions call MKL's vector
// math (VML). Each such function, the first time it runs in a process, picks its code path; when
// that first call comes from two OpenMP threads at once (ATen splits the tensor between them),
// one thread's part was seen to be computed on another path, a last bit apart: with 2 threads
// about 1 run in 13 got a different logsumexp in its first step, and so different weights in the
// end. A resumed run then differs from the uninterrupted one. Calling each function once on the
// calling thread before any parallel work settles the choice.
#pragma once

namespace ft::model {

// Runs every VML-backed unary function of ATen once, in fp32 and fp64, on this thread. Call it
// before the first forward of a process (TrainingRun and evaluate do). Idempotent and cheap
// (microseconds).
void prime_cpu_math();

}  // namespace ft::model
