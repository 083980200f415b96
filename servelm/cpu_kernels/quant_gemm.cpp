// Weight-only int4 / int8 matmuls with float32 activations: the CPU path of servelm/quant
// (Int4Linear, Int8Linear, Int8Head).
//
// Why our own: this torch build's packed int4/int8 CPU ops are fast only with bf16
// activations (a cast each way per layer, and bf16 rounding that changes greedy choices), and
// at one token a step they read the weights at ~6 GB/s. A decode step is a matrix-vector
// product: every weight byte is read once and used M times, so the work is turning codes into
// floats as fast as memory delivers them.
//
// Layout: weight rows in panels of 16 (padded with zero rows), a panel's codes interleaved
// along K so that one column of a panel is one 16-lane vector:
//   int4: codes [P, K/2, 16] u8, codes[p][k/2][j] = q[16p+j][k] | q[16p+j][k+1] << 4
//         sz [P, G, 2, 16] (scale, then zero; bf16 or f32), w = (q - 8) scale + zero
//   int8: codes [P, K, 16] i8, scale [16P] f32 (one per row) or [P, G, 16] (one per
//         `group` columns), w = q scale
// so y[m, 16p : 16p+16] = sum_k x[m, k] * column k: one broadcast multiply-add per column, no
// horizontal sums, and a group's scale/zero are one vector each:
//   y += scale * sum_{k in g} (q - 8) x  +  zero * sum_{k in g} x
// (the x sums once a call). Float32 math on the exact dequantized weight, in a different
// order than BLAS (~1e-6 relative). Threads share out panels; each panel meets x in tiles of
// R rows (8, 4, 2, 1), so one decoded column serves R rows; at R = 1 the columns go round four
// accumulators to hide the multiply-add latency. Without AVX-512 (AVX2 only) the same panels
// run on 256-bit registers, half a panel at a time (see scales8 below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec16.h"

namespace {

using namespace servelm_cpu;
constexpr int64_t kLanes = 16;  // weight rows per panel

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1), may_alias));

// A direct u8x16 -> f32x16 or signed i8x16 -> i32x16 convertvector comes out as 16 scalar
// conversions in GCC; u8x16 -> i32x16 is one vpmovzxbd.
// Codes 0..15 -> q - 8 as floats: a table lookup (vpermps) costs what the conversion would.
// Centred codes keep the two per-group sums small: scale * sum (q - 8) x + zero * sum x
// cancels far less than scale * sum q x + (zero - 8 scale) * sum x.
inline f32x16 centred_code(u8x16 c) {
  const i32x16 idx = __builtin_convertvector(c, i32x16);
#if defined(__AVX512F__)
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return (f32x16)_mm512_permutexvar_ps((__m512i)idx, table);
#else
  return __builtin_convertvector(idx - 8, f32x16);
#endif
}
inline f32x16 i8_to_f32(const int8_t* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  const u8x16 c = *reinterpret_cast<const u8x16*>(p) ^ 0x80;  // the value + 128, unsigned
  return __builtin_convertvector(__builtin_convertvector(c, i32x16) - 128, f32x16);
#endif
}

void check_cpu(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), name,
              " must be a contiguous ", c10::toString(dtype), " CPU tensor");
}

// Panels per task: at least ~16K weights, so a small layer's few panels stay on one thread.
int64_t grain_panels(int64_t k) { return std::max<int64_t>(1, (int64_t(1) << 14) / (kLanes * std::max<int64_t>(1, k))); }

#if defined(SERVELM_VEC16_HALVES)
// AVX2: 16-lane vectors of this file's kind cost stack round trips there (vec16.h), so the
// panels run on 256-bit registers, one half (weight rows 0-7, then 8-15) through the whole K
// loop at a time, with the same sums per lane.
inline __m256 scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 scales8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#endif

// out[r][0:16] for the R rows x[0..R) (row stride K) against one panel.
template <int R, typename S>
inline void int4_panel(const float* x, const float* xsum, int64_t K, int64_t G, int64_t group,
                       const uint8_t* codes, const S* sz, f32x16* out) {
#if defined(SERVELM_VEC16_HALVES)
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i eight = _mm256_set1_epi32(8);
  __m256 res[R][2];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 dl[R], dh[R];  // the even and the odd columns' sums
      for (int r = 0; r < R; ++r) dl[r] = dh[r] = _mm256_setzero_ps();
      const int64_t k_end = std::min(K, (g + 1) * group);
      for (int64_t k = g * group; k < k_end; k += 2) {
        const __m128i b = _mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(codes + (k / 2) * kLanes + 8 * h));
        const __m256 lo = _mm256_cvtepi32_ps(
            _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_and_si128(b, mask)), eight));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(
            _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)), eight));
        for (int r = 0; r < R; ++r) {
          dl[r] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(x + r * K + k), dl[r]);
          dh[r] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(x + r * K + k + 1), dh[r]);
        }
      }
      const __m256 scale = scales8(sz + (2 * g) * kLanes + 8 * h);
      const __m256 zero = scales8(sz + (2 * g + 1) * kLanes + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 sum = _mm256_add_ps(dl[r], dh[r]);
        acc[r] = _mm256_add_ps(acc[r], _mm256_fmadd_ps(scale, sum, _mm256_mul_ps(
                                                           zero, _mm256_set1_ps(xsum[r * G + g]))));
      }
    }
    for (int r = 0; r < R; ++r) res[r][h] = acc[r];
  }
  for (int r = 0; r < R; ++r) out[r] = join8(res[r][0], res[r][1]);
