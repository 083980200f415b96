// GGUF K-quant weights (Q4_K, Q5_K, Q6_K) kept as the file's bytes: kquant_gemm (x @ w.T
// with the activations rounded to int8 per 256 columns, llama.cpp's q8_K), kquant_dequant
// (the float weight, for steps of many rows) and kquant_quantize_act (the activation step
// alone, for tests).
//
// Why the file's own bytes: a Q4_K_M model's linears are 4.5-6.6 bits a weight; a decode step
// reads every weight once, so the bytes read are the step. Repacking into servelm's int4 /
// int8 panels would widen Q5_K and Q6_K to a byte a weight and Q4_K's 6-bit sub-block scales
// to float16 pairs.
//
// A super-block is 256 columns of one row (ggml's layouts, as gguf-py's dequantize reads):
//   Q4_K 144 B: d f16 | dmin f16 | scales 12 B (8 x 6-bit sc, 8 x 6-bit m) | qs 128 B
//               w = d sc_j q - dmin m_j, sub-block j of 32, q 4 bits
//   Q5_K 176 B: d | dmin | scales 12 B | qh 32 B | qs 128 B     the same with q 5 bits
//   Q6_K 210 B: ql 128 B | qh 64 B | scales 16 x int8 | d f16  w = d sc_g (q - 32), g of 16
// Each is decoded to one form: 256 unsigned codes (0..63) in column order, an integer scale per
// 16 columns (sc16) and a min coefficient per 16 columns (mc16) with   w = d sc16 q - dmin mc16
// (Q6_K: dmin = d, mc16 = 32 sc16). Against a row x rounded to q8_K (xd, xq[256], bsum16 =
// the sum of each 16 codes), per super-block two exact integers
//   isb = sum_c sc16_c (q . xq)_c        imin = sum_g mc16_g bsum16_g
// and  y += (xd d) isb - (xd dmin) imin  as two float FMAs, super-block after super-block.
// Both kernels below compute exactly these operations, so a row's output is the same bits
// whatever the step's other rows (and whichever kernel ran it):
// - rows (few activation rows): each weight super-block decoded once per tile of up to 4
//   rows; the code products through vpmaddubsw (u8 x s8 pairs into 16 bits: at most
//   2 x 63 x 127, never saturating), then vpdpwssd (avx512_vnni) or vpmaddwd + add with the
//   pair's scale (a vpermw of sc16). sc16 and mc16 are written with one vector store each:
//   built a value at a time, the kernel's vector loads of them stalled on store forwarding
//   (3-5x slower, ad hoc). AVX-512BW: 64 columns a vector; AVX2: 32; neither: scalar loops.
// - panels (avx512_vnni, at least kPanelMinRows rows): 16 weight rows' super-blocks decoded
//   once per call and transposed so that a vector holds 4 codes of each of the 16 rows; each
//   activation row then takes 4 codes of x broadcast per vpdpbusd (64 products), a vpmulld
//   by the 16 rows' sc16 per 16 columns, and a vpdpwssd per mc16 pair: every weight decode
//   serves all the step's rows, and the output is 16 columns a vector.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "kquant_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kQK = 256;  // columns a super-block
constexpr int64_t kTypeQ4K = 12, kTypeQ5K = 13, kTypeQ6K = 14;  // ggml's type numbers

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kTypeQ4K: return 144;
    case kTypeQ5K: return 176;
    case kTypeQ6K: return 210;
  }
  TORCH_CHECK(false, "kquant: type ", type, " is not a supported K-quant (12 Q4_K, 13 Q5_K, "
              "14 Q6_K)");
  return 0;
}

inline float f16_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// One super-block decoded (see the top of the file).
struct Decoded {
  alignas(64) uint8_t q[kQK];
  alignas(32) int16_t sc16[16];
  alignas(32) int16_t mc16[16];
  float d, dmin;
};

