// Multi-head latent attention (DeepSeek-V2/V3) decodes on the CPU, reading the paged cache
// in place. A token's cache entry is one row shared by every head:
//
//   cache: [num_slots, E]   E = L + R = [ latent (kv_lora_rank L) | rope key (R) ]
//   q:     [B, H, E]        the key up-projection already absorbed into q (latent space)
//   out:   [B, H, L]        softmax(q . entry) weighted sum of the entries' latent parts
//
// (the caller applies the value up-projection to out). This is attention with one KV head
// of E dims whose values are the first L dims of the keys: each entry row is loaded once
// for all the work item's heads. A work item is (sequence, a group of up to kHeads heads);
// with fewer sequences than threads the groups get smaller, so one decode still spreads over
// every thread (each then reads the entries for its heads). The context is walked in tiles of 16
// positions; per head and tile the 16 scores, their max and exponentials, then the online
// softmax update of the head's L-dim accumulator (fp32, in per-thread scratch: L is 512 for
// DeepSeek, too big for registers across heads).
// Any E and L (L <= E): a row's last chunk of fewer than 16 values is read lane by lane,
// never past the row's end, its other lanes 0 (the tiny test checkpoints' E = 40); widths
// that are multiples of 16 (DeepSeek's 576 and 512) take no partial chunk. The cache holds
// float32 or bfloat16, q float32 or bfloat16; the output is float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_tables.h"
#include "vec16.h"

namespace {

using namespace servelm_cpu;
constexpr int kTile = 16;
constexpr int64_t kHeads = 16;  // heads per work item

struct MlaProblem {
  const void* cache;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* seq_lens;
  int64_t num_heads, entry_dim, latent_dim, block_size;
  float* out;  // [B, H, L]
};

// The n (< 16) values at p in lanes 0..n-1, 0 in the others, reading p[0..n-1] only.
template <typename V>
inline f32x16 load_part(const V* p, int64_t n) {
  V part[16] = {};
  std::memcpy(part, p, size_t(n) * sizeof(V));
  return load16(part);
}

template <typename KV>
void mla_item(const MlaProblem& p, const at::Tensor& q, int64_t b, int64_t h0, int64_t heads,
              float scale, std::vector<f32x16>& qs, std::vector<f32x16>& acc) {
  const int64_t E = p.entry_dim, L = p.latent_dim;
  // whole chunks of 16, then the partial one (its size; 0: none)
  const int64_t e_full = E / 16, e_tail = E % 16, l_full = L / 16, l_tail = L % 16;
  const int64_t ec = e_full + (e_tail > 0), lc = l_full + (l_tail > 0);
  const bool bf16_q = q.scalar_type() == at::kBFloat16;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t c = 0; c < ec; ++c) {
      const int64_t off = b * q.stride(0) + (h0 + h) * q.stride(1) + 16 * c;
      const int64_t n = c < e_full ? 16 : e_tail;
      f32x16 v;
      if (bf16_q) {
        const bf16* src = reinterpret_cast<const bf16*>(q.data_ptr<at::BFloat16>()) + off;
        v = n == 16 ? load16(src) : load_part(src, n);
      } else {
        const float* src = q.data_ptr<float>() + off;
        v = n == 16 ? load16(src) : load_part(src, n);
      }
      qs[h * ec + c] = v * scale;
    }
  }
  std::fill(acc.begin(), acc.begin() + heads * lc, splat(0.0f));
  std::vector<float> mx(heads, -std::numeric_limits<float>::infinity()), sum(heads, 0.0f);
  const KV* base = static_cast<const KV*>(p.cache);
  const int64_t* table = p.tables + b * p.table_stride;
  const int64_t len = p.seq_lens[b], bs = p.block_size;
  const KV* rows[kTile];
  float scores[kTile];
  for (int64_t start = 0; start < len; start += kTile) {
    const int n = int(std::min<int64_t>(kTile, len - start));
    for (int t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      rows[t] = base + (table[pos / bs] * bs + pos % bs) * E;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const f32x16* qh = &qs[h * ec];
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < n; ++t) {
        f32x16 d = e_full ? qh[0] * load16(rows[t]) : splat(0.0f);
        for (int64_t c = 1; c < e_full; ++c) d += qh[c] * load16(rows[t] + 16 * c);
        if (e_tail) d += qh[e_full] * load_part(rows[t] + 16 * e_full, e_tail);
        scores[t] = lane_sum(d);
        tile_max = std::max(tile_max, scores[t]);
      }
      f32x16* a = &acc[h * lc];
      float alpha = 1.0f;
      if (tile_max > mx[h]) {  // what came before is rescaled to the new max below
        alpha = exp16(splat(mx[h] - tile_max))[0];
        sum[h] *= alpha;
        mx[h] = tile_max;
      }
      f32x16 s = splat(mx[h]);
      for (int t = 0; t < n; ++t) s[t] = scores[t];
      f32x16 e = exp16(s - mx[h]);
      e = keep_first(e, n, 0.0f);  // lanes past the context weigh nothing
      sum[h] += lane_sum(e);
      // chunk by chunk, so one accumulator vector stays in a register over the tile's rows
      for (int64_t c = 0; c < l_full; ++c) {
        f32x16 v = a[c] * alpha;
        for (int t = 0; t < n; ++t) v += e[t] * load16(rows[t] + 16 * c);
        a[c] = v;
      }
      if (l_tail) {
        f32x16 v = a[l_full] * alpha;
        for (int t = 0; t < n; ++t) v += e[t] * load_part(rows[t] + 16 * l_full, l_tail);
        a[l_full] = v;
      }
    }
  }
  float* out = p.out + (b * p.num_heads + h0) * p.latent_dim;
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.0f / sum[h];
    for (int64_t c = 0; c < l_full; ++c) store16(out + h * L + 16 * c, acc[h * lc + c] * inv);
    if (l_tail) {
      float part[16];
      store16(part, acc[h * lc + l_full] * inv);
      std::memcpy(out + h * L + 16 * l_full, part, size_t(l_tail) * sizeof(float));
    }
  }
}

