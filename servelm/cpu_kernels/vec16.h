// 16-lane float vectors for servelm's CPU kernels: GCC vector extensions, which -march=native
// turns into AVX-512 (or splits into AVX2/SSE halves on narrower machines).
//
// Without AVX-512 GCC splits plain arithmetic into two 256-bit halves well, but turns a
// 16-lane select (`a < b ? x : y`), a two-input shuffle, a float -> int conversion or a loop
// over lanes into 16 scalar operations through the stack. The kernels therefore say those
// through the functions here (keep_first, max16, gt_mask16, select16, nan_mask16, ge_mask16,
// clamp16, to_int16, lane_sum, lane_max), which have AVX2 bodies of two 256-bit halves: the
// same lanes, except that lane_sum adds in a tree instead of lane by lane (another rounding
// of the same sum).
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace servelm_cpu {

using bf16 = uint16_t;  // raw bfloat16 bits: the upper half of a float32

// aligned(4)/(2): loads and stores may be unaligned; may_alias: they read float/bf16 rows.
typedef float f32x16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t u32x16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2), may_alias));

inline f32x16 splat(float x) { return f32x16{} + x; }

#if defined(__AVX2__) && !defined(__AVX512F__)
#define SERVELM_VEC16_HALVES 1
inline __m256 half8(f32x16 v, int h) {
  __m256 r;
  std::memcpy(&r, reinterpret_cast<const char*>(&v) + 32 * h, 32);
  return r;
}
inline __m256i half8(i32x16 v, int h) {
  __m256i r;
  std::memcpy(&r, reinterpret_cast<const char*>(&v) + 32 * h, 32);
  return r;
}
inline f32x16 join8(__m256 lo, __m256 hi) {
  f32x16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
}
inline i32x16 join8(__m256i lo, __m256i hi) {
  i32x16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
}
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
#endif

// v in lanes 0..n-1, `fill` in lanes n..15.
inline f32x16 keep_first(f32x16 v, int n, float fill) {
#if defined(SERVELM_VEC16_HALVES)
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 f = _mm256_set1_ps(fill);
  __m256 h[2];
  for (int i = 0; i < 2; ++i) {
    const __m256 keep = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * i), idx));
    h[i] = _mm256_blendv_ps(f, half8(v, i), keep);
  }
  return join8(h[0], h[1]);
#else
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return lane < n ? v : splat(fill);
#endif
}

// a > b ? a : b, lane by lane (b where either is NaN, as the select).
inline f32x16 max16(f32x16 a, f32x16 b) {
#if defined(SERVELM_VEC16_HALVES)
  return join8(_mm256_max_ps(half8(a, 0), half8(b, 0)), _mm256_max_ps(half8(a, 1), half8(b, 1)));
#else
  return a > b ? a : b;
#endif
}

// -1 in the lanes where a > b (false for NaN), else 0.
inline i32x16 gt_mask16(f32x16 a, f32x16 b) {
#if defined(SERVELM_VEC16_HALVES)
  return join8(_mm256_castps_si256(_mm256_cmp_ps(half8(a, 0), half8(b, 0), _CMP_GT_OQ)),
               _mm256_castps_si256(_mm256_cmp_ps(half8(a, 1), half8(b, 1), _CMP_GT_OQ)));
#else
  return a > b;
#endif
}

// mask ? a : b, lane by lane (mask lanes -1 or 0).
inline f32x16 select16(i32x16 mask, f32x16 a, f32x16 b) {
#if defined(SERVELM_VEC16_HALVES)
  return join8(_mm256_blendv_ps(half8(b, 0), half8(a, 0), _mm256_castsi256_ps(half8(mask, 0))),
               _mm256_blendv_ps(half8(b, 1), half8(a, 1), _mm256_castsi256_ps(half8(mask, 1))));
#else
  return mask ? a : b;
#endif
}
inline i32x16 select16(i32x16 mask, i32x16 a, i32x16 b) {
#if defined(SERVELM_VEC16_HALVES)
  const auto half = [&](int h) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(half8(b, h)),
                                                _mm256_castsi256_ps(half8(a, h)),
                                                _mm256_castsi256_ps(half8(mask, h))));
  };
  return join8(half(0), half(1));
#else
  return mask ? a : b;
#endif
}

// -1 in the lanes where v is NaN, else 0.
inline i32x16 nan_mask16(f32x16 v) {
#if defined(SERVELM_VEC16_HALVES)
  return join8(_mm256_castps_si256(_mm256_cmp_ps(half8(v, 0), half8(v, 0), _CMP_UNORD_Q)),
               _mm256_castps_si256(_mm256_cmp_ps(half8(v, 1), half8(v, 1), _CMP_UNORD_Q)));
#else
  return v != v;
#endif
}

// -1 in the lanes where v >= t (false for NaN), else 0.
inline i32x16 ge_mask16(f32x16 v, f32x16 t) {
#if defined(SERVELM_VEC16_HALVES)
  return join8(_mm256_castps_si256(_mm256_cmp_ps(half8(v, 0), half8(t, 0), _CMP_GE_OQ)),
               _mm256_castps_si256(_mm256_cmp_ps(half8(v, 1), half8(t, 1), _CMP_GE_OQ)));
#else
  return v >= t;
#endif
}