// Q4_K / Q5_K: 8 6-bit scales and mins packed in 12 bytes (ggml's get_scale_min_k4), each
// widened to the two 16-column groups of its sub-block: sc16, mc16.
inline void scale_min_k4(const uint8_t* s, int16_t* sc16, int16_t* mc16) {
  // 32-bit words, as llama.cpp unpacks them: sc 0-3 | sc 4-7 | m 0-3 | m 4-7 (a byte each)
  uint32_t u[4];
  std::memcpy(u, s, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
  const uint32_t m_low = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
  u[2] = m_low;
  u[0] &= low6;
#if defined(__AVX2__)
  // one store each, so the kernel's vector loads of them forward from it
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  const __m128i sc = _mm_unpacklo_epi8(v, v), m = _mm_unpackhi_epi8(v, v);
  _mm256_store_si256(reinterpret_cast<__m256i*>(sc16), _mm256_cvtepu8_epi16(sc));
  _mm256_store_si256(reinterpret_cast<__m256i*>(mc16), _mm256_cvtepu8_epi16(m));
#else
  const uint8_t* b = reinterpret_cast<const uint8_t*>(u);
  for (int g = 0; g < 16; ++g) sc16[g] = b[g / 2], mc16[g] = b[8 + g / 2];
#endif
}

#if defined(__AVX2__)
inline __m256i ld256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline void st256(uint8_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
#endif

// The low 4 bits of each code (Q4_K, Q5_K): qs's 32-byte chunk j holds sub-block 2j in its low
// nibbles and 2j + 1 in its high ones.
inline void nibbles_k4(const uint8_t* qs, uint8_t* q) {
#if defined(__AVX2__)
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i v = ld256(qs + 32 * j);
    st256(q + 64 * j, _mm256_and_si256(v, low4));
    st256(q + 64 * j + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
  }
#else
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = qs[32 * j + l] & 0x0F;
      q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
#endif
}

// Q5_K's fifth bit: bit i of qh[l] belongs to column 32 i + l.
inline void high_bits_k5(const uint8_t* qh, uint8_t* q) {
#if defined(__AVX2__)
  const __m256i h = ld256(qh), one = _mm256_set1_epi8(1);
  for (int i = 0; i < 8; ++i) {
    // byte-wise (h >> i) & 1, then << 4: the 16-bit shifts move no bit across a byte that the
    // mask keeps.
    const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(h, i), one);
    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 32 * i));
    st256(q + 32 * i, _mm256_or_si256(v, _mm256_slli_epi16(bit, 4)));
  }
#else
  for (int i = 0; i < 8; ++i)
    for (int l = 0; l < 32; ++l) q[32 * i + l] |= ((qh[l] >> i) & 1) << 4;
#endif
}

// Q6_K, one half of 128 columns: ql 64 bytes, qh 32 bytes. Column l (l < 32) + 32 k of the
// half: low 4 bits from ql[l + 32 (k & 1)] (low nibble for k < 2, high for k >= 2), high 2
// bits from qh[l] >> 2 k.
inline void codes_q6k_half(const uint8_t* ql, const uint8_t* qh, uint8_t* q) {
#if defined(__AVX2__)
  const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  const __m256i l0 = ld256(ql), l1 = ld256(ql + 32), h = ld256(qh);
  const __m256i lows[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                           _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
  for (int k = 0; k < 4; ++k) {
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * k), three);
    st256(q + 32 * k, _mm256_or_si256(lows[k], _mm256_slli_epi16(hi, 4)));
  }
#else
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < 32; ++l) {
      const uint8_t lo = k < 2 ? ql[l + 32 * k] & 0x0F : ql[l + 32 * (k - 2)] >> 4;
      q[32 * k + l] = lo | (((qh[l] >> (2 * k)) & 3) << 4);
    }
#endif
}

template <int64_t Type>
inline void decode(const uint8_t* b, Decoded& out) {
  int16_t* sc16 = out.sc16;
  if constexpr (Type == kTypeQ6K) {
    codes_q6k_half(b, b + 128, out.q);
    codes_q6k_half(b + 64, b + 160, out.q + 128);
#if defined(__AVX2__)
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(b + 192)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(sc16), sc);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.mc16), _mm256_slli_epi16(sc, 5));
#else
    const int8_t* s = reinterpret_cast<const int8_t*>(b + 192);
    for (int g = 0; g < 16; ++g) sc16[g] = s[g], out.mc16[g] = int16_t(32 * s[g]);
