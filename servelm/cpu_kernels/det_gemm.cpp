// Batch-invariant float32 linear for deterministic mode (servelm/layers/det_linear.py).
//
// oneDNN and MKL choose their blocking, their K split and their microkernel by M (the
// number of rows), so one token's output row moves in the last bits with the batch it lands
// in. Here every output element is one fused multiply-add chain over k = 0 .. K-1, in that
// order, starting from 0, then + bias: the same operations whatever M is, wherever the row
// sits in the batch and however many threads run. Tiles and blocks below only decide which
// elements are computed together and when, never the order of one element's sum:
//
//   w [N, K] packed once into panels of kNR columns:  packed[p][k][0..kNR-1] = w[kNR p + j][k]
//   (zero rows pad the last panel)
//
//   for each chunk of kMC rows:                       x rows stay in L2
//     parallel over (panel, 24-row group) items:      a panel's K rows (kNR floats) stream
//       for each block of kKC k:                      the panel's block stays in L1
//         for each tile of up to 6 rows:              6 x kNR accumulators in registers,
//           for k in the block:                       spilled between blocks (exactly)
//             acc[m][j] = fma(x[m][k], packed[p][k][j], acc[m][j])
//       y = acc + bias
//
// A spill stores the float32 accumulator and the next block reloads it: exactly the value
// a register would have held, so K blocking costs nothing in invariance.
//
// Two bodies of the same sums (the same bits: one chain of fused multiply-adds per element):
//   AVX-512: panels of 64 columns, a tile is 6 x 4 zmm accumulators (fma16, vec16.h);
//   AVX2:    panels of 16 columns, a tile is 6 x 2 ymm accumulators, each a named variable:
//            GCC kept an array of them on the stack and stored all 12 after every k (the
//            16-lane form splits into 48 ymm accumulators and spills likewise), a third of
//            the FMA rate; as named variables they stay in 12 of the 16 ymm registers.
// Measured on an AVX2-only EPYC on the model's shapes (benchmarks/cpu/linear_rates_micro.py):
// 1.1-2x oneDNN's packed GEMM up to 64 rows, 0.8-1.0x at 256; the default float32 linears
// still take oneDNN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/constant_pad_nd.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "vec16.h"

namespace {

using namespace servelm_cpu;
#if defined(SERVELM_VEC16_HALVES)
constexpr int64_t kNR = 16;   // columns per panel: two 8-lane vectors
constexpr int64_t kKC = 256;  // k per block: a block of a panel (16 KiB) stays in L1
#else
constexpr int64_t kNR = 64;   // columns per panel: four 16-lane vectors
constexpr int64_t kKC = 96;   // k per block: a block of a panel (24 KiB) stays in L1
#endif
constexpr int kMR = 6;        // rows per register tile
constexpr int64_t kMG = 24;   // rows per work item (4 tiles share the panel from L1/L2)
constexpr int64_t kMC = 192;  // rows per chunk: the chunk's x rows stay in L2

std::atomic<int64_t> calls{0};  // det_linear calls since load (tests check it ran)

// y[m][0..kNR-1] (+)= sum over k in [k0, k1) of x[m][k] * panel[k][0..kNR-1], rows m < MR.
// first: start from 0, else continue from what acc holds.
#if defined(SERVELM_VEC16_HALVES)
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                 float* acc, bool first) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define SERVELM_DET_LOAD(m)                                                                 \
  if constexpr (MR > m) {                                                                   \
    c##m##0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + m * kNR);                 \
    c##m##1 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + m * kNR + 8);             \
  }
#define SERVELM_DET_FMA(m)                                                                  \
  if constexpr (MR > m) {                                                                   \
    const __m256 a = _mm256_broadcast_ss(xk + m * ldx);                                     \
    c##m##0 = _mm256_fmadd_ps(a, w0, c##m##0);                                              \
    c##m##1 = _mm256_fmadd_ps(a, w1, c##m##1);                                              \
  }