// x clamped to [lo, hi] lane by lane (x not NaN).
inline f32x16 clamp16(f32x16 x, float lo, float hi) {
#if defined(SERVELM_VEC16_HALVES)
  const __m256 l = _mm256_set1_ps(lo), u = _mm256_set1_ps(hi);
  return join8(_mm256_min_ps(_mm256_max_ps(half8(x, 0), l), u),
               _mm256_min_ps(_mm256_max_ps(half8(x, 1), l), u));
#else
  x = x < lo ? splat(lo) : x;
  return x > hi ? splat(hi) : x;
#endif
}

// Lanes holding whole numbers -> int32.
inline i32x16 to_int16(f32x16 x) {
#if defined(SERVELM_VEC16_HALVES)
  return join8(_mm256_cvttps_epi32(half8(x, 0)), _mm256_cvttps_epi32(half8(x, 1)));
#else
  return __builtin_convertvector(x, i32x16);
#endif
}
inline f32x16 load16(const float* p) { return *reinterpret_cast<const f32x16*>(p); }
inline f32x16 load16(const bf16* p) {
  const u32x16 wide = __builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16);
  return (f32x16)(wide << 16);
}
inline f32x16 load16(const c10::BFloat16* p) { return load16(reinterpret_cast<const bf16*>(p)); }
inline void store16(float* p, f32x16 v) { *reinterpret_cast<f32x16*>(p) = v; }
// float32 -> bfloat16, rounded to nearest even (c10::BFloat16's rounding, NaN aside: no
// kernel here stores one).
inline void store16(c10::BFloat16* p, f32x16 v) {
  const u32x16 b = (u32x16)v;
  const u32x16 r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  *reinterpret_cast<u16x16*>(p) = __builtin_convertvector(r, u16x16);
}
// v as a T row would hold it after store16 (a bfloat16 sum is rounded before it is reused).
inline f32x16 as_stored(f32x16 v, const float*) { return v; }
inline f32x16 as_stored(f32x16 v, const c10::BFloat16*) {
  const u32x16 b = (u32x16)v;
  return (f32x16)(((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16) << 16);
}

// *p in every lane (one load-broadcast; splat(x) would add x to a zero vector first).
inline f32x16 broadcast16(const float* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_set1_ps(*p);
#else
  return splat(*p);
#endif
}

// a * b + c rounded once, in every lane: spelled out rather than left to the compiler's
// contraction, so kernels whose results must not move (det_gemm.cpp) say what they compute.
inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(SERVELM_VEC16_HALVES) && defined(__FMA__)
  return join8(_mm256_fmadd_ps(half8(a, 0), half8(b, 0), half8(c, 0)),
               _mm256_fmadd_ps(half8(a, 1), half8(b, 1), half8(c, 1)));
#else
  f32x16 r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// float8 e4m3fn codes (an fp8 KV cache): 1 sign, 4 exponent (bias 7), 3 mantissa bits.
struct fp8_e4m3 {
  uint8_t bits;
};
// Exact: normal codes move their exponent and mantissa into float32's fields and rebias by
// integer add; subnormals (exponent 0) are m * 2^-9. No denormal float is formed, so flush-
// to-zero modes cannot touch it. NaN codes are never stored (writers saturate).
inline f32x16 load16(const fp8_e4m3* p) {
  typedef uint8_t u8x16_ __attribute__((vector_size(16), aligned(1), may_alias));
  const i32x16 w = __builtin_convertvector(*reinterpret_cast<const u8x16_*>(p), i32x16);
  const i32x16 mag = w & 0x7F;
  const f32x16 normal = (f32x16)((mag << 20) + (120 << 23));
#if defined(SERVELM_VEC16_HALVES)
  __m256 h[2];
  for (int i = 0; i < 2; ++i) {
    const __m256i m = half8(mag, i);
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0x1p-9f));
    const __m256 is_normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(m, _mm256_set1_epi32(7)));
    h[i] = _mm256_blendv_ps(sub, half8(normal, i), is_normal);
  }
  const f32x16 v = join8(h[0], h[1]);
#else
  const f32x16 sub = __builtin_convertvector(mag, f32x16) * 0x1p-9f;
  const f32x16 v = mag >= 8 ? normal : sub;
#endif
  return (f32x16)((i32x16)v | ((w & 0x80) << 24));
}

inline float lane_sum(f32x16 v) {
#if defined(SERVELM_VEC16_HALVES)
  return hsum8(_mm256_add_ps(half8(v, 0), half8(v, 1)));
#else
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}
inline float lane_max(f32x16 v) {
#if defined(SERVELM_VEC16_HALVES)
  return hmax8(_mm256_max_ps(half8(v, 0), half8(v, 1)));
#else
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

// exp(x), x clamped to [-87, 88] (results within float's normal range): Cephes' expf
// polynomial, branch-free, about 1 ulp. libm's expf would be one call per element.
inline f32x16 exp16(f32x16 x) {
  x = clamp16(x, -87.0f, 88.0f);
  const f32x16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x16 y = p * r * r + r + 1.0f;
  const i32x16 two_n = (to_int16(n) + 127) << 23;
  return y * (f32x16)two_n;
}

}  // namespace servelm_cpu
