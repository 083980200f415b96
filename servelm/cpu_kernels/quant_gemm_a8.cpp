// Quantized weights times int8 activations: int4_gemm_a8, int8_gemm_a8 (integer dot products,
// avx512_vnni's vpdpbusd), quantize_act_int8 (the activation step alone, for tests) and
// int8_dot_probe (whether this process may run vpdpbusd at all).
//
// Why: the float-activation kernels (quant_gemm.cpp) turn every code into a float and do one
// multiply-add per weight; at one token a step the whole default model sits in this machine's
// L3, so the step is bound by those instructions, not by memory. vpdpbusd does 64 byte
// products a instruction: the activations are rounded to int8 once a call (per row, per 32
// columns: d = max|x| / 127, q = round(x / d), as llama.cpp's Q8 blocks), and a group's dot
// product is exact integer math; its float scales are applied once per 32 columns.
//
// vpdpbusd multiplies unsigned by signed bytes. The weights are the unsigned side:
//   int4: codes 0..15 as they are, w = q * scale + offset (GGUF Q4_1's own form: offset = m;
//         Q4_0: -8 d; servelm's (q - 8) scale + zero: zero - 8 scale)
//   int8: codes + 128 (0..255);     sum  w x_q = dot - 128 sum x_q        (exact)
// so the only correction is the activation group's own code sum s_a, computed when x is
// rounded. Per row r, group a of 32 columns, weight group g = 32 a / group:
//   int4: y += scale_g * (d_a * dot) + offset_g * (d_a * s_a)
//   int8: y += scale_g * (d_a * (dot - 128 s_a))                         (w = q scale)
// Scales are float32, bfloat16 or float16, whichever holds them exactly (the layer decides:
// GGUF's d and m are float16 in the file): a decode step reads every weight from L3 or
// memory once, and float32 scales are a third of an int4 layer's bytes.
//
// Layout (servelm/quant/cpu_panels.py pack_*_vnni): panels of 16 weight rows, along K in
// blocks whose one 64-byte vector is 16 lanes x 4 consecutive columns of a row:
//   int4: codes [P, Kp/8, 16, 4] u8: byte b of lane j in block i holds q[16p+j][8i+b] (low
//         nibble) and q[16p+j][8i+4+b] (high nibble); so [P, G, 2, 16]: (scale, offset)
//   int8: codes [P, Kp/4, 16, 4] u8: byte b of lane j in block i is q[16p+j][4i+b] + 128;
//         scale [16P] (per row) or [P, G, 16] (per `group` columns, group % 32 == 0)
//   int8 also in the float kernels' panels ([P, K, 16] int8, quant_gemm.cpp), each panel
//   turned into the order above as the call reaches it (panel_to_vnni): one copy of a layer's
//   codes serves both kernels
// Kp is a multiple of 32; x may have K <= Kp columns (Kp - 32 < K): the rest count as 0.
// Padded rows have scale 0 (and offset 0).
//
// Without avx512_vnni in the build the same math runs through an AVX-512BW emulation of
// vpdpbusd (exact: 16-bit products, pairwise 32-bit sums); on a machine without AVX-512 it
// runs on AVX2 (vpmaddubsw + vpmaddwd, exact, see the AVX2 section), and with neither the ops
// refuse. servelm's layers pick these ops only after int8_dot_probe said yes, which it says
// for the VNNI and the AVX2 builds (int8_dot_path names which).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace {

using namespace servelm_cpu;
constexpr int64_t kLanes = 16;   // weight rows per panel
constexpr int64_t kAGroup = 32;  // activation columns per scale

void check_cpu(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), name,
              " must be a contiguous ", c10::toString(dtype), " CPU tensor");
}

