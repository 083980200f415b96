// Fused float32 versions of the model layers' small ops, for the CPU path.
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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "vec16.h"

namespace {

using namespace servelm_cpu;
constexpr int64_t kGrain = 1 << 14;  // elements

int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_len)); }

void check_f32_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor");
}

// out = norm(x + residual) * weight, and sum = x + residual when there is a residual.
void rms_norm_rows(const at::Tensor& x, const float* residual, const at::Tensor& weight,
                   double eps, at::Tensor& out, float* sum) {
  check_f32_rows(x, "rms_norm: x");
  check_f32_rows(weight, "rms_norm: weight");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(1, n);
  TORCH_CHECK(weight.numel() == n, "rms_norm: weight must have x's last dimension");
  const float* px = x.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float feps = float(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = px + r * n;
      float* orow = po + r * n;
      // Sixteen lanes of fused squares, then the lanes in order, then the tail: a fixed
      // order per row length, whatever the row's address or the batch (deterministic mode
      // relies on it; an omp simd reduction leaves the order to the compiler).
      f32x16 lanes = f32x16{};
      int64_t i = 0;
      if (residual != nullptr) {
        const float* rr = residual + r * n;
        float* sr = sum + r * n;
        for (; i + 16 <= n; i += 16) {
          const f32x16 v = load16(src + i) + load16(rr + i);
          store16(sr + i, v);
          lanes = fma16(v, v, lanes);
        }
        for (int64_t j = i; j < n; ++j) sr[j] = src[j] + rr[j];
        src = sr;
      } else {
        for (; i + 16 <= n; i += 16) {
          const f32x16 v = load16(src + i);
          lanes = fma16(v, v, lanes);
        }
      }
      float squares = lane_sum(lanes);
      for (; i < n; ++i) squares = std::fma(src[i], src[i], squares);
      const float inv = 1.0f / std::sqrt(squares / float(n) + feps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = src[i] * inv * pw[i];
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x);
  rms_norm_rows(x, nullptr, weight, eps, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_f32_rows(residual, "add_rms_norm: residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual must have x's shape");
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  rms_norm_rows(x, residual.data_ptr<float>(), weight, eps, out, sum.data_ptr<float>());
  return {out, sum};
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && q.dim() == 3 &&
                  k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rotary_: q [T, H, D] and k [T, K, D] must be float32 with contiguous rows");
  check_f32_rows(cos, "rotary_: cos");
  check_f32_rows(sin, "rotary_: sin");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2, P = cos.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rotary_: cos and sin must be [positions, D/2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == T,
              "rotary_: positions must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rotary_: position ", pos[t], " outside the table of ", P);
  const float* pc = cos.data_ptr<float>();
  const float* psn = sin.data_ptr<float>();
  const int64_t heads[2] = {q.size(1), k.size(1)};
  const int64_t strides[2][2] = {{q.stride(0), q.stride(1)}, {k.stride(0), k.stride(1)}};
  float* bases[2] = {q.data_ptr<float>(), k.data_ptr<float>()};
  at::parallel_for(0, T, grain_rows((heads[0] + heads[1]) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = pc + pos[t] * half;
      const float* s = psn + pos[t] * half;
      for (int which = 0; which < 2; ++which)
        for (int64_t h = 0; h < heads[which]; ++h) {
          float* x = bases[which] + t * strides[which][0] + h * strides[which][1];
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i] + x1 * s[i];
          }
        }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_f32_rows(x, "silu_and_mul: x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  const float* px = x.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = px + t * 2 * I;
      const float* up = gate + I;
      float* o = po + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {
        const f32x16 g = load16(gate + i);
        store16(o + i, g / (1.0f + exp16(-g)) * load16(up + i));
      }
      for (; i < I; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
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
