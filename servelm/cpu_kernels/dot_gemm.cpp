// bfloat16 linears on avx512_bf16's dot products: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// float32 sums rounded once to bfloat16 (dot_linear_float: kept float32). The weight is the
// AMX tile GEMM's packed form (amx_gemm.cpp, servelm/layers/amx_linear.py): [NB, KB, 16, 32],
// where column block nb's pair p of inputs (2p, 2p + 1) is one 64-byte row of 16 columns x 2
// -- the order VDPBF16PS takes its second operand in, so a column block streams front to
// back.
//
// Why: at a decode step's shapes (M = 64, K = 576..1536) oneDNN's bfloat16 GEMM on two
// threads splits the rows between them and runs at ~71% of the dot products' peak, where one
// thread with all 64 rows reaches ~82% (measured on an AMD EPYC, Zen 5). Here the threads
// split the columns: each streams its own columns of the weight once and keeps every row.
//
// A block of output is up to 8 rows x 3 column blocks (48 columns): 24 float32 accumulators,
// three weight rows and one broadcast pair of x a step of K. x's rows are read where they
// lie (two elements at a time; an odd K's last element is paired with zero).
//
// Keep this file small: it is compiled on first use (servelm/cpu_kernels/__init__.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>

#include "tile_linear.h"
#include "vec16.h"

namespace {

using namespace servelm_cpu;

#if defined(__AVX512BF16__)
constexpr bool kHaveDot = true;
constexpr int kMaxRows = 8, kMaxBlocks = 3;
constexpr int64_t kStreamBytes = int64_t(4) << 20;

// Rows r0..r0+MR-1 of x by column blocks nb0..nb0+NV-1; sums into c [MR][NV * 16].
// KP: whole pairs of K; odd: K is odd (its last element pairs with zero).
template <int MR, int NV>
inline void block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t KB, int64_t KP,
                  bool odd, const char* pf, int64_t pf_lines, float* c) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint16_t* wv[NV];
  for (int v = 0; v < NV; ++v) wv[v] = w + v * KB * 512;
  for (int64_t p = 0; p < KP; ++p) {
    if (p < pf_lines) __builtin_prefetch(pf + 64 * p, 0, 3);
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(wv[v] + 32 * p);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  if (odd) {  // the last element of each row, paired with zero
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(wv[v] + 32 * KP);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(x[r * ldx + 2 * KP]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * kMaxBlocks * 16 + v * 16, acc[r][v]);
}

template <int NV>
void rows_block(int64_t mr, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t KB,
                int64_t KP, bool odd, const char* pf, int64_t pf_lines, float* c) {
  switch (mr) {
    case 8: return block<8, NV>(x, ldx, w, KB, KP, odd, pf, pf_lines, c);
    case 7: return block<7, NV>(x, ldx, w, KB, KP, odd, pf, pf_lines, c);
    case 6: return block<6, NV>(x, ldx, w, KB, KP, odd, pf, pf_lines, c);
    case 5: return block<5, NV>(x, ldx, w, KB, KP, odd, pf, pf_lines, c);
    case 4: return block<4, NV>(x, ldx, w, KB, KP, odd, pf, pf_lines, c);
    case 3: return block<3, NV>(x, ldx, w, KB, KP, odd, pf, pf_lines, c);
    case 2: return block<2, NV>(x, ldx, w, KB, KP, odd, pf, pf_lines, c);
    default: return block<1, NV>(x, ldx, w, KB, KP, odd, pf, pf_lines, c);
  }
}

// The gated form: silu(gate) * up from the gate's sums c and the up's sums u (+ their biases
// from columns n0 and I + n0), as silu_and_mul (layer_ops.cpp) computes it, rounded once.
inline void write_silu(const float* c, const float* u, int64_t rows, int64_t cols,
                       const float* bias, int64_t I, int64_t n0, c10::BFloat16* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *cr = c + r * kMaxBlocks * 16, *ur = u + r * kMaxBlocks * 16;
    c10::BFloat16* yr = y + r * ldy + n0;
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
      f32x16 g = load16(cr + j), v = load16(ur + j);
      if (bias) g += load16(bias + n0 + j), v += load16(bias + I + n0 + j);
      store16(yr + j, g / (1.0f + exp16(-g)) * v);
    }
    for (; j < cols; ++j) {
      const float g = cr[j] + (bias ? bias[n0 + j] : 0.0f);
      yr[j] = c10::BFloat16(g / (1.0f + std::exp(-g)) * (ur[j] + (bias ? bias[I + n0 + j] : 0.0f)));
    }
  }
}
#else
constexpr bool kHaveDot = false;
#endif