// x [M, K] float32 or bfloat16 -> codes [M, Kp] int8, d [M, Kp/32] float32, s [M, Kp/32] int32 (the
// codes' sum per group). d = amax / 127, q = round-half-even(x * (1 / d)); d = 0: q = 0.
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, int64_t Kp, int8_t* q, float* d,
                   int32_t* s) {
  const int64_t A = Kp / kAGroup;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    float buf[kAGroup];
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t a = 0; a < A; ++a) {
        const int64_t k0 = a * kAGroup, n = std::max<int64_t>(0, std::min(kAGroup, K - k0));
        for (int64_t i = 0; i < kAGroup; ++i) buf[i] = i < n ? float(x[m * K + k0 + i]) : 0.0f;
        float amax = 0.0f;
        for (int64_t i = 0; i < kAGroup; ++i) amax = std::max(amax, std::fabs(buf[i]));
        const float dd = amax / 127.0f, inv = dd != 0.0f ? 1.0f / dd : 0.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < kAGroup; ++i) {
          const int32_t v = int32_t(std::nearbyint(buf[i] * inv));  // half to even, as torch
          q[m * Kp + k0 + i] = int8_t(v);
          sum += v;
        }
        d[m * A + a] = dd, s[m * A + a] = sum;
      }
    }
  });
}

#if defined(__AVX512BW__)
#define SERVELM_A8_KERNELS 1
using Out16 = __m512;  // one panel's 16 outputs for one row

// acc + per 32-bit lane sum of its 4 u8 x s8 byte products.
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  const __m512i u_even = _mm512_and_si512(u, _mm512_set1_epi16(0x00FF));
  const __m512i u_odd = _mm512_srli_epi16(u, 8);
  const __m512i s_even = _mm512_srai_epi16(_mm512_slli_epi16(s, 8), 8);
  const __m512i s_odd = _mm512_srai_epi16(s, 8);
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i even = _mm512_madd_epi16(_mm512_mullo_epi16(u_even, s_even), ones);
  const __m512i odd = _mm512_madd_epi16(_mm512_mullo_epi16(u_odd, s_odd), ones);
  return _mm512_add_epi32(acc, _mm512_add_epi32(even, odd));
#endif
}

inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const bf16* p) { return (__m512)load16(p); }
inline __m512 load_scales(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The activations of R rows, rounded: codes (row stride Kp), d and s (row stride A).
struct RowsA8 {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t Kp, A;
};

// out[r] = the 16 outputs of one int4 panel for rows 0..R of `x`.
template <int R, typename S>
inline void int4_a8_panel(const RowsA8& x, int64_t group, const uint8_t* codes, const S* so,
                          Out16* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t a = 0; a < x.A; ++a) {
    __m512i lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
    const uint8_t* c = codes + a * 4 * 64;
    for (int b = 0; b < 4; ++b) {  // 8 columns a block
      const __m512i w = _mm512_loadu_si512(c + b * 64);
      const __m512i wl = _mm512_and_si512(w, low4);
      const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = x.q + r * x.Kp + a * kAGroup + b * 8;
        lo[r] = dpbusd(lo[r], wl, bcast4(xr));
        hi[r] = dpbusd(hi[r], wh, bcast4(xr + 4));
      }
    }
    const int64_t g = a * kAGroup / group;
    const __m512 scale = load_scales(so + (2 * g) * kLanes);
    const __m512 offset = load_scales(so + (2 * g + 1) * kLanes);
    for (int r = 0; r < R; ++r) {
      const float d = x.d[r * x.A + a];
      const __m512i dot = _mm512_add_epi32(lo[r], hi[r]);
      const __m512 xd = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d));
      acc[r] = _mm512_fmadd_ps(scale, xd, acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(d * float(x.s[r * x.A + a])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// The same for an int8 panel (codes + 128); sc: the panel's scales (group 0: one per row).
template <int R, typename S>
inline void int8_a8_panel(const RowsA8& x, int64_t group, const uint8_t* codes, const S* sc,
                          Out16* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t a = 0; a < x.A; ++a) {
    __m512i d0[R], d1[R];
    for (int r = 0; r < R; ++r) d0[r] = d1[r] = _mm512_setzero_si512();
    const uint8_t* c = codes + a * 8 * 64;
    for (int b = 0; b < 8; b += 2) {  // 4 columns a block, two accumulators
      const __m512i w0 = _mm512_loadu_si512(c + b * 64);
      const __m512i w1 = _mm512_loadu_si512(c + (b + 1) * 64);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = x.q + r * x.Kp + a * kAGroup + b * 4;
        d0[r] = dpbusd(d0[r], w0, bcast4(xr));
        d1[r] = dpbusd(d1[r], w1, bcast4(xr + 4));
      }
    }
    const __m512 scale = load_scales(sc + (group > 0 ? a * kAGroup / group : 0) * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(d0[r], d1[r]),
                                           _mm512_set1_epi32(128 * x.s[r * x.A + a]));
      const __m512 xd = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(x.d[r * x.A + a]));
      acc[r] = _mm512_fmadd_ps(scale, xd, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <int R>
inline void store_panel(const Out16* out, float* y, int64_t m, int64_t N, int64_t p) {
  const int64_t n0 = p * kLanes, valid = std::min(kLanes, N - n0);
  const __mmask16 mask = __mmask16((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m + r) * N + n0, mask, out[r]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SERVELM_A8_KERNELS 1
// AVX2 has no vpdpbusd and no 512-bit registers: a panel's 64-byte block is two 256-bit
// halves (weight rows 0-7 and 8-15), each run through the whole K loop in turn, and the byte
// products go through vpmaddubsw (u8 x s8 pairs summed into 16 bits, saturating) and
// vpmaddwd (16-bit pairs into 32 bits), llama.cpp's AVX2 way. Exact, and so equal to the
// AVX-512 path bit for bit:
//   int4: a pair is at most 2 x 15 x 127 = 3810, and a group's 8 of them (4 blocks, two
//         nibbles) at most 30480 < 32767: they are summed in 16 bits, widened once a group.
//   int8: codes + 128 times a code could saturate (2 x 255 x 127), so the signed code comes
//         back (xor 0x80) and the sign moves onto the activation (vpsignb): |w| x (sign(w) x),
//         at most 2 x 128 x 127 = 32512, widened every block. That is the signed dot itself,
//         with no 128 s_a to take off.
struct Out16 {
  __m256 h[2];
};

inline __m256 load_scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load_scales8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The activations of R rows, rounded: codes (row stride Kp), d and s (row stride A).
struct RowsA8 {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t Kp, A;
};

template <int R, typename S>
inline void int4_a8_panel(const RowsA8& x, int64_t group, const uint8_t* codes, const S* so,
                          Out16* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t per_group = group / kAGroup;  // activation groups a weight group
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const S* sg = so + h * 8;  // weight group g's scales (g = 32 a / group, no division)
    int64_t left = per_group;
    for (int64_t a = 0; a < x.A; ++a) {
      __m256i dot16[R];
      for (int r = 0; r < R; ++r) dot16[r] = _mm256_setzero_si256();
      const uint8_t* c = codes + a * 4 * 64 + h * 32;
      // Not unrolled: unrolled, GCC computes all 8 R products first and spills them.
#pragma GCC unroll 1
      for (int b = 0; b < 4; ++b) {  // 8 columns a block
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + b * 64));
        const __m256i wl = _mm256_and_si256(w, low4);
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x.q + r * x.Kp + a * kAGroup + b * 8;
          dot16[r] = _mm256_add_epi16(dot16[r], _mm256_maddubs_epi16(wl, bcast4(xr)));
          dot16[r] = _mm256_add_epi16(dot16[r], _mm256_maddubs_epi16(wh, bcast4(xr + 4)));
        }
      }
      const __m256 scale = load_scales8(sg);
      const __m256 offset = load_scales8(sg + kLanes);
      if (--left == 0) sg += 2 * kLanes, left = per_group;
      for (int r = 0; r < R; ++r) {
        const float d = x.d[r * x.A + a];
        const __m256i dot = _mm256_madd_epi16(dot16[r], ones);
        const __m256 xd = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d));
        acc[r] = _mm256_fmadd_ps(scale, xd, acc[r]);
        acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(d * float(x.s[r * x.A + a])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r].h[h] = acc[r];
  }
}

template <int R, typename S>
inline void int8_a8_panel(const RowsA8& x, int64_t group, const uint8_t* codes, const S* sc,
                          Out16* out) {
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t a = 0; a < x.A; ++a) {
      __m256i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      const uint8_t* c = codes + a * 8 * 64 + h * 32;
      for (int b = 0; b < 8; ++b) {  // 4 columns a block
        const __m256i w = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + b * 64)), flip);
        const __m256i wabs = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i xs = _mm256_sign_epi8(bcast4(x.q + r * x.Kp + a * kAGroup + b * 4), w);
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs),
                                                              ones));
        }
      }
      const __m256 scale =
          load_scales8(sc + (group > 0 ? a * kAGroup / group : 0) * kLanes + h * 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xd = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]),
                                        _mm256_set1_ps(x.d[r * x.A + a]));
        acc[r] = _mm256_fmadd_ps(scale, xd, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r].h[h] = acc[r];
  }
}

