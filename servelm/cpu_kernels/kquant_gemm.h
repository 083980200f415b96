// The K-quant kernel's entry for other C++ code (decode_stack.cpp): activation rows rounded
// to q8_K once, then any number of K-quant matrices multiplied with them (kquant_gemm.cpp).
//
// Why a header: the op kquant_gemm rounds its x on every call, and a fused layer whose row
// parts are separate K-quant matrices (q/k/v in two types) would round the same rows once
// per part; the stack rounds them once and calls `gemm` per part, each into its columns.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace servelm_kquant {

// Activation rows rounded to q8_K: codes (row stride K), d and bsum16 (row stride K / 256
// and K / 16).
struct RowsQ8K {
  const int8_t* q;
  const float* d;
  const int16_t* bsum;
  int64_t K;
};

// x [M, K] rounded to q8_K; the tensors own the rows `rows()` points into.
struct QuantizedRows {
  at::Tensor q, d, bsum;
  RowsQ8K rows() const;
};

// x: a contiguous [M, K] float32 or bfloat16 CPU tensor, K % 256 == 0.
QuantizedRows quantize_rows(const at::Tensor& x);

// y[m * ldy + n] = x_m . w_n for the N rows of `type` super-blocks in codes (checked).
void gemm(const QuantizedRows& x, const at::Tensor& codes, int64_t type, int64_t N, float* y,
          int64_t ldy);

// The float weight [N, K] (float32 or bfloat16) the codes stand for.
at::Tensor dequant(const at::Tensor& codes, int64_t type, int64_t N, at::ScalarType dtype);

}  // namespace servelm_kquant