bool g_dot_usable = false;  // set once Python has seen vdpbf16ps run here (isa.py)

// The op's arguments checked (tile_linear.h), once vdpbf16ps is known to run here; returns
// the bias's data or nullptr.
const float* check(const char* op, const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(kHaveDot, op, ": servelm's kernels were built without avx512_bf16 here");
  TORCH_CHECK(g_dot_usable, op, ": avx512_bf16 was not seen to run on this machine "
              "(servelm/cpu_kernels/isa.py)");
  return check_tile_linear(op, x, packed, bias, N);
}

// y = x @ W[:C]^T, or with kSilu (W = [gate; up], C = N / 2 each) silu(x @ gate^T) * (x @ up^T);
// bfloat16 rows, or with kFloat the float32 sums themselves (a head's logits).
template <bool kSilu, bool kFloat = false>
void run(const at::Tensor& x, const at::Tensor& packed, const float* pbias, int64_t C,
         at::Tensor& y) {
#if defined(__AVX512BF16__)
  const int64_t M = x.size(0), K = x.size(1), KB = packed.size(1);
  const int64_t NB = (C + 15) / 16;  // column blocks of the output (of each half, gated)
  const uint16_t* xa = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* pw = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const uint16_t* pu = pw + NB * KB * 512;  // gated: the up half's blocks (C % 16 == 0)
  void* py = y.data_ptr();
  const int64_t ldx = x.stride(0), KP = K / 2;
  const bool odd = K % 2;
  const int64_t groups = (NB + kMaxBlocks - 1) / kMaxBlocks;  // of 3 column blocks
  // Work items: a group of columns over a part of the rows. The rows are split only where
  // the groups are too few to keep every thread busy (a narrow layer).
  const int64_t row_blocks = (M + kMaxRows - 1) / kMaxRows;
  const int64_t threads = at::get_num_threads();
  const int64_t parts = groups >= 2 * threads
                            ? 1
                            : std::min(row_blocks, (2 * threads + groups - 1) / groups);
  const int64_t part_rows = (row_blocks + parts - 1) / parts * kMaxRows;
  // A float32 output larger than both cores' L2 (a head's logits at a decode step: 64 rows x
  // 49,152 = 12 MiB) is streamed to memory: the default model's head at 64 rows took 4.49 ->
  // 4.18 ms, and a whole decode step's head and logit pass together 0.3 ms less (measured on
  // an AMD EPYC, Zen 5).
  const bool stream = kFloat && M * C * int64_t(sizeof(float)) >= kStreamBytes;
  at::parallel_for(0, groups * parts, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float c[kMaxRows * kMaxBlocks * 16], u[kSilu ? kMaxRows * kMaxBlocks * 16 : 1];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / parts, r0 = item % parts * part_rows;
      const int64_t r1 = std::min(M, r0 + part_rows);
      // The rounding up of part_rows can leave the last parts no rows (M = 65 in 4 parts of
      // 24 rows); an empty part's row-block count below would be 0 (a division by it).
      if (r0 >= r1) continue;
      const int64_t nb0 = g * kMaxBlocks, nv = std::min<int64_t>(kMaxBlocks, NB - nb0);
      const uint16_t *w = pw + nb0 * KB * 512, *wu = pu + nb0 * KB * 512;
      const int64_t n0 = nb0 * 16, cols = std::min<int64_t>(nv * 16, C - n0);
      // The next group's weights (contiguous), where this thread takes it next, are
      // prefetched a line a step of K, spread over this group's row blocks: the first touch
      // of each group's weights otherwise waits on memory (measured on an AMD EPYC, Zen 5:
      // the default model's 30 layers at 64 rows, weights in DRAM, 18.3 -> 14.6 ms).
      const bool ahead = parts == 1 && item + 1 < i1;
      const char* next = ahead ? reinterpret_cast<const char*>(w + nv * KB * 512) : nullptr;
      const char* next_up = ahead ? reinterpret_cast<const char*>(wu + nv * KB * 512) : nullptr;
      const int64_t lines = ahead ? std::min<int64_t>(kMaxBlocks, NB - nb0 - nv) * KB * 16 : 0;
      const int64_t blocks = (r1 - r0 + kMaxRows - 1) / kMaxRows;
      const int64_t per = (lines + blocks - 1) / blocks;
      for (int64_t m0 = r0, i = 0; m0 < r1; m0 += kMaxRows, ++i) {
        const int64_t mr = std::min<int64_t>(kMaxRows, r1 - m0);
        const uint16_t* xr = xa + m0 * ldx;
        const int64_t pl = std::max<int64_t>(0, std::min<int64_t>(per, lines - i * per));
        const char* pf = pl ? next + 64 * i * per : nullptr;
        const auto sums = [&](const uint16_t* wv, const char* f, float* out) {
          if (nv == 3) rows_block<3>(mr, xr, ldx, wv, KB, KP, odd, f, pl, out);
          else if (nv == 2) rows_block<2>(mr, xr, ldx, wv, KB, KP, odd, f, pl, out);
          else rows_block<1>(mr, xr, ldx, wv, KB, KP, odd, f, pl, out);
        };
        sums(w, pf, c);
        if constexpr (kSilu) {
          sums(wu, pl ? next_up + 64 * i * per : nullptr, u);
          write_silu(c, u, mr, cols, pbias, C, n0, static_cast<c10::BFloat16*>(py) + m0 * C, C);
        } else if constexpr (kFloat) {
          write_rows(c, kMaxBlocks * 16, mr, cols, pbias, n0, static_cast<float*>(py) + m0 * C,
                     C, stream);
        } else {
          write_rows(c, kMaxBlocks * 16, mr, cols, pbias, n0,
                     static_cast<c10::BFloat16*>(py) + m0 * C, C);
        }
      }
    }
    if (stream) _mm_sfence();  // the streamed rows visible before the op returns
  });