#endif
    out.d = out.dmin = f16_to_f32(b + 208);
  } else {
    scale_min_k4(b + 4, sc16, out.mc16);
    out.d = f16_to_f32(b), out.dmin = f16_to_f32(b + 2);
    if constexpr (Type == kTypeQ5K) {
      nibbles_k4(b + 48, out.q);
      high_bits_k5(b + 16, out.q);
    } else {
      nibbles_k4(b + 16, out.q);
    }
  }
}

using servelm_kquant::RowsQ8K;  // rows rounded to q8_K (kquant_gemm.h)

#if defined(__AVX512BW__)
// The 4 vectors of one scale a column pair (32 pairs a vector: 4 groups of 16 columns).
inline void pair_scales(const Decoded& w, __m512i* sv) {
  const __m512i sc = _mm512_castsi256_si512(ld256(w.sc16));
  for (int c = 0; c < 4; ++c) {
    const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16(int16_t(4 * c)),
                                         _mm512_srli_epi16(
                                             _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24,
                                                              23, 22, 21, 20, 19, 18, 17, 16,
                                                              15, 14, 13, 12, 11, 10, 9, 8,
                                                              7, 6, 5, 4, 3, 2, 1, 0), 3));
    sv[c] = _mm512_permutexvar_epi16(idx, sc);
  }
}

// Per lane, sc16 * (q . xq) over the super-block, exact in 32 bits.
inline __m512i code_dot(const Decoded& w, const __m512i* sv, const int8_t* xq) {
  __m512i acc = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    const __m512i p = _mm512_maddubs_epi16(_mm512_load_si512(w.q + 64 * c),
                                           _mm512_loadu_si512(xq + 64 * c));
#if defined(__AVX512VNNI__)
    acc = _mm512_dpwssd_epi32(acc, p, sv[c]);
#else
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p, sv[c]));
#endif
  }
  return acc;
}
#else
// sum over the super-block of sc16 * (q . xq) for one activation row, exact in 32 bits.
inline int32_t code_dot(const Decoded& w, const int8_t* xq) {
#if defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    const __m256i p = _mm256_maddubs_epi16(
        _mm256_load_si256(reinterpret_cast<const __m256i*>(w.q + 32 * c)), ld256(xq + 32 * c));
    const __m256i s = _mm256_set_m128i(_mm_set1_epi16(w.sc16[2 * c + 1]),
                                       _mm_set1_epi16(w.sc16[2 * c]));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
  }
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  return _mm_cvtsi128_si32(x);
#else
  int32_t acc = 0;
  for (int i = 0; i < kQK; ++i) acc += int32_t(w.q[i]) * xq[i] * w.sc16[i / 16];
  return acc;
#endif
}
#endif

// sum_g mc16_g bsum16_g.
inline int32_t min_dot(const Decoded& w, const int16_t* bsum) {
#if defined(__AVX2__)
  const __m256i p = _mm256_madd_epi16(
      _mm256_load_si256(reinterpret_cast<const __m256i*>(w.mc16)),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum)));
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  return _mm_cvtsi128_si32(x);
#else
  int32_t acc = 0;
  for (int g = 0; g < 16; ++g) acc += int32_t(w.mc16[g]) * bsum[g];
  return acc;
#endif
}