template <int R>
inline void store_panel(const Out16* out, float* y, int64_t m, int64_t N, int64_t p) {
  const int64_t n0 = p * kLanes, valid = std::min(kLanes, N - n0);
  for (int r = 0; r < R; ++r) {
    float* yr = y + (m + r) * N + n0;
    if (valid == kLanes) {
      _mm256_storeu_ps(yr, out[r].h[0]);
      _mm256_storeu_ps(yr + 8, out[r].h[1]);
    } else {
      float tmp[kLanes];
      _mm256_storeu_ps(tmp, out[r].h[0]);
      _mm256_storeu_ps(tmp + 8, out[r].h[1]);
      std::memcpy(yr, tmp, valid * sizeof(float));
    }
  }
}
#endif

#if defined(SERVELM_A8_KERNELS)
// Rows in tiles of 4, 2, 1 against each panel (one loaded code vector serves R rows); the
// threads share out panels. codes(p, scratch): panel p's codes in the kernels' order, the
// tensor's own or converted into `scratch` (scratch_bytes a thread), once for all the rows.
template <typename PanelFn, typename CodesFn>
void run_panels(const RowsA8& x, int64_t M, int64_t N, int64_t P, int64_t panel_bytes,
                float* y, PanelFn panel, CodesFn codes, int64_t scratch_bytes = 0) {
  const int64_t grain =
      std::max<int64_t>(1, (int64_t(1) << 13) / std::max<int64_t>(1, panel_bytes));
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(scratch_bytes);
    Out16 out[4];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* c = codes(p, scratch.data());
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        panel(std::integral_constant<int, 4>(), x, m, p, c, out);
        store_panel<4>(out, y, m, N, p);
      }
      if (M - m >= 2) {
        panel(std::integral_constant<int, 2>(), x, m, p, c, out);
        store_panel<2>(out, y, m, N, p);
        m += 2;
      }
      if (M - m == 1) {
        panel(std::integral_constant<int, 1>(), x, m, p, c, out);
        store_panel<1>(out, y, m, N, p);
      }
    }
  });
}

// One int8 panel in the float kernels' layout (quant_gemm.cpp: [K, 16] int8, a column's 16
// rows together) into the VNNI order above ([Kp/4, 16, 4] u8, codes + 128; columns K..Kp
// code 0): a byte transpose of each 4 columns, so that a layer holds its codes once for both
// kernels (servelm/quant/int8_linear.py). Done per panel per call, into a buffer the panel's
// rows then read from L1/L2: a step of many rows pays it once for all of them.
void panel_to_vnni(const int8_t* src, int64_t K, int64_t Kp, uint8_t* dst) {
  int64_t k = 0;
#if defined(__AVX512VBMI__)
  alignas(64) uint8_t order[64];  // byte 4j + b of a block <- column b's row j
  for (int j = 0; j < 16; ++j)
    for (int b = 0; b < 4; ++b) order[4 * j + b] = uint8_t(16 * b + j);
  const __m512i idx = _mm512_load_si512(order), flip = _mm512_set1_epi8(char(0x80));
  for (; k + 4 <= K; k += 4) {
    const __m512i v = _mm512_loadu_si512(src + k * kLanes);
    _mm512_storeu_si512(dst + k * kLanes,
                        _mm512_xor_si512(_mm512_permutexvar_epi8(idx, v), flip));
  }
#else
  const __m128i flip = _mm_set1_epi8(char(0x80));
  for (; k + 4 <= K; k += 4) {
    const __m128i* s = reinterpret_cast<const __m128i*>(src + k * kLanes);
    const __m128i c0 = _mm_loadu_si128(s), c1 = _mm_loadu_si128(s + 1);
    const __m128i c2 = _mm_loadu_si128(s + 2), c3 = _mm_loadu_si128(s + 3);
    // rows 0-7 / 8-15 as (column 0, column 1) and (column 2, column 3) byte pairs, then the
    // pairs' 16-bit halves interleaved: 4 rows x 4 columns a vector
    const __m128i a = _mm_unpacklo_epi8(c0, c1), b = _mm_unpackhi_epi8(c0, c1);
    const __m128i c = _mm_unpacklo_epi8(c2, c3), d = _mm_unpackhi_epi8(c2, c3);
    __m128i* o = reinterpret_cast<__m128i*>(dst + k * kLanes);
    _mm_storeu_si128(o, _mm_xor_si128(_mm_unpacklo_epi16(a, c), flip));
    _mm_storeu_si128(o + 1, _mm_xor_si128(_mm_unpackhi_epi16(a, c), flip));
    _mm_storeu_si128(o + 2, _mm_xor_si128(_mm_unpacklo_epi16(b, d), flip));
    _mm_storeu_si128(o + 3, _mm_xor_si128(_mm_unpackhi_epi16(b, d), flip));
  }
#endif
  for (; k < Kp; ++k)
    for (int64_t j = 0; j < kLanes; ++j)
      dst[(k / 4) * 4 * kLanes + j * 4 + k % 4] =
          uint8_t((k < K ? int(src[k * kLanes + j]) : 0) + 128);
}