#endif
}

at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t N) {
  const float* pbias = check("dot_linear", x, packed, bias, N);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) > 0) run<false>(x, packed, pbias, N, y);
  return y;
}

// dot_linear with the float32 sums (+ bias) as the output, not rounded: a bfloat16 head's
// logits, whose rounding to 8 significant bits made ties at the maximum that the runner
// recomputed (servelm/runner/logits.py).
at::Tensor dot_linear_float(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias, int64_t N) {
  const float* pbias = check("dot_linear_float", x, packed, bias, N);
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  if (x.size(0) > 0) run<false, true>(x, packed, pbias, N, y);
  return y;
}

// silu_and_mul(dot_linear(x, ...)) in one pass, without rounding the gate and up to bfloat16
// first: packed holds [gate; up] (N = 2 I rows, I a multiple of 16); y is [M, I]. Saves
// writing and reading back the [M, 2 I] product (a 2048-row prefill chunk's silu_and_mul was
// ~1 ms a layer of the default model on an AMD EPYC, Zen 5).
at::Tensor dot_linear_silu(const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias, int64_t N) {
  const float* pbias = check("dot_linear_silu", x, packed, bias, N);
  TORCH_CHECK(N % 32 == 0, "dot_linear_silu: n must be 2 I with I a multiple of 16, got ", N);
  at::Tensor y = at::empty({x.size(0), N / 2}, x.options());
  if (x.size(0) > 0) run<true>(x, packed, pbias, N / 2, y);
  return y;
}

bool dot_linear_built() { return kHaveDot; }
void dot_linear_use(bool use) { g_dot_usable = use && kHaveDot; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("dot_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &dot_linear);
  m.def("dot_linear_silu(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor",
        &dot_linear_silu);
  m.def("dot_linear_float(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor",
        &dot_linear_float);
  m.def("dot_linear_built() -> bool", &dot_linear_built);
  m.def("dot_linear_use(bool use) -> ()", &dot_linear_use);
}