// y[m + r, n] for r < R: one weight row (its super-blocks at `row`) against R activation rows.
template <int64_t Type, int R>
inline void row_dot(const uint8_t* row, int64_t S, const RowsQ8K& x, int64_t m, float* out) {
  constexpr int64_t bytes = Type == kTypeQ4K ? 144 : Type == kTypeQ5K ? 176 : 210;
  Decoded w;
  float acc[R] = {};
  for (int64_t s = 0; s < S; ++s) {
    decode<Type>(row + s * bytes, w);
#if defined(__AVX512BW__)
    __m512i sv[4];
    pair_scales(w, sv);
#endif
    for (int r = 0; r < R; ++r) {
      const int64_t xr = m + r;
      const float xd = x.d[xr * S + s];
      const int8_t* xq = x.q + xr * x.K + s * kQK;
#if defined(__AVX512BW__)
      const int32_t isb = _mm512_reduce_add_epi32(code_dot(w, sv, xq));
#else
      const int32_t isb = code_dot(w, xq);
#endif
      const int32_t imin = min_dot(w, x.bsum + xr * (x.K / 16) + s * 16);
      acc[r] = std::fma(xd * w.d, float(isb), acc[r]);  // the panels' operations (see top)
      acc[r] = std::fma(-(xd * w.dmin), float(imin), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// y[m * ldy + n] for every row m, a weight row (and its decodes) per tile of 4 rows.
template <int64_t Type>
void gemm_by_rows(const RowsQ8K& x, int64_t M, const uint8_t* codes, int64_t N, float* y,
                  int64_t ldy) {
  const int64_t S = x.K / kQK, row_bytes = S * block_bytes(Type);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float out[4];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = codes + n * row_bytes;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        row_dot<Type, 4>(row, S, x, m, out);
        for (int r = 0; r < 4; ++r) y[(m + r) * ldy + n] = out[r];
      }
      for (; m < M; ++m) {
        row_dot<Type, 1>(row, S, x, m, out);
        y[m * ldy + n] = out[0];
      }
    }
  });
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SERVELM_KQUANT_PANELS 1
// Steps of at least this many rows take the panels (ad hoc, one core, Zen 4: see
// docs/quantization.md); below, the decode of 16 rows' super-blocks costs more than it saves.
constexpr int64_t kPanelMinRows = 8;
constexpr int kPanelRows = 16;  // weight rows a panel: one output vector
constexpr int kTileRows = 8;    // activation rows whose sums stay in registers

// One super-block of 16 weight rows, transposed: dword c (columns 4c .. 4c + 3) of the 16 rows
// as one vector; sc16 and the mc16 pairs likewise; d and dmin a lane each. A row past N is 0.
struct alignas(64) PanelBlock {
  int32_t q[64][kPanelRows];
  int32_t sc[16][kPanelRows];
  int32_t mc[8][kPanelRows];  // (mc16[2p], mc16[2p + 1]) as int16 pairs
  float d[kPanelRows], dmin[kPanelRows];
};

// r[i] lane j -> r[j] lane i (16 x 16 dwords).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}

// Super-block s of rows [n0, n0 + rows) into p (rows < 16: the rest zero).
template <int64_t Type>
void unpack_panel(const uint8_t* codes, int64_t row_bytes, int64_t n0, int rows, int64_t s,
                  PanelBlock& p) {
  constexpr int64_t bytes = Type == kTypeQ4K ? 144 : Type == kTypeQ5K ? 176 : 210;
  Decoded dec[kPanelRows];
  for (int n = 0; n < kPanelRows; ++n) {
    if (n < rows) {
      decode<Type>(codes + (n0 + n) * row_bytes + s * bytes, dec[n]);
    } else {
      std::memset(&dec[n], 0, sizeof(Decoded));
    }
    p.d[n] = dec[n].d, p.dmin[n] = dec[n].dmin;
  }
  __m512i r[16];
  for (int b = 0; b < 4; ++b) {
    for (int n = 0; n < kPanelRows; ++n) r[n] = _mm512_load_si512(dec[n].q + 64 * b);
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm512_store_si512(p.q[16 * b + c], r[c]);
  }
  for (int n = 0; n < kPanelRows; ++n) r[n] = _mm512_cvtepi16_epi32(ld256(dec[n].sc16));
  transpose16(r);
  for (int g = 0; g < 16; ++g) _mm512_store_si512(p.sc[g], r[g]);
  for (int n = 0; n < kPanelRows; ++n) r[n] = _mm512_zextsi256_si512(ld256(dec[n].mc16));
  transpose16(r);
  for (int c = 0; c < 8; ++c) _mm512_store_si512(p.mc[c], r[c]);
}

inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// y[(m0 + r) * ldy + n0 + i] for r < R, i in `lanes`: the panel's S super-blocks against R
// activation rows.
template <int R>
void panel_tile(const PanelBlock* P, int64_t S, const RowsQ8K& x, int64_t m0, float* y,
                int64_t ldy, __mmask16 lanes) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const PanelBlock& p = P[s];
    __m512i isb[R];
    for (int r = 0; r < R; ++r) isb[r] = _mm512_setzero_si512();
    for (int g = 0; g < 16; ++g) {
      const __m512i w0 = _mm512_load_si512(p.q[4 * g]), w1 = _mm512_load_si512(p.q[4 * g + 1]);
      const __m512i w2 = _mm512_load_si512(p.q[4 * g + 2]);
      const __m512i w3 = _mm512_load_si512(p.q[4 * g + 3]);
      const __m512i sc = _mm512_load_si512(p.sc[g]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + (m0 + r) * x.K + s * kQK + 16 * g;
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, bcast32(xq));
        t = _mm512_dpbusd_epi32(t, w1, bcast32(xq + 4));
        t = _mm512_dpbusd_epi32(t, w2, bcast32(xq + 8));
        t = _mm512_dpbusd_epi32(t, w3, bcast32(xq + 12));
        isb[r] = _mm512_add_epi32(isb[r], _mm512_mullo_epi32(t, sc));
      }
    }
    const __m512 d = _mm512_load_ps(p.d), dmin = _mm512_load_ps(p.dmin);
    for (int r = 0; r < R; ++r) {
      const int16_t* bsum = x.bsum + (m0 + r) * (x.K / 16) + s * 16;
      __m512i imin = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c)
        imin = _mm512_dpwssd_epi32(imin, _mm512_load_si512(p.mc[c]), bcast32(bsum + 2 * c));
      const __m512 xd = _mm512_set1_ps(x.d[(m0 + r) * S + s]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(xd, d), _mm512_cvtepi32_ps(isb[r]), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(xd, dmin), _mm512_cvtepi32_ps(imin), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * ldy, lanes, acc[r]);
}