inline RowsA8 rows_from(const RowsA8& x, int64_t m) {
  return {x.q + m * x.Kp, x.d + m * x.A, x.s + m * x.A, x.Kp, x.A};
}
#endif  // SERVELM_A8_KERNELS

// The activations quantized into tensors (kept alive by the caller for the GEMM). x: float32
// or bfloat16 rows (the GEMMs return their result in x's dtype: the integer math does not
// care which float type the rows came in).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_x(const at::Tensor& x, int64_t Kp,
                                                          const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, " must be a contiguous float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && Kp % kAGroup == 0 && x.size(1) <= Kp && x.size(1) > Kp - kAGroup,
              op, ": x must be [M, K] with K in (Kp - 32, Kp], Kp = ", Kp, " (the codes'), got ",
              x.sizes());
  const int64_t M = x.size(0), A = Kp / kAGroup;
  at::Tensor q = at::empty({M, Kp}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, A}, x.options().dtype(at::kFloat));
  at::Tensor s = at::empty({M, A}, x.options().dtype(at::kInt));
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), M, x.size(1), Kp, q.data_ptr<int8_t>(),
                  d.data_ptr<float>(), s.data_ptr<int32_t>());
  } else {
    quantize_rows(x.data_ptr<c10::BFloat16>(), M, x.size(1), Kp, q.data_ptr<int8_t>(),
                  d.data_ptr<float>(), s.data_ptr<int32_t>());
  }
  return {q, d, s};
}

// (codes [M, Kp] int8, d [M, Kp/32] float32, s [M, Kp/32] int32): what the GEMMs compute with.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_act_int8(const at::Tensor& x, int64_t kp) {
  return quantize_x(x, kp, "quantize_act_int8: x");
}

void check_panels(const at::Tensor& codes, int64_t cols_per_block, int64_t N, const char* op) {
  check_cpu(codes, at::kByte, op);
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kLanes && codes.size(3) == 4 &&
                  (codes.size(1) * cols_per_block) % kAGroup == 0,
              op, " must be [P, Kp/", cols_per_block, ", 16, 4] with Kp % 32 == 0, got ",
              codes.sizes());
  const int64_t P = codes.size(0);
  TORCH_CHECK(N > (P - 1) * kLanes && N <= P * kLanes, op, ": N=", N, " does not fit ", P,
              " panels");
}

bool is_scale_dtype(const at::Tensor& t) {
  const auto d = t.scalar_type();
  return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf;
}

// fn(pointer to t's values as float, bf16 or c10::Half).
template <typename Fn>
void with_scales(const at::Tensor& t, Fn fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(t.data_ptr<float>());
  } else if (t.scalar_type() == at::kBFloat16) {
    fn(reinterpret_cast<const bf16*>(t.data_ptr()));
  } else {
    fn(t.data_ptr<c10::Half>());
  }
}