#else
  constexpr int C = R == 1 ? 2 : 1;  // column pairs a step: accumulators per row = 2 C
  f32x16 acc[R] = {};
  for (int64_t g = 0; g < G; ++g) {
    f32x16 d[R][2 * C] = {};
    const int64_t k_end = std::min(K, (g + 1) * group);
    for (int64_t k = g * group; k < k_end; k += 2 * C) {
      for (int c = 0; c < C; ++c) {
        const u8x16 q = *reinterpret_cast<const u8x16*>(codes + (k / 2 + c) * kLanes);
        const f32x16 lo = centred_code(q & 15), hi = centred_code(q >> 4);
        for (int r = 0; r < R; ++r) {
          d[r][2 * c] += lo * x[r * K + k + 2 * c];
          d[r][2 * c + 1] += hi * x[r * K + k + 2 * c + 1];
        }
      }
    }
    const f32x16 scale = load16(sz + (2 * g) * kLanes), zero = load16(sz + (2 * g + 1) * kLanes);
    for (int r = 0; r < R; ++r) {
      f32x16 sum = d[r][0];
      for (int i = 1; i < 2 * C; ++i) sum += d[r][i];
      acc[r] += scale * sum + zero * xsum[r * G + g];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
#endif
}

// The R x 16 results of a panel into y[M, N] (the last panel may be cut short by N).
template <int R>
inline void store_panel(const f32x16* out, float* y, int64_t m, int64_t N, int64_t p) {
  const int64_t n0 = p * kLanes, valid = std::min(kLanes, N - n0);
  for (int r = 0; r < R; ++r) {
    float* dst = y + (m + r) * N + n0;
    if (valid == kLanes) {
      store16(dst, out[r]);
    } else {
      for (int64_t j = 0; j < valid; ++j) dst[j] = out[r][j];
    }
  }
}

template <typename S>
void int4_gemm_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                    int64_t N, int64_t group, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), G = sz.size(1);
  at::Tensor xsum = at::empty({M, G}, x.options());
  const float* px = x.data_ptr<float>();
  float* ps = xsum.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) s += px[m * K + k];
      ps[m * G + g] = s;
    }
  const uint8_t* pc = codes.data_ptr<uint8_t>();
  const S* pz = reinterpret_cast<const S*>(sz.data_ptr());
  float* py = y.data_ptr<float>();
  at::parallel_for(0, P, grain_panels(K), [&](int64_t begin, int64_t end) {
    f32x16 out[8];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* c = pc + p * (K / 2) * kLanes;
      const S* z = pz + p * G * 2 * kLanes;
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) {
        int4_panel<8>(px + m * K, ps + m * G, K, G, group, c, z, out);
        store_panel<8>(out, py, m, N, p);
      }
      if (M - m >= 4) {
        int4_panel<4>(px + m * K, ps + m * G, K, G, group, c, z, out);
        store_panel<4>(out, py, m, N, p);
        m += 4;
      }
      if (M - m >= 2) {
        int4_panel<2>(px + m * K, ps + m * G, K, G, group, c, z, out);
        store_panel<2>(out, py, m, N, p);
        m += 2;
      }
      if (M - m == 1) {
        int4_panel<1>(px + m * K, ps + m * G, K, G, group, c, z, out);
        store_panel<1>(out, py, m, N, p);
      }
    }
  });
}

// y[M, N] = x @ w.T with w the int4 panels (N: the real rows; the panels hold ceil(N/16)*16).
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                     int64_t N, int64_t group) {
  check_cpu(x, at::kFloat, "int4_gemm: x");
  check_cpu(codes, at::kByte, "int4_gemm: codes");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && codes.size(2) == kLanes,
              "int4_gemm: x must be [M, K] and codes [P, K/2, 16]");
  const int64_t K = x.size(1), P = codes.size(0);
  TORCH_CHECK(K % 32 == 0 && codes.size(1) * 2 == K, "int4_gemm: K must be a multiple of 32 "
              "matching codes [P, K/2, 16], got K=", K, " and codes ", codes.sizes());
  TORCH_CHECK(group > 0 && group % 32 == 0, "int4_gemm: group must be a multiple of 32");
  TORCH_CHECK(N > (P - 1) * kLanes && N <= P * kLanes, "int4_gemm: N=", N, " does not fit ", P,
              " panels");
  const int64_t G = (K + group - 1) / group;
  TORCH_CHECK(sz.device().is_cpu() && sz.is_contiguous() &&
                  sz.sizes() == at::IntArrayRef({P, G, 2, kLanes}),
              "int4_gemm: sz must be a contiguous [P, ceil(K / group), 2, 16] CPU tensor");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (sz.scalar_type() == at::kBFloat16) {
    int4_gemm_impl<c10::BFloat16>(x, codes, sz, N, group, y);
  } else {
    TORCH_CHECK(sz.scalar_type() == at::kFloat, "int4_gemm: sz must be bfloat16 or float32");
    int4_gemm_impl<float>(x, codes, sz, N, group, y);
  }
  return y;
}