template <int R>
void panel_tail(const PanelBlock* P, int64_t S, const RowsQ8K& x, int64_t m0, int64_t rows,
                float* y, int64_t ldy, __mmask16 lanes) {
  if constexpr (R > 1) {
    if (rows < R) return panel_tail<R - 1>(P, S, x, m0, rows, y, ldy, lanes);
  }
  panel_tile<R>(P, S, x, m0, y, ldy, lanes);
}

// y[m * ldy + n] for every row m: a panel of 16 weight rows at a time per thread, each
// super-block decoded once for all M rows.
template <int64_t Type>
void gemm_by_panels(const RowsQ8K& x, int64_t M, const uint8_t* codes, int64_t N, float* y,
                    int64_t ldy) {
  const int64_t S = x.K / kQK, row_bytes = S * block_bytes(Type);
  const int64_t panels = (N + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<PanelBlock> P(S);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * kPanelRows;
      const int rows = int(std::min<int64_t>(kPanelRows, N - n0));
      for (int64_t s = 0; s < S; ++s) unpack_panel<Type>(codes, row_bytes, n0, rows, s, P[s]);
      const __mmask16 lanes = __mmask16((1u << rows) - 1);
      int64_t m = 0;
      for (; m + kTileRows <= M; m += kTileRows)
        panel_tile<kTileRows>(P.data(), S, x, m, y + n0, ldy, lanes);
      if (m < M) panel_tail<kTileRows - 1>(P.data(), S, x, m, M - m, y + n0, ldy, lanes);
    }
  });
}
#endif

// y[m * ldy + n]: a fused layer's part writes its columns of the whole output (ldy its width).
template <int64_t Type>
void gemm_rows(const RowsQ8K& x, int64_t M, const uint8_t* codes, int64_t N, float* y,
               int64_t ldy) {
#if defined(SERVELM_KQUANT_PANELS)
  if (M >= kPanelMinRows) return gemm_by_panels<Type>(x, M, codes, N, y, ldy);
#endif
  gemm_by_rows<Type>(x, M, codes, N, y, ldy);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // a bfloat16 is a float32's top half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One super-block of 256 values: the scalar loop's operations (|x| max, x * (1 / d) rounded
// to nearest even: vcvtps2dq under the default rounding mode, as nearbyint), 16 at a time.
template <typename X>
inline float quantize_block(const X* src, int8_t* q, int16_t* bsum) {
  __m512 v[16];
  __m512 amax = _mm512_setzero_ps();
  for (int g = 0; g < 16; ++g) {
    v[g] = load16(src + 16 * g);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[g]));
  }
  const float dd = _mm512_reduce_max_ps(amax) / 127.0f, inv = dd != 0.0f ? 1.0f / dd : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int g = 0; g < 16; ++g) {
    const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[g], vinv));
    bsum[g] = int16_t(_mm512_reduce_add_epi32(c));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * g), _mm512_cvtepi32_epi8(c));
  }
  return dd;
}
#else
template <typename X>
inline float quantize_block(const X* src, int8_t* q, int16_t* bsum) {
  float buf[kQK];
  float amax = 0.0f;
  for (int64_t k = 0; k < kQK; ++k) {
    buf[k] = float(src[k]);
    amax = std::max(amax, std::fabs(buf[k]));
  }
  const float dd = amax / 127.0f, inv = dd != 0.0f ? 1.0f / dd : 0.0f;
  for (int64_t g = 0; g < 16; ++g) {
    int32_t sum = 0;
    for (int64_t k = 16 * g; k < 16 * g + 16; ++k) {
      const int32_t v = int32_t(std::nearbyint(buf[k] * inv));
      q[k] = int8_t(v);
      sum += v;
    }
    bsum[g] = int16_t(sum);
  }
  return dd;
}
#endif