void check_mla(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, int64_t block_size, int64_t latent_dim) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "paged_decode_mla: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "paged_decode_mla: q must be float32 or bfloat16 [B, H, E], rows contiguous");
  TORCH_CHECK(cache.dim() == 2 && cache.is_contiguous() &&
                  (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16),
              "paged_decode_mla: cache must be contiguous float32 or bfloat16 [num_slots, E]");
  const int64_t E = cache.size(1);
  TORCH_CHECK(q.size(2) == E && latent_dim > 0 && latent_dim <= E,
              "paged_decode_mla: q's last dim must equal the entry's E, and 0 < latent_dim <= E");
  check_paged_tables("paged_decode_mla", block_tables, seq_lens, q.size(0), cache.size(0),
                     block_size);
}

at::Tensor paged_decode_mla(const at::Tensor& q, const at::Tensor& cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            int64_t block_size, double scale, int64_t latent_dim) {
  check_mla(q, cache, block_tables, seq_lens, block_size, latent_dim);
  const int64_t B = q.size(0), H = q.size(1), E = cache.size(1);
  at::Tensor out = at::empty({B, H, latent_dim}, q.options().dtype(at::kFloat));
  const MlaProblem p{cache.data_ptr(), block_tables.data_ptr<int64_t>(), block_tables.stride(0),
                     seq_lens.data_ptr<int64_t>(), H, E, latent_dim, block_size,
                     out.data_ptr<float>()};
  // Heads per item: up to kHeads (each entry row loaded once for them), fewer when there are
  // too few sequences to give every thread an item (one decode: the heads split over threads).
  const int64_t threads_wanted = at::get_num_threads();
  const int64_t per_seq = std::max<int64_t>(1, (threads_wanted + B - 1) / B);
  const int64_t heads_per_item =
      std::max<int64_t>(1, std::min<int64_t>(kHeads, (H + per_seq - 1) / per_seq));
  const int64_t groups = (H + heads_per_item - 1) / heads_per_item, items = B * groups;
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(threads_wanted, items)));
  const bool bf16_cache = cache.scalar_type() == at::kBFloat16;
#pragma omp parallel num_threads(threads)
  {
    std::vector<f32x16> qs(kHeads * ((E + 15) / 16)), acc(kHeads * ((latent_dim + 15) / 16));
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t b = i / groups, h0 = (i % groups) * heads_per_item;
      const int64_t heads = std::min<int64_t>(heads_per_item, H - h0);
      if (bf16_cache)
        mla_item<bf16>(p, q, b, h0, heads, float(scale), qs, acc);
      else
        mla_item<float>(p, q, b, h0, heads, float(scale), qs, acc);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("paged_decode_mla(Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, "
        "int block_size, float scale, int latent_dim) -> Tensor",
        &paged_decode_mla);
}