template <int R>
inline void int8_panel(const float* x, int64_t K, int64_t group, int64_t G, const int8_t* codes,
                       const float* scale, f32x16* out) {
#if defined(SERVELM_VEC16_HALVES)
  __m256 res[R][2];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 d0[R], d1[R];  // even and odd columns
      for (int r = 0; r < R; ++r) d0[r] = d1[r] = _mm256_setzero_ps();
      const int64_t k_end = std::min(K, (g + 1) * group);
      int64_t k = g * group;
      for (; k + 2 <= k_end; k += 2) {
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k * kLanes + 8 * h))));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (k + 1) * kLanes + 8 * h))));
        for (int r = 0; r < R; ++r) {
          d0[r] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x + r * K + k), d0[r]);
          d1[r] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(x + r * K + k + 1), d1[r]);
        }
      }
      for (; k < k_end; ++k) {
        const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k * kLanes + 8 * h))));
        for (int r = 0; r < R; ++r)
          d0[r] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + r * K + k), d0[r]);
      }
      const __m256 sc = _mm256_loadu_ps(scale + g * kLanes + 8 * h);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(sc, _mm256_add_ps(d0[r], d1[r]), acc[r]);
    }
    for (int r = 0; r < R; ++r) res[r][h] = acc[r];
  }
  for (int r = 0; r < R; ++r) out[r] = join8(res[r][0], res[r][1]);
#else
  constexpr int C = R == 1 ? 4 : 2;  // columns a step = accumulators per row
  f32x16 acc[R] = {};
  for (int64_t g = 0; g < G; ++g) {
    f32x16 d[R][C] = {};
    const int64_t k_end = std::min(K, (g + 1) * group);
    int64_t k = g * group;
    for (; k + C <= k_end; k += C) {
      for (int c = 0; c < C; ++c) {
        const f32x16 w = i8_to_f32(codes + (k + c) * kLanes);
        for (int r = 0; r < R; ++r) d[r][c] += w * x[r * K + k + c];
      }
    }
    for (; k < k_end; ++k) {
      const f32x16 w = i8_to_f32(codes + k * kLanes);
      for (int r = 0; r < R; ++r) d[r][0] += w * x[r * K + k];
    }
    const f32x16 s = load16(scale + g * kLanes);
    for (int r = 0; r < R; ++r) {
      f32x16 sum = d[r][0];
      for (int c = 1; c < C; ++c) sum += d[r][c];
      acc[r] += s * sum;
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
#endif
}

// group 0: one scale per row (scale [16P]); else one per `group` columns (scale [P, G, 16]).
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     int64_t N, int64_t group) {
  check_cpu(x, at::kFloat, "int8_gemm: x");
  check_cpu(codes, at::kChar, "int8_gemm: codes");
  check_cpu(scale, at::kFloat, "int8_gemm: scale");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && codes.size(2) == kLanes &&
                  codes.size(1) == x.size(1),
              "int8_gemm: x must be [M, K] and codes [P, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0);
  TORCH_CHECK(N > (P - 1) * kLanes && N <= P * kLanes, "int8_gemm: N=", N, " does not fit ", P,
              " panels");
  TORCH_CHECK(group >= 0, "int8_gemm: group must be >= 0");
  const int64_t span = group > 0 ? group : std::max<int64_t>(K, 1);
  const int64_t G = group > 0 ? (K + group - 1) / group : 1;
  TORCH_CHECK(scale.numel() == P * G * kLanes, "int8_gemm: scale must have 16 values per panel",
              group > 0 ? " and group" : "");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* px = x.data_ptr<float>();
  const int8_t* pc = codes.data_ptr<int8_t>();
  const float* psc = scale.data_ptr<float>();
  float* py = y.data_ptr<float>();
  at::parallel_for(0, P, grain_panels(K), [&](int64_t begin, int64_t end) {
    f32x16 out[8];
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* c = pc + p * K * kLanes;
      const float* s = psc + p * G * kLanes;
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) {
        int8_panel<8>(px + m * K, K, span, G, c, s, out);
        store_panel<8>(out, py, m, N, p);
      }
      if (M - m >= 4) {
        int8_panel<4>(px + m * K, K, span, G, c, s, out);
        store_panel<4>(out, py, m, N, p);
        m += 4;
      }
      if (M - m >= 2) {
        int8_panel<2>(px + m * K, K, span, G, c, s, out);
        store_panel<2>(out, py, m, N, p);
        m += 2;
      }
      if (M - m == 1) {
        int8_panel<1>(px + m * K, K, span, G, c, s, out);
        store_panel<1>(out, py, m, N, p);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor codes, Tensor sz, int n, int group) -> Tensor", &int4_gemm);
  m.def("int8_gemm(Tensor x, Tensor codes, Tensor scale, int n, int group=0) -> Tensor",
        &int8_gemm);
}