// x [M, K] float32 / bfloat16 -> q [M, K] int8, d [M, K/256] float32 (amax / 127),
// bsum [M, K/16] int16. q = round-half-even(x / d); d = 0: q = 0. A step of a few rows runs
// on the calling thread: waking the pool costs more than its microseconds of work.
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, int8_t* q, float* d, int16_t* bsum) {
  at::parallel_for(0, M * (K / kQK), 32, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // super-block i of the flat [M, K] rows
      d[i] = quantize_block(x + i * kQK, q + i * kQK, bsum + i * 16);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "kquant: x must be a contiguous [M, K] float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "kquant: x has ", x.size(1), " columns, the weight ", K);
  const int64_t M = x.size(0);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / kQK}, x.options().dtype(at::kFloat));
  at::Tensor bsum = at::empty({M, K / 16}, x.options().dtype(at::kShort));
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                  bsum.data_ptr<int16_t>());
  } else {
    quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                  bsum.data_ptr<int16_t>());
  }
  return {q, d, bsum};
}

// K from the codes' shape, checked: [N, K / 256 * block bytes] uint8.
int64_t check_codes(const at::Tensor& codes, int64_t type, int64_t N, const char* op) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous() && codes.dim() == 2,
              op, ": codes must be a contiguous 2-D uint8 CPU tensor");
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(codes.size(0) == N && codes.size(1) % bytes == 0, op, ": codes ",
              codes.sizes(), " are not ", N, " rows of whole ", bytes, "-byte super-blocks");
  return codes.size(1) / bytes * kQK;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kquant_quantize_act(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kQK == 0,
              "kquant_quantize_act: x must be [M, K] with K % 256 == 0");
  return quantize_x(x, x.size(1));
}

void gemm_type(const RowsQ8K& x, int64_t M, const uint8_t* codes, int64_t type, int64_t N,
               float* y, int64_t ldy) {
  if (type == kTypeQ4K) gemm_rows<kTypeQ4K>(x, M, codes, N, y, ldy);
  else if (type == kTypeQ5K) gemm_rows<kTypeQ5K>(x, M, codes, N, y, ldy);
  else gemm_rows<kTypeQ6K>(x, M, codes, N, y, ldy);
}

// y[M, N] = x @ w.T in x's dtype; w: N rows of `type` super-blocks as the file stores them.
at::Tensor kquant_gemm(const at::Tensor& x, const at::Tensor& codes, int64_t type, int64_t N) {
  const int64_t K = check_codes(codes, type, N, "kquant_gemm");
  auto [q, d, bsum] = quantize_x(x, K);
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  const RowsQ8K rows{q.data_ptr<int8_t>(), d.data_ptr<float>(), bsum.data_ptr<int16_t>(), K};
  gemm_type(rows, x.size(0), codes.data_ptr<uint8_t>(), type, N, y.data_ptr<float>(), N);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// One group of 16 columns: gguf-py's order, (d sc) q - (dmin m); Q6_K: (d sc) (q - 32).
template <int64_t Type>
inline void dequant_group(const Decoded& dec, int g, float* out) {
  const float scale = dec.d * float(dec.sc16[g]), min = dec.dmin * float(dec.mc16[g]);
#if defined(__AVX2__)
  // Written out: GCC 12's vectorizer turned the plain loop into garbage (Q6_K, AVX2 builds).
  const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(dec.q + 16 * g));
  for (int h = 0; h < 2; ++h) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(q, 8) : q));
    if constexpr (Type == kTypeQ6K) {
      v = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_sub_ps(v, _mm256_set1_ps(32.0f)));
    } else {
      v = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(scale), v), _mm256_set1_ps(min));
    }
    _mm256_storeu_ps(out + 8 * h, v);
  }
