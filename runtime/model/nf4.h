// NF4, the 4-bit NormalFloat data type of QLoRA, exactly as bitsandbytes stores it (issue 33):
// a weight flattened in C order, cut into blocks of `blocksize` values (64 by default; the last
// block may be shorter), each block scaled by its absolute maximum (fp32) and every value replaced
// by the index of its nearest NF4 code (16 values in [-1, 1]), two indices per byte, the first
// element in the high nibble. With double quantization the absmax values, less their mean (the
// offset), are themselves quantized to 8 bits in blocks of 256 with bitsandbytes' signed dynamic
// map. Quantizing gives the bytes bitsandbytes' CPU backend gives (quantize_4bit, and its 8-bit
// blockwise quantizer for the absmax), dequantizing its values (dequantize_4bit):
// tests/model/nf4_test.cpp against tests/model/fixtures/nf4 (make_nf4_fixtures.py). Pure
// functions over host tensors; thread-safe.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <vector>

namespace ft::model {

// The 16 NF4 codes, ascending (bitsandbytes' get_4bit_type("nf4")).
const std::array<float, 16>& nf4_code();

// bitsandbytes' signed 8-bit dynamic map (create_dynamic_map()): 256 fp32 values, ascending, in
// [-0.99297, 1], which double quantization uses for the absmax values.
at::Tensor dynamic_map();

// A weight in NF4.
struct Nf4Weight {
  std::vector<int64_t> shape;
  int64_t blocksize = 64;
  at::Tensor packed;  // uint8 [ceil(numel / 2)]
  // Without double quantization: fp32 [blocks]. With it: uint8 [blocks], the indices into
  // nested_code of (absmax - offset) / nested_absmax[block / 256].
  at::Tensor absmax;
  at::Tensor nested_absmax;  // fp32 [ceil(blocks / 256)] (double quantization only)
  at::Tensor nested_code;    // fp32 [256] (double quantization only)
  float offset = 0;          // the mean of the absmax values (double quantization only)
  bool double_quant() const { return nested_absmax.defined(); }
  int64_t numel() const;
};

// Where the parts of an NF4 weight [rows, cols] lie in one flat byte buffer, its "blob": the form
// a model holds a quantized projection in (model/quantized_linear.h), so that a strategy keeps,
// shards and gathers it as a frozen parameter of any element size (the blob viewed as the model's
// dtype). The packed codes come first, zero-padded to a multiple of 4 bytes, then each block's
// fp32 absmax (with double quantization already dequantized: the values bitsandbytes multiplies
// the codes by), so the bytes are a multiple of 4.
struct Nf4Shape {
  int64_t rows = 0, cols = 0, blocksize = 64;
  bool defined() const { return rows > 0; }
  int64_t numel() const { return rows * cols; }
  int64_t blocks() const { return (numel() + blocksize - 1) / blocksize; }
  int64_t packed_bytes() const { return (numel() + 1) / 2; }
  int64_t absmax_offset() const { return (packed_bytes() + 3) / 4 * 4; }
  int64_t bytes() const { return absmax_offset() + 4 * blocks(); }
  // The blob's length in elements of `dtype` (1, 2 or 4 bytes).
  int64_t elements(at::ScalarType dtype) const;
};

// Quantizes `w` (fp32, bf16 or fp16, any shape, on the host) to NF4.
Nf4Weight quantize_nf4(const at::Tensor& w, bool double_quant, int64_t blocksize = 64);

// The blocks' fp32 absmax values (with double quantization: dequantized and the offset added).
at::Tensor nf4_absmax(const Nf4Weight& q);

// The weight in `dtype` (fp32, bf16 or fp16) with q's shape: each code times its block's absmax
// in fp32, rounded once to dtype.
at::Tensor dequantize_nf4(const Nf4Weight& q, at::ScalarType dtype);

// A 2-D weight's blob (Nf4Shape): uint8 [bytes()] on the host.
at::Tensor nf4_blob(const Nf4Weight& q);
Nf4Shape nf4_shape(const Nf4Weight& q);

// bitsandbytes' 8-bit blockwise quantization of fp32 `x` with `code` (256 ascending values in
// [-1, 1]): per block of `blocksize` its absmax, and each value's code index through a table of
// 65,536 cells over [-1, 1] (the CPU backend's lookup, which picks the nearest code but for values
// within a cell of a midpoint). Returns {uint8 indices, fp32 absmax}.
std::pair<at::Tensor, at::Tensor> quantize_blockwise_8bit(const at::Tensor& x,
                                                          const at::Tensor& code,
                                                          int64_t blocksize);

}  // namespace ft::model
