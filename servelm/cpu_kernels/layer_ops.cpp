// Fused versions of the model layers' small ops, for the CPU path: float32 or bfloat16 rows
// (the dtype of x; float32 arithmetic inside, a bfloat16 result rounded once to nearest even).
//
// In eager torch each of these is several ops (a residual add + RMSNorm is ~8: add, pow,
// mean, add, rsqrt, mul, mul, type_as), each one a pass over memory, a temporary and, on
// the CPU, a parallel region. A 64-sequence decode step of a 30-layer model ran ~900 of
// them. Here each is one pass. Rows are shared out in chunks of at least kGrain elements
// (a decode step's [64, 576] norm: 2 chunks; 16K measured 70 -> 40 us per call at 2
// threads against 64K, which kept it on one thread).
//
//   rms_norm(x [T, N], weight [N], eps) -> norm(x) * weight
//   add_rms_norm(x, residual, weight, eps) -> (norm(x + residual) * weight, x + residual)
//   rotary_(q [T, H, D], k [T, K, D], positions [T], cos, sin [P, D/2])  rotate-half, in place
//   silu_and_mul(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:]
//
// In bfloat16, x + residual is rounded to bfloat16 before it is normalised (the sum is what
// the next layer adds to, as eager torch keeps it), and weights may be float32 or bfloat16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>

#include "vec16.h"

namespace {

using namespace servelm_cpu;
using c10::BFloat16;
constexpr int64_t kGrain = 1 << 14;  // elements

int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_len)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be a contiguous float32 or bfloat16 CPU tensor");
}

// out = norm(x + residual) * weight, and sum = x + residual when there is a residual.
template <typename T, typename W>
void rms_norm_rows(const T* px, const T* residual, const W* pw, int64_t n, int64_t rows,
                   float eps, T* po, T* sum) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = px + r * n;
      T* orow = po + r * n;
      // Sixteen lanes of fused squares, then the lanes in order, then the tail: a fixed
      // order per row length, whatever the row's address or the batch (deterministic mode
      // relies on it; an omp simd reduction leaves the order to the compiler).
      f32x16 lanes = f32x16{};
      int64_t i = 0;
      if (residual != nullptr) {
        const T* rr = residual + r * n;
        T* sr = sum + r * n;
        for (; i + 16 <= n; i += 16) {
          const f32x16 v = as_stored(load16(src + i) + load16(rr + i), src);
          store16(sr + i, v);
          lanes = fma16(v, v, lanes);
        }
        for (int64_t j = i; j < n; ++j) sr[j] = T(float(src[j]) + float(rr[j]));
        src = sr;
      } else {
        for (; i + 16 <= n; i += 16) {
          const f32x16 v = load16(src + i);
          lanes = fma16(v, v, lanes);
        }
      }
      float squares = lane_sum(lanes);
      for (; i < n; ++i) squares = std::fma(float(src[i]), float(src[i]), squares);
      const float inv = 1.0f / std::sqrt(squares / float(n) + eps);
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) store16(orow + j, load16(src + j) * inv * load16(pw + j));
      for (; j < n; ++j) orow[j] = T(float(src[j]) * inv * float(pw[j]));
    }
  });
}