#else
  for (int i = 0; i < 16; ++i) {
    const float q = float(dec.q[16 * g + i]);
    out[i] = Type == kTypeQ6K ? scale * (q - 32.0f) : scale * q - min;
  }
#endif
}

// One thread: run inside at::parallel_for (its body, or a noinline function it calls) this
// loop left the output unwritten in GCC 12 -O3 builds for AVX2 and AVX-512 (not for SSE2,
// not with -fno-tree-vectorize), and the cause was not found. A matrix is dequantized only
// for a step of many rows, whose GEMM costs more than this.
template <int64_t Type, typename T>
void dequant_rows(const uint8_t* codes, int64_t N, int64_t K, T* w) {
  constexpr int64_t bytes = Type == kTypeQ4K ? 144 : Type == kTypeQ5K ? 176 : 210;
  const int64_t S = K / kQK;
  Decoded dec;
  alignas(32) float group[16];
  for (int64_t n = 0; n < N; ++n)
    for (int64_t s = 0; s < S; ++s) {
      decode<Type>(codes + (n * S + s) * bytes, dec);
      T* out = w + n * K + s * kQK;
      for (int g = 0; g < 16; ++g) {
        dequant_group<Type>(dec, g, group);
        for (int i = 0; i < 16; ++i) out[16 * g + i] = T(group[i]);
      }
    }
}

// The float weight [N, K] (float32 or bfloat16) the codes stand for.
at::Tensor kquant_dequant(const at::Tensor& codes, int64_t type, int64_t N, at::ScalarType dtype) {
  const int64_t K = check_codes(codes, type, N, "kquant_dequant");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "kquant_dequant: dtype must be float32 or bfloat16");
  at::Tensor w = at::empty({N, K}, codes.options().dtype(dtype));
  const uint8_t* pc = codes.data_ptr<uint8_t>();
  auto run = [&](auto* out) {
    using T = std::remove_pointer_t<decltype(out)>;
    if (type == kTypeQ4K) dequant_rows<kTypeQ4K, T>(pc, N, K, out);
    else if (type == kTypeQ5K) dequant_rows<kTypeQ5K, T>(pc, N, K, out);
    else dequant_rows<kTypeQ6K, T>(pc, N, K, out);
  };
  if (dtype == at::kFloat) run(w.data_ptr<float>());
  else run(w.data_ptr<c10::BFloat16>());
  return w;
}

}  // namespace

namespace servelm_kquant {

RowsQ8K QuantizedRows::rows() const {
  return {q.data_ptr<int8_t>(), d.data_ptr<float>(), bsum.data_ptr<int16_t>(), q.size(1)};
}

QuantizedRows quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kQK == 0,
              "kquant quantize_rows: x must be [M, K] with K % 256 == 0");
  auto [q, d, bsum] = quantize_x(x, x.size(1));
  return {q, d, bsum};
}

void gemm(const QuantizedRows& x, const at::Tensor& codes, int64_t type, int64_t N, float* y,
          int64_t ldy) {
  const int64_t K = check_codes(codes, type, N, "kquant gemm");
  TORCH_CHECK(x.q.size(1) == K, "kquant gemm: x has ", x.q.size(1), " columns, the weight ", K);
  TORCH_CHECK(ldy >= N, "kquant gemm: ldy ", ldy, " < N ", N);
  gemm_type(x.rows(), x.q.size(0), codes.data_ptr<uint8_t>(), type, N, y, ldy);
}

at::Tensor dequant(const at::Tensor& codes, int64_t type, int64_t N, at::ScalarType dtype) {
  return kquant_dequant(codes, type, N, dtype);
}

}  // namespace servelm_kquant

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("kquant_gemm(Tensor x, Tensor codes, int type, int n) -> Tensor", &kquant_gemm);
  m.def("kquant_dequant(Tensor codes, int type, int n, ScalarType dtype) -> Tensor",
        &kquant_dequant);
  m.def("kquant_quantize_act(Tensor x) -> (Tensor, Tensor, Tensor)", &kquant_quantize_act);
}