// y[M, N] = x @ w.T, w the int4 panels (VNNI layout), x rounded to int8 per 32 columns; y in
// x's dtype. so: (scale, offset) per group, w = q * scale + offset.
at::Tensor int4_gemm_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& so,
                        int64_t N, int64_t group) {
  check_panels(codes, 8, N, "int4_gemm_a8: codes");
  const int64_t P = codes.size(0), Kp = codes.size(1) * 8, G = (Kp + group - 1) / group;
  TORCH_CHECK(group > 0 && group % kAGroup == 0, "int4_gemm_a8: group must be a multiple of 32");
  TORCH_CHECK(so.device().is_cpu() && so.is_contiguous() &&
                  so.sizes() == at::IntArrayRef({P, G, 2, kLanes}) &&
                  is_scale_dtype(so),
              "int4_gemm_a8: so must be a contiguous [P, ceil(Kp / group), 2, 16] float32, "
              "bfloat16 or float16 CPU tensor");
#if defined(SERVELM_A8_KERNELS)
  auto [q, d, s] = quantize_x(x, Kp, "int4_gemm_a8: x");
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  const RowsA8 rows{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), Kp,
                    Kp / kAGroup};
  const uint8_t* pc = codes.data_ptr<uint8_t>();
  const int64_t panel_bytes = Kp / 2 * kLanes;
  with_scales(so, [&](auto* pso) {
    run_panels(rows, x.size(0), N, P, panel_bytes, y.data_ptr<float>(),
               [&](auto R, const RowsA8& xr, int64_t m, int64_t p, const uint8_t* c,
                   Out16* out) {
                 int4_a8_panel<decltype(R)::value>(rows_from(xr, m), group, c,
                                                   pso + p * G * 2 * kLanes, out);
               },
               [&](int64_t p, uint8_t*) { return pc + p * panel_bytes; });
  });
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
#else
  TORCH_CHECK(false, "int4_gemm_a8: needs AVX-512BW or AVX2 (this build has neither)");
#endif
}

// y[M, N] = x @ w.T, w the int8 panels: the VNNI layout (codes + 128, [P, Kp/4, 16, 4] u8)
// or the float kernels' ([P, K, 16] int8, turned into the VNNI layout a panel at a time);
// group 0: one scale a row.
at::Tensor int8_gemm_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        int64_t N, int64_t group) {
  const bool float_layout = codes.scalar_type() == at::kChar;
  int64_t K = 0;
  if (float_layout) {
    check_cpu(codes, at::kChar, "int8_gemm_a8: codes");
    TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kLanes,
                "int8_gemm_a8: int8 codes must be the float kernels' panels [P, K, 16], got ",
                codes.sizes());
    const int64_t P = codes.size(0);
    TORCH_CHECK(N > (P - 1) * kLanes && N <= P * kLanes, "int8_gemm_a8: codes: N=", N,
                " does not fit ", P, " panels");
    K = codes.size(1);
  } else {
    check_panels(codes, 4, N, "int8_gemm_a8: codes");
  }
  TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && is_scale_dtype(scale),
              "int8_gemm_a8: scale must be a contiguous float32, bfloat16 or float16 CPU tensor");
  const int64_t P = codes.size(0);
  const int64_t Kp = float_layout ? (K + kAGroup - 1) / kAGroup * kAGroup : codes.size(1) * 4;
  TORCH_CHECK(group >= 0 && group % kAGroup == 0,
              "int8_gemm_a8: group must be 0 (a scale per row) or a multiple of 32");
  const int64_t G = group > 0 ? (Kp + group - 1) / group : 1;
  TORCH_CHECK(scale.numel() == P * G * kLanes, "int8_gemm_a8: scale must have 16 values per "
              "panel", group > 0 ? " and group" : "");