// The dtype pair of (x, weight): x's rows float32 or bfloat16, weight either.
template <typename F>
void dispatch_rows(const at::Tensor& x, const at::Tensor& weight, const char* name, F&& f) {
  check_rows(x, name);
  check_rows(weight, name);
  const bool wf = weight.scalar_type() == at::kFloat;
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(wf, name, ": a float32 x takes a float32 weight");
    f(x.data_ptr<float>(), weight.data_ptr<float>());
  } else if (wf) {
    f(x.data_ptr<BFloat16>(), weight.data_ptr<float>());
  } else {
    f(x.data_ptr<BFloat16>(), weight.data_ptr<BFloat16>());
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(1, n);
  TORCH_CHECK(weight.numel() == n, "rms_norm: weight must have x's last dimension");
  at::Tensor out = at::empty_like(x);
  dispatch_rows(x, weight, "rms_norm", [&](auto* px, auto* pw) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(px)>>;
    rms_norm_rows<T>(px, nullptr, pw, n, rows, float(eps), out.data_ptr<T>(), nullptr);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(residual, "add_rms_norm: residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must have x's shape and dtype");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(1, n);
  TORCH_CHECK(weight.numel() == n, "add_rms_norm: weight must have x's last dimension");
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  dispatch_rows(x, weight, "add_rms_norm", [&](auto* px, auto* pw) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(px)>>;
    rms_norm_rows<T>(px, residual.data_ptr<T>(), pw, n, rows, float(eps), out.data_ptr<T>(),
                     sum.data_ptr<T>());
  });
  return {out, sum};
}

template <typename T>
void rotate_rows(T* const bases[2], const int64_t heads[2], const int64_t strides[2][2],
                 const int64_t* pos, const float* pc, const float* psn, int64_t T_, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_, grain_rows((heads[0] + heads[1]) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = pc + pos[t] * half;
      const float* s = psn + pos[t] * half;
      for (int which = 0; which < 2; ++which)
        for (int64_t h = 0; h < heads[which]; ++h) {
          T* x = bases[which] + t * strides[which][0] + h * strides[which][1];
          int64_t i = 0;
          for (; i + 16 <= half; i += 16) {  // 16 pairs a step (bf16: widened and rounded once)
            const f32x16 x1 = load16(x + i), x2 = load16(x + i + half);
            const f32x16 cc = load16(c + i), ss = load16(s + i);
            store16(x + i, x1 * cc - x2 * ss);
            store16(x + i + half, x2 * cc + x1 * ss);
          }
          for (; i < half; ++i) {
            const float x1 = float(x[i]), x2 = float(x[i + half]);
            x[i] = T(x1 * c[i] - x2 * s[i]);
            x[i + half] = T(x2 * c[i] + x1 * s[i]);
          }
        }
    }
  });
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin) {
  const bool f32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK((f32 || q.scalar_type() == at::kBFloat16) && k.scalar_type() == q.scalar_type() &&
                  q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 &&
                  q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rotary_: q [T, H, D] and k [T, K, D] must be float32 or bfloat16 (both the same) "
              "with contiguous rows");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_: cos and sin must be float32");
  check_rows(cos, "rotary_: cos");
  check_rows(sin, "rotary_: sin");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2, P = cos.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rotary_: cos and sin must be [positions, D/2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == T,
              "rotary_: positions must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rotary_: position ", pos[t], " outside the table of ", P);
  const int64_t heads[2] = {q.size(1), k.size(1)};
  const int64_t strides[2][2] = {{q.stride(0), q.stride(1)}, {k.stride(0), k.stride(1)}};
  if (f32) {
    float* const bases[2] = {q.data_ptr<float>(), k.data_ptr<float>()};
    rotate_rows(bases, heads, strides, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), T, D);
  } else {
    BFloat16* const bases[2] = {q.data_ptr<BFloat16>(), k.data_ptr<BFloat16>()};
    rotate_rows(bases, heads, strides, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), T, D);
  }
}

template <typename T>
void silu_mul_rows(const T* px, T* po, int64_t T_, int64_t I) {
  at::parallel_for(0, T_, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = px + t * 2 * I;
      const T* up = gate + I;
      T* o = po + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {
        const f32x16 g = load16(gate + i);
        store16(o + i, g / (1.0f + exp16(-g)) * load16(up + i));
      }
      for (; i < I; ++i) {
        const float g = float(gate[i]);
        o[i] = T(g / (1.0f + std::exp(-g)) * float(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul: x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), T, I);
  else
    silu_mul_rows(x.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), T, I);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &add_rms_norm);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()",
        &rotary_);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
}
