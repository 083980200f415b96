// bfloat16 linears on AMX tiles: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 sums
// rounded once to bfloat16.
//
// Why: oneDNN's bfloat16 GEMM (PackedLinear) runs on the same tiles but, at a decode step's
// shapes (M <= 64, K = 576..1536), spends most of its time outside them: measured on an AMX
// Xeon (2 threads) about 14 us a call of set-up and 11-15 GB/s of weights read, where the
// tiles themselves need ~6 us for a 64 x 576 x 960 product and a plain read of the weights
// runs at ~25 GB/s. Here the weight is laid out once, at load, in the order the tiles take it,
// and a call streams it front to back.
//
//   packed [NB, KB, 16, 32]: tile (nb, kb) holds, for pair p = 0..15 and column n = 0..15,
//   W[nb*16 + n][kb*32 + 2p + j] at [p][2n + j] (TDPBF16PS's "VNNI" order for B; zero
//   padding past N and K). servelm/layers/amx_linear.py writes it.
//
// Tiles (palette 1): C 0..3 (16 x 16 float32), A 4..5 (16 rows x 32 bf16 of x), B 6..7. A
// block of output is 32 rows x 32 columns (fewer at the edges); threads split the column
// pairs, each keeping its pair's weight tiles in cache while it walks the rows. x's rows past
// M (to a multiple of 16) come from a zeroed copy of the last partial block of rows.
// Each thread configures its tiles on entry and releases them on exit. The caller has asked
// the kernel for the tile state (servelm/cpu_kernels/isa.py: request_amx) and seen the probe
// run AMX here: this file only builds where the compiler targets AMX (-march=native).
//
// Keep this file small: it is compiled on first use (servelm/cpu_kernels/__init__.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tile_linear.h"
#include "vec16.h"

namespace {

using namespace servelm_cpu;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
constexpr bool kHaveAmx = true;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One output block: 16 or 32 rows (two_m) by 16 or 32 columns (two_n). a0 / a1: the x rows
// of its two row tiles (lda elements between rows); b0 / b1: its column blocks' weight
// tiles; c: [32 rows][32 columns] float32. Four accumulators, and no tile register reused
// within a k-step (tiles are not renamed: a reload waits for every reader; a 4 x 1 block
// that reused one A tile measured 13% slower at 64 rows). No software prefetch: the weights
// stream in address order, and prefetching the next pair during the last pass over the
// rows measured slower (the hardware's streams already run ahead).
template <bool two_m, bool two_n>
inline void block(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* b0,
                  const uint16_t* b1, int64_t KB, float* c) {
  _tile_zero(0);
  if (two_n) _tile_zero(1);
  if (two_m) _tile_zero(2);
  if (two_m && two_n) _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(4, a0 + kb * 32, lda * 2);
    _tile_loadd(6, b0 + kb * 512, 64);
    if (two_n) _tile_loadd(7, b1 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_n) _tile_dpbf16ps(1, 4, 7);
    if (two_m) {
      _tile_loadd(5, a1 + kb * 32, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (two_n) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  if (two_n) _tile_stored(1, c + 16, 128);
  if (two_m) _tile_stored(2, c + 16 * 32, 128);
  if (two_m && two_n) _tile_stored(3, c + 16 * 32 + 16, 128);
}

#else
constexpr bool kHaveAmx = false;
#endif

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(kHaveAmx, "amx_linear: servelm's kernels were built without AMX on this machine");
  const float* pbias = check_tile_linear("amx_linear", x, packed, bias, N);
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KB = packed.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
  // x as the tiles read it: its own rows where K is whole 32s, the last partial block of 16
  // rows from a zeroed copy (a copy of all of x where K is not).
  const int64_t MB = (M + 15) / 16;  // row tiles of 16
  at::Tensor xs = x;
  int64_t lda = x.stride(0), full = M / 16;  // full: row tiles read from xs
  if (K % 32 != 0) {
    xs = at::zeros({MB * 16, KB * 32}, x.options());
    xs.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
    lda = KB * 32, full = MB;
  }
  at::Tensor tail;
  if (full * 16 < M) {
    tail = at::zeros({16, lda}, x.options());
    tail.narrow(0, 0, M - full * 16).narrow(1, 0, xs.size(1))
        .copy_(xs.narrow(0, full * 16, M - full * 16));
  }
  const uint16_t* xa = reinterpret_cast<const uint16_t*>(xs.data_ptr());
  const uint16_t* xt = tail.defined() ? reinterpret_cast<const uint16_t*>(tail.data_ptr()) : nullptr;
  const uint16_t* pw = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  c10::BFloat16* py = y.data_ptr<c10::BFloat16>();
  const int64_t NP = (NB + 1) / 2;  // column pairs (32 columns)
  auto rows_of = [&](int64_t mb) { return mb < full ? xa + mb * 16 * lda : xt; };
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), NP)));
#pragma omp parallel num_threads(threads)
  {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    alignas(64) float c[32 * 32];
#pragma omp for schedule(static)
    for (int64_t np = 0; np < NP; ++np) {
      const int64_t nb0 = 2 * np;
      const bool two_n = nb0 + 1 < NB;
      const uint16_t* b0 = pw + nb0 * KB * 512;
      const uint16_t* b1 = b0 + KB * 512;
      const int64_t n0 = nb0 * 16, cols = std::min<int64_t>(two_n ? 32 : 16, N - n0);
      for (int64_t mb = 0; mb < MB; mb += 2) {
        const bool two_m = mb + 1 < MB;
        const uint16_t* a0 = rows_of(mb);  // (the tail copy keeps x's row stride)
        const uint16_t* a1 = two_m ? rows_of(mb + 1) : nullptr;
        if (two_m && two_n) block<true, true>(a0, a1, lda, b0, b1, KB, c);
        else if (two_m) block<true, false>(a0, a1, lda, b0, b1, KB, c);
        else if (two_n) block<false, true>(a0, a1, lda, b0, b1, KB, c);
        else block<false, false>(a0, a1, lda, b0, b1, KB, c);
        const int64_t rows = std::min<int64_t>(two_m ? 32 : 16, M - mb * 16);
        write_rows(c, 32, rows, cols, pbias, n0, py + mb * 16 * N, N);
      }
    }
    _tile_release();
  }
#endif
  return y;
}

bool amx_linear_built() { return kHaveAmx; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &amx_linear);
  m.def("amx_linear_built() -> bool", &amx_linear_built);
}