#if defined(SERVELM_A8_KERNELS)
  auto [q, d, s] = quantize_x(x, Kp, "int8_gemm_a8: x");
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  const RowsA8 rows{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), Kp,
                    Kp / kAGroup};
  const uint8_t* pc = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const int64_t panel_bytes = Kp * kLanes;
  auto panel = [&](const auto* ps) {
    return [&, ps](auto R, const RowsA8& xr, int64_t m, int64_t p, const uint8_t* c,
                   Out16* out) {
      int8_a8_panel<decltype(R)::value>(rows_from(xr, m), group, c, ps + p * G * kLanes, out);
    };
  };
  with_scales(scale, [&](auto* ps) {
    if (float_layout) {
      const int8_t* src = codes.data_ptr<int8_t>();
      run_panels(rows, x.size(0), N, P, panel_bytes, y.data_ptr<float>(), panel(ps),
                 [&](int64_t p, uint8_t* scratch) {
                   panel_to_vnni(src + p * K * kLanes, K, Kp, scratch);
                   return static_cast<const uint8_t*>(scratch);
                 },
                 panel_bytes);
    } else {
      run_panels(rows, x.size(0), N, P, panel_bytes, y.data_ptr<float>(), panel(ps),
                 [&](int64_t p, uint8_t*) { return pc + p * panel_bytes; });
    }
  });
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
#else
  TORCH_CHECK(false, "int8_gemm_a8: needs AVX-512BW or AVX2 (this build has neither)");
#endif
}

// The instruction set the int8-activation GEMMs run on in this build, where servelm's layers
// should use them: avx512_vnni's vpdpbusd, or AVX2's vpmaddubsw on a machine without AVX-512
// (there they beat the float kernels, which spend four instructions a weight). A build with
// AVX-512BW but no VNNI has the ops (an exact emulation) but they are not the fast path.
#if defined(__AVX512VNNI__)
constexpr const char* kDotPath = "avx512_vnni";
// vpdpbusd on known bytes: 16 lanes of 4 x (3 * -2) = -24.
__attribute__((noinline)) bool dot_gives_known_answer() {
  volatile int8_t a = 3, b = -2;
  const __m512i r = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(a),
                                        _mm512_set1_epi8(b));
  return _mm512_reduce_add_epi32(r) == -24 * 16;
}
bool cpu_says_so() { return __builtin_cpu_supports("avx512vnni"); }
#elif defined(SERVELM_A8_KERNELS) && !defined(__AVX512BW__)
constexpr const char* kDotPath = "avx2";
// One int4 group through the kernel's own instructions (8 vpmaddubsw of codes 3 and
// activations -2 summed in 16 bits, widened by vpmaddwd): 8 lanes of 8 x 4 x (3 * -2) = -192.
__attribute__((noinline)) bool dot_gives_known_answer() {
  volatile int8_t a = 3, b = -2;
  __m256i acc = _mm256_setzero_si256();
  for (int i = 0; i < 8; ++i)
    acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(_mm256_set1_epi8(a), _mm256_set1_epi8(b)));
  const __m256i dot = _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
  int32_t out[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), dot);
  for (int i = 0; i < 8; ++i)
    if (out[i] != -192) return false;
  return true;
}
bool cpu_says_so() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
constexpr const char* kDotPath = "";
#endif

// Whether servelm's layers should run int8 activations here: the build has the fast path
// (kDotPath), the CPU says so (cpuid), and a forked child that executes it exits cleanly with
// the right answer (a VM may advertise a flag it traps on: the child dies of SIGILL, this
// process does not). The child runs no torch code and no threads, only the instructions and
// _exit.
bool int8_dot_probe() {
  if (kDotPath[0] == '\0') return false;
#if defined(__AVX512VNNI__) || (defined(SERVELM_A8_KERNELS) && !defined(__AVX512BW__))
  if (!cpu_says_so()) return false;
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) _exit(dot_gives_known_answer() ? 0 : 1);
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
#else
  return false;
#endif
}

std::string int8_dot_path() { return kDotPath; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("int4_gemm_a8(Tensor x, Tensor codes, Tensor so, int n, int group) -> Tensor",
        &int4_gemm_a8);
  m.def("int8_gemm_a8(Tensor x, Tensor codes, Tensor scale, int n, int group) -> Tensor",
        &int8_gemm_a8);
  m.def("quantize_act_int8(Tensor x, int kp) -> (Tensor, Tensor, Tensor)", &quantize_act_int8);
  m.def("int8_dot_probe() -> bool", &int8_dot_probe);
  m.def("int8_dot_path() -> str", &int8_dot_path);
}
