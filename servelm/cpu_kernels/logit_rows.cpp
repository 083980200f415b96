// The head's logits, row by row, in one pass each: float32 values, the argmax, and how many
// logits lie within one bfloat16 step of the maximum.
//
//   logit_rows(x [N, V] float32 | bfloat16 | float16) -> (logits [N, V] float32,
//                                                         argmax [N] int64, near [N] int32)
//
// A decode step of 64 sequences over a 49,152-token vocabulary has 3.1M logits, and the
// runner's eager path walked them six times (the float32 copy, max, >=, sum, argmax, and the
// sampler's argmax again), each a parallel region over a row-major reduction. Here one
// thread takes a row: it converts and stores it while keeping each lane's running maximum
// and where it first occurred (a scalar search for the maximum's first index afterwards
// was ~10 us a row of this vocabulary), then counts the near logits in the row it just
// wrote (still in its L2). `near` is what servelm/runner/logits.py needs to know whether a 16-bit
// head left a tie to recompute in float32; a row with near == 1 has a clear maximum.
//
// Agrees with torch: argmax is the first index of the maximum, and a row holding a NaN has
// the first NaN as its argmax (torch treats NaN as the largest value); such a row, and a row
// whose maximum is infinite, has near = 1 (nothing a recomputation could decide).
// One bfloat16 step at the maximum's magnitude: 2^(floor(log2 |max|) - 7) (a float16 step is
// finer, so it is covered too). x float32 is returned as it is (no copy).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "vec16.h"

namespace {

using namespace servelm_cpu;
using c10::BFloat16;
using c10::Half;

inline f32x16 load_row16(const float* p) { return load16(p); }
inline f32x16 load_row16(const BFloat16* p) { return load16(p); }
inline f32x16 load_row16(const Half* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(SERVELM_VEC16_HALVES) && defined(__F16C__)
  return join8(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
               _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + 1)));
#else
  f32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = float(p[i]);
  return v;
#endif
}

// One row: out[0..V) = x[0..V) as float32 (skipped when T is float: out is x), returns
// (argmax, near).
template <typename T>
std::pair<int64_t, int32_t> one_row(const T* x, float* out, int64_t V) {
  constexpr bool kCopy = !std::is_same<T, float>::value;
  const float lowest = -std::numeric_limits<float>::infinity();
  // each lane's maximum and where it first occurs (a strictly greater value moves it)
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  f32x16 vmax = splat(lowest);
  i32x16 vfirst = lane, vnan = i32x16{};
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const f32x16 v = load_row16(x + i);
    if (kCopy) store16(out + i, v);
    const i32x16 up = gt_mask16(v, vmax);
    vmax = select16(up, v, vmax);
    vfirst = select16(up, lane + int32_t(i), vfirst);
    vnan |= nan_mask16(v);
  }
  // the row's maximum; its first index: the least of the first indices of the lanes that
  // hold it (all -inf: index 0, as torch)
  float m = lowest;
  bool nan = false;
  for (int l = 0; l < 16; ++l) {
    m = vmax[l] > m ? vmax[l] : m;
    nan |= vnan[l] != 0;
  }
  int64_t first = 0;
  if (i > 0) {
    first = V;
    for (int l = 0; l < 16; ++l)
      if (vmax[l] == m) first = std::min<int64_t>(first, vfirst[l]);
  }
  for (; i < V; ++i) {
    const float v = float(x[i]);
    if (kCopy) out[i] = v;
    if (v > m) m = v, first = i;
    nan |= v != v;
  }
  const float* row = kCopy ? out : reinterpret_cast<const float*>(x);
  if (nan) {
    int64_t j = 0;
    while (!(row[j] != row[j])) ++j;
    return {j, 1};
  }
  if (!std::isfinite(m)) return {first, 1};
  int e = 0;
  std::frexp(m, &e);  // |m| = f * 2^e, f in [0.5, 1): floor(log2 |m|) = e - 1
  const float threshold = m - std::ldexp(1.0f, e - 8);
  const f32x16 vt = splat(threshold);
  i32x16 vcount = i32x16{};
  int64_t j = 0;
  for (; j + 16 <= V; j += 16) vcount -= ge_mask16(load16(row + j), vt);  // true is -1
  int32_t near = 0;
  for (int l = 0; l < 16; ++l) near += vcount[l];
  for (; j < V; ++j) near += row[j] >= threshold;
  return {first, near};
}

template <typename T>
void rows(const T* x, float* out, int64_t* argmax, int32_t* near, int64_t N, int64_t V) {
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const auto r = one_row(x + n * V, out + n * V, V);
      argmax[n] = r.first;
      near[n] = r.second;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> logit_rows(const at::Tensor& x) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() == 2 && x.size(1) > 0 &&
                  (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf),
              "logit_rows: x must be a contiguous CPU [N, V] float32, bfloat16 or float16 "
              "tensor with V > 0, got ", x.scalar_type(), " ", x.sizes());
  const int64_t N = x.size(0), V = x.size(1);
  at::Tensor out = dt == at::kFloat ? x : at::empty({N, V}, x.options().dtype(at::kFloat));
  at::Tensor argmax = at::empty({N}, x.options().dtype(at::kLong));
  at::Tensor near = at::empty({N}, x.options().dtype(at::kInt));
  float* po = out.data_ptr<float>();
  int64_t* pa = argmax.data_ptr<int64_t>();
  int32_t* pn = near.data_ptr<int32_t>();
  if (dt == at::kFloat)
    rows(x.data_ptr<float>(), po, pa, pn, N, V);
  else if (dt == at::kBFloat16)
    rows(x.data_ptr<BFloat16>(), po, pa, pn, N, V);
  else
    rows(x.data_ptr<Half>(), po, pa, pn, N, V);
  return {out, argmax, near};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("logit_rows(Tensor x) -> (Tensor, Tensor, Tensor)", &logit_rows);
}