#define SERVELM_DET_STORE(m)                                                                \
  if constexpr (MR > m) {                                                                   \
    _mm256_storeu_ps(acc + m * kNR, c##m##0);                                               \
    _mm256_storeu_ps(acc + m * kNR + 8, c##m##1);                                           \
  }
  SERVELM_DET_LOAD(0) SERVELM_DET_LOAD(1) SERVELM_DET_LOAD(2)
  SERVELM_DET_LOAD(3) SERVELM_DET_LOAD(4) SERVELM_DET_LOAD(5)
  const float* w = panel + k0 * kNR;
  const float* xk = x + k0;
  for (int64_t k = k0; k < k1; ++k, w += kNR, ++xk) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    SERVELM_DET_FMA(0) SERVELM_DET_FMA(1) SERVELM_DET_FMA(2)
    SERVELM_DET_FMA(3) SERVELM_DET_FMA(4) SERVELM_DET_FMA(5)
  }
  SERVELM_DET_STORE(0) SERVELM_DET_STORE(1) SERVELM_DET_STORE(2)
  SERVELM_DET_STORE(3) SERVELM_DET_STORE(4) SERVELM_DET_STORE(5)
#undef SERVELM_DET_LOAD
#undef SERVELM_DET_FMA
#undef SERVELM_DET_STORE
}
#else
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                 float* acc, bool first) {
  f32x16 c[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) c[m][j] = first ? f32x16{} : load16(acc + m * kNR + 16 * j);
  const float* w = panel + k0 * kNR;
  for (int64_t k = k0; k < k1; ++k, w += kNR) {
    const f32x16 w0 = load16(w), w1 = load16(w + 16), w2 = load16(w + 32), w3 = load16(w + 48);
    for (int m = 0; m < MR; ++m) {
      const f32x16 a = broadcast16(x + m * ldx + k);
      c[m][0] = fma16(a, w0, c[m][0]);
      c[m][1] = fma16(a, w1, c[m][1]);
      c[m][2] = fma16(a, w2, c[m][2]);
      c[m][3] = fma16(a, w3, c[m][3]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) store16(acc + m * kNR + 16 * j, c[m][j]);
}
#endif

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, bool);
constexpr TileFn kTiles[kMR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Rows [m0, m1) (at most kMG) of x against panel p -> y columns [kNR p, min(kNR (p + 1), N)).
// k blocks outside, tiles inside: a block of the panel is read from L1 by every tile.
void panel_rows(const float* x, int64_t K, const float* packed, const float* bias, int64_t N,
                int64_t p, int64_t m0, int64_t m1, float* y) {
  const float* panel = packed + p * K * kNR;
  const int64_t n0 = p * kNR, width = std::min(kNR, N - n0);
  alignas(64) float acc[kMG * kNR];
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t k1 = std::min(K, k0 + kKC);
    for (int64_t m = m0; m < m1; m += kMR) {
      const int mr = int(std::min<int64_t>(kMR, m1 - m));
      kTiles[mr](x + m * K, K, panel, k0, k1, acc + (m - m0) * kNR, k0 == 0);
    }
  }
  for (int64_t m = m0; m < m1; ++m) {
    float* out = y + m * N + n0;
    const float* a = acc + (m - m0) * kNR;
    if (bias != nullptr)
      for (int64_t j = 0; j < width; ++j) out[j] = a[j] + bias[n0 + j];
    else
      std::copy(a, a + width, out);
  }
}

// w [N, K] float32 -> panels [ceil(N / kNR), K, kNR], zero-padded.
at::Tensor det_pack(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "det_pack: w must be a float32 CPU [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kNR - 1) / kNR;
  return at::constant_pad_nd(w, {0, 0, 0, P * kNR - N})
      .view({P, kNR, K})
      .transpose(1, 2)
      .contiguous();
}

// x [..., K] float32, packed from det_pack, bias [N] or None -> [..., N].
at::Tensor det_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "det_linear: x must be a float32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == kNR && packed.size(0) == (N + kNR - 1) / kNR,
              "det_linear: packed must come from det_pack for N = ", N);
  const int64_t K = packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "det_linear: x has ", x.size(-1), " features, the weight ", K);
  const float* pb = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "det_linear: bias must be float32 [N]");
    pb = bias->data_ptr<float>();
  }
  calls.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const float* px = xc.data_ptr<float>();
  const float* pw = packed.data_ptr<float>();
  float* py = y.data_ptr<float>();
  const int64_t P = packed.size(0);
  for (int64_t c0 = 0; c0 < M; c0 += kMC) {
    const int64_t c1 = std::min(M, c0 + kMC), groups = (c1 - c0 + kMG - 1) / kMG;
    at::parallel_for(0, P * groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t p = i / groups, m0 = c0 + (i % groups) * kMG;
        panel_rows(px, K, pw, pb, N, p, m0, std::min(c1, m0 + kMG), py);
      }
    });
  }
  return y;
}

int64_t det_linear_calls() { return calls.load(std::memory_order_relaxed); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("det_pack(Tensor w) -> Tensor", &det_pack);
  m.def("det_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &det_linear);
  m.def("det_linear_calls() -> int", &det_linear_calls);
}
