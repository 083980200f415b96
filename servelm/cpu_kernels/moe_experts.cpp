// Routed experts of a mixture-of-experts layer for small batches (decode), float32, SiLU:
// the tokens' rows arrive grouped by expert (servelm/layers/moe.py sorts the assignments),
// and each expert's weights are streamed once for all of its rows.
//
//   x:    [N, H]   rows, expert 0's first, then expert 1's, ...   counts: [E] rows per expert
//   w13:  [E, 2I, H]  [gate | up] per expert        w2: [E, H, I]
//   out:  [N, H]   row r of expert e: w2[e] @ (silu(w13[e][:I] @ x_r) * (w13[e][I:] @ x_r))
//
// Two passes, each one parallel loop over (expert, tile of output rows) work items, so both
// threads stream weights even when one expert has all the tokens:
//   1. h[r, i] = silu(gate_i . x_r) * (up_i . x_r)      tiles of 16 of the I rows
//   2. out[r, j] = w2[e][j] . h[r]                       tiles of 16 of the H rows
// A weight row is loaded once and multiplied into up to kRows token rows' accumulators. For
// large segments (prefill) aten's blocked GEMMs are faster: the caller keeps those.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec16.h"

namespace {

using namespace servelm_cpu;
constexpr int64_t kTile = 16;  // output rows per work item
constexpr int kRows = 4;       // token rows sharing one pass over a weight row

// acc[r] = sum_k w[k] * x[r][k] for n <= kRows rows of length len (vectors, then the tail).
inline void dots(const float* w, const float* const* x, int n, int64_t len, float* acc) {
  f32x16 v[kRows];
  for (int r = 0; r < n; ++r) v[r] = splat(0.0f);
  int64_t k = 0;
  for (; k + 16 <= len; k += 16) {
    const f32x16 wk = load16(w + k);
    for (int r = 0; r < n; ++r) v[r] += wk * load16(x[r] + k);
  }
  for (int r = 0; r < n; ++r) {
    float s = lane_sum(v[r]);
    for (int64_t t = k; t < len; ++t) s += w[t] * x[r][t];
    acc[r] = s;
  }
}

struct Segment {
  int64_t expert, start, rows;
};

void check(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w13,
           const at::Tensor& w2) {
  TORCH_CHECK(x.device().is_cpu() && w13.device().is_cpu() && w2.device().is_cpu(),
              "moe_experts: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w13.scalar_type() == at::kFloat &&
                  w2.scalar_type() == at::kFloat,
              "moe_experts: float32 rows and weights only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w13.dim() == 3 && w13.is_contiguous() &&
                  w2.dim() == 3 && w2.is_contiguous(),
              "moe_experts: x [N, H], w13 [E, 2I, H], w2 [E, H, I], all contiguous");
  const int64_t E = w13.size(0), H = x.size(1), I = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H &&
                  w2.size(2) == I,
              "moe_experts: w13 must be [E, 2I, H] and w2 [E, H, I] for rows of ", H);
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 1 && counts.numel() == E &&
                  counts.is_contiguous(),
              "moe_experts: counts must be int64 [E]");
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(counts.data_ptr<int64_t>()[e] >= 0, "moe_experts: a negative count");
    total += counts.data_ptr<int64_t>()[e];
  }
  TORCH_CHECK(total == x.size(0), "moe_experts: counts sum to ", total, ", x has ", x.size(0),
              " rows");
}

// Calls fn(segment, first output row, last) over (expert, tile) items, threads sharing them.
template <typename Fn>
void for_tiles(const std::vector<Segment>& segs, int64_t rows_out, Fn fn) {
  const int64_t tiles = (rows_out + kTile - 1) / kTile;
  const int64_t items = int64_t(segs.size()) * tiles;
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t it = 0; it < items; ++it) {
    const Segment& s = segs[it / tiles];
    const int64_t lo = (it % tiles) * kTile;
    fn(s, lo, std::min(rows_out, lo + kTile));
  }
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w13,
                       const at::Tensor& w2) {
  check(x, counts, w13, w2);
  const int64_t N = x.size(0), H = x.size(1), I = w13.size(1) / 2;
  std::vector<Segment> segs;
  int64_t start = 0;
  for (int64_t e = 0; e < counts.numel(); ++e) {
    const int64_t n = counts.data_ptr<int64_t>()[e];
    if (n) segs.push_back({e, start, n});
    start += n;
  }
  at::Tensor h = at::empty({N, I}, x.options());
  at::Tensor out = at::empty({N, H}, x.options());
  const float *xp = x.data_ptr<float>(), *w13p = w13.data_ptr<float>(), *w2p = w2.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *op = out.data_ptr<float>();
  for_tiles(segs, I, [&](const Segment& s, int64_t lo, int64_t hi) {
    const float* w = w13p + s.expert * 2 * I * H;
    for (int64_t r0 = 0; r0 < s.rows; r0 += kRows) {
      const int n = int(std::min<int64_t>(kRows, s.rows - r0));
      const float* rows[kRows];
      for (int r = 0; r < n; ++r) rows[r] = xp + (s.start + r0 + r) * H;
      for (int64_t i = lo; i < hi; ++i) {
        float gate[kRows], up[kRows];
        dots(w + i * H, rows, n, H, gate);
        dots(w + (I + i) * H, rows, n, H, up);
        for (int r = 0; r < n; ++r)
          hp[(s.start + r0 + r) * I + i] = gate[r] / (1.0f + std::exp(-gate[r])) * up[r];
      }
    }
  });
  for_tiles(segs, H, [&](const Segment& s, int64_t lo, int64_t hi) {
    const float* w = w2p + s.expert * H * I;
    for (int64_t r0 = 0; r0 < s.rows; r0 += kRows) {
      const int n = int(std::min<int64_t>(kRows, s.rows - r0));
      const float* rows[kRows];
      for (int r = 0; r < n; ++r) rows[r] = hp + (s.start + r0 + r) * I;
      for (int64_t j = lo; j < hi; ++j) {
        float acc[kRows];
        dots(w + j * I, rows, n, I, acc);
        for (int r = 0; r < n; ++r) op[(s.start + r0 + r) * H + j] = acc[r];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("moe_experts(Tensor x, Tensor counts, Tensor w13, Tensor w2) -> Tensor", &moe_experts);
}
