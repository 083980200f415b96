// What the two bfloat16 linears over the AMX tile layout share (amx_gemm.cpp on AMX tiles,
// dot_gemm.cpp on avx512_bf16 dot products): their arguments' checks, and the rounding of a
// block of float32 sums (+ bias) into bfloat16 output rows (or float32 ones).
//
//   packed [NB, KB, 16, 32]: column block nb's pair p of inputs (2p, 2p + 1) at [nb][p / 16]
//   [p % 16], 16 columns x 2 (servelm/layers/amx_linear.py, pack_weight).
#pragma once

#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <cstdint>

#include "vec16.h"

namespace servelm_cpu {

// x [M, K] bfloat16 rows, packed holding an [N, K] weight, bias float32 [N] or none;
// returns the bias's data or nullptr. Errors name `op` and the argument.
inline const float* check_tile_linear(const char* op, const at::Tensor& x,
                                      const at::Tensor& packed,
                                      const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              op, ": x must be a bfloat16 CPU [M, K] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.is_contiguous() && packed.size(2) == 16 && packed.size(3) == 32,
              op, ": packed must be contiguous bfloat16 [NB, KB, 16, 32]");
  const int64_t K = x.size(1), NB = packed.size(0), KB = packed.size(1);
  TORCH_CHECK(N > 0 && (N + 15) / 16 == NB && (K + 31) / 32 == KB,
              op, ": packed [", NB, ", ", KB, ", 16, 32] does not hold a [", N, ", ", K,
              "] weight");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              op, ": bias must be float32 [N]");
  return bias->data_ptr<float>();
}

// c's rows (ldc float32 apart), columns 0..cols-1 (+ bias from column n0), rounded to
// bfloat16 (to nearest even) into y's rows (ldy apart) at column n0.
inline void write_rows(const float* c, int64_t ldc, int64_t rows, int64_t cols,
                       const float* bias, int64_t n0, c10::BFloat16* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = c + r * ldc;
    c10::BFloat16* yr = y + r * ldy + n0;
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
      f32x16 v = load16(cr + j);
      if (bias) v += load16(bias + n0 + j);
      store16(yr + j, v);
    }
    for (; j < cols; ++j) yr[j] = c10::BFloat16(cr[j] + (bias ? bias[n0 + j] : 0.0f));
  }
}

// The same rows kept float32 (dot_linear_float: a head's logits). With `stream`, whole
// 64-byte lines go straight to memory (non-temporal stores, no read of the line first; the
// caller fences): for an output too big to stay in cache, whose reads for ownership cost
// the GEMM memory time it needs for the weights.
inline void write_rows(const float* c, int64_t ldc, int64_t rows, int64_t cols,
                       const float* bias, int64_t n0, float* y, int64_t ldy,
                       bool stream = false) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = c + r * ldc;
    float* yr = y + r * ldy + n0;
    int64_t j = 0;
#if defined(__AVX512F__)
    if (stream && (reinterpret_cast<uintptr_t>(yr) & 63) == 0)
      for (; j + 16 <= cols; j += 16) {
        __m512 v = _mm512_loadu_ps(cr + j);
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + j));
        _mm512_stream_ps(yr + j, v);
      }
#endif
    for (; j < cols; ++j) yr[j] = cr[j] + (bias ? bias[n0 + j] : 0.0f);
  }
}

}  // namespace servelm_cpu
