// The host's arithmetic over gradients in host memory (parallel/engine.cpp's host additions, the
// trainer's clip norm). Adding a gradient into an offloaded fp32 accumulator on the host: dst +=
// src for a contiguous fp32 `dst` and a contiguous fp32, bf16 or fp16 `src` of as many elements,
// over ATen's threads. The bits of dst.add_(src): each element is one IEEE fp32 add of the widened
// value (widening bf16 / fp16 is exact). Why: ATen's add_ of a bf16 tensor into an fp32 one goes
// through its dtype-casting loop, 3.1 ns per element on 2 threads here against 0.50 for fp32 + fp32
// (docs/performance-log.md, issue 32): 6 times the memory's speed, in the pass every offloaded gradient
// takes. Other dtypes (fp64 masters) fall back to add_.
#pragma once

#include <ATen/ATen.h>

namespace ft::parallel {

void add_into_host(const at::Tensor& dst, const at::Tensor& src);

// The squared L2 norm of a contiguous fp32 or fp64 host tensor (the gradient clip's norm): squares
// summed in fp64, in 16 lanes per block of 32,768 elements and the blocks in order, so the same
// bits for any thread count, on any thread (the engine's host thread takes an offloaded gradient's
// as soon as it is final). One pass at the memory's speed: ATen's fp32 vector norm took 0.31 ms
// of a 6 ms step of bench/train_step.sh's overhead-bound model for 1.8 M gradients.
double host_sq_norm(const at::Tensor& t);

}  // namespace ft::parallel
