// Paged attention on the CPU for prompt chunks: each query row of a chunk attends its
// sequence's positions up to its own, read where they lie in the paged KV cache (the chunk's
// own K/V are stored first). One call takes every prefilling sequence of a step, fresh or
// after cached context, with no gather, no padding and no [Q, C] mask.
//
//   q: [T, H, D] bfloat16, the step's prefill rows; sequence s owns rows
//      query_start[s] .. query_start[s + 1] - 1, at positions context_lens[s] + i
//   k_cache, v_cache: [num_slots, K, D] bfloat16; block_tables [S, max_blocks]
//   out: [T, H, D] float32
//
// The decode kernel (paged_attention.cpp) holds one query row against a stream of keys, so
// it sums each key's products across lanes. A chunk has many rows, so here the lanes are 16
// query vectors of one KV head (row r, group head g, flattened), and a key is broadcast to
// them: a tile of 16 keys gives 16 score vectors straight out of vdpbf16ps (32 products an
// instruction; the key's bfloat16 pairs broadcast from where they lie), the online softmax
// runs lane-wise (the running max and sum are vectors, no reduction across lanes), and the
// values go in as float32 (a tile's V rows widened once, each element broadcast to the 16
// lanes, the weights kept float32). Products of stored bfloat16 values are exact in float32
// and every sum is float32, as in the decode kernel; only the order of the sums differs.
//
// A work item is (sequence, KV head, 16 query vectors); items are spread over torch's
// intra-op threads (OpenMP, dynamic), the longest (the chunk's last rows) first.
// Built only where the compiler has avx512_bf16; used only where Python has seen vdpbf16ps
// run (paged_prefill_available, set through paged_decode_use_bf16_dot's probe).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_tables.h"
#include "vec16.h"

namespace {

using namespace servelm_cpu;

bool g_prefill_enabled = false;
constexpr int64_t kMaxHeadDim = 256;  // the item's scratch (attend_item) holds D <= this

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBuilt = true;
constexpr int kLanes = 16;  // query vectors per item
constexpr int kTile = 16;   // keys per tile
constexpr int kMaxD = int(kMaxHeadDim);

struct Prefill {
  const bf16 *q, *k, *v;
  int64_t q_row, q_head;  // q's strides (elements)
  int64_t slot_stride;    // K * D
  const int64_t *tables, *query_start, *context_lens;
  int64_t table_stride, H, G, D, block_size;
  float scale;
  float* out;  // [T, H, D]
};

struct Item {
  int64_t seq, kv_head, first;  // first: index of the item's first (row, group head) vector
};

constexpr int kDims = 8;  // dimensions of V weighed at once (D % 32 == 0)

// o[d] = o[d] * alpha + sum over the tile's n keys of p_t * v_t[d], for d in 0 .. D - 1;
// kN: n at compile time (a full tile), 0: at run time. Each dimension's sum is added in key
// order, kDims dimensions' chains interleaved.
template <int kN>
inline void weigh_values(float (*o)[kLanes], const float (*vt)[kMaxD], const __m512* p,
                         __m512 alpha, int n, int64_t D) {
  const int keys = kN ? kN : n;
  for (int64_t d = 0; d < D; d += kDims) {
    __m512 acc[kDims];
    for (int j = 0; j < kDims; ++j) acc[j] = _mm512_mul_ps(_mm512_load_ps(o[d + j]), alpha);
    for (int t = 0; t < keys; ++t)
      for (int j = 0; j < kDims; ++j)
        acc[j] = _mm512_fmadd_ps(p[t], _mm512_set1_ps(vt[t][d + j]), acc[j]);
    for (int j = 0; j < kDims; ++j) _mm512_store_ps(o[d + j], acc[j]);
  }
}

// kD: the head dim at compile time (64, 128), 0: at run time.
template <int kD>
void attend_item(const Prefill& p, const Item& it) {
  const int64_t D = kD ? kD : p.D, pairs = D / 2, G = p.G;
  const int64_t q0 = p.query_start[it.seq], rows = p.query_start[it.seq + 1] - q0;
  const int64_t ctx = p.context_lens[it.seq], n_vec = rows * G;
  const int64_t* table = p.tables + it.seq * p.table_stride;
  alignas(64) uint32_t qt[kMaxD / 2][kLanes];  // qt[i][m]: dims 2i, 2i+1 of lane m's query
  alignas(64) float vt[kTile][kMaxD];         // a tile's V rows, widened
  alignas(64) float o[kMaxD][kLanes];         // o[d][m]: lane m's weighted sum of V, dim d
  alignas(64) int32_t pos_of[kLanes];
  int64_t row_of[kLanes], head_of[kLanes];
  for (int m = 0; m < kLanes; ++m) {  // lanes past the last vector repeat it
    const int64_t j = std::min<int64_t>(it.first + m, n_vec - 1);
    row_of[m] = j / G, head_of[m] = it.kv_head * G + j % G;
    pos_of[m] = int32_t(ctx + row_of[m]);
    const uint32_t* src = reinterpret_cast<const uint32_t*>(
        p.q + (q0 + row_of[m]) * p.q_row + head_of[m] * p.q_head);
    for (int64_t i = 0; i < pairs; ++i) qt[i][m] = src[i];
  }
  const __m512i qpos = _mm512_load_si512(pos_of);
  const int64_t first_pos = pos_of[0], last_pos = pos_of[kLanes - 1];
  for (int64_t d = 0; d < D; ++d) _mm512_store_ps(o[d], _mm512_setzero_ps());
  __m512 run_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 run_sum = _mm512_setzero_ps();
  const __m512 scale = _mm512_set1_ps(p.scale);
  const bf16* kbase = p.k + it.kv_head * D;
  const bf16* vbase = p.v + it.kv_head * D;
  for (int64_t start = 0; start <= last_pos; start += kTile) {
    const int n = int(std::min<int64_t>(kTile, last_pos + 1 - start));
    const uint32_t* krow[kTile];
    const bf16* vrow[kTile];
    for (int t = 0; t < kTile; ++t) {  // keys past n read key 0's row; masked below
      const int64_t pos = start + (t < n ? t : 0);
      const int64_t slot = table[pos / p.block_size] * p.block_size + pos % p.block_size;
      krow[t] = reinterpret_cast<const uint32_t*>(kbase + slot * p.slot_stride);
      vrow[t] = vbase + slot * p.slot_stride;
    }
    // scores: s[t] lane m = q_m . k_t
    __m512 s[kTile];
    for (int t = 0; t < kTile; ++t) s[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; ++i) {
      const __m512bh q = (__m512bh)_mm512_load_si512(qt[i]);
      for (int t = 0; t < kTile; ++t)
        s[t] = _mm512_dpbf16_ps(s[t], q, (__m512bh)_mm512_set1_epi32(int(krow[t][i])));
    }
    // causal mask (only a tile that reaches past some lane's position needs one) and the
    // tile's max, lane-wise
    const bool diagonal = start + kTile - 1 > first_pos;
    __mmask16 keep[kTile];
    __m512 tile_max = run_max;
    for (int t = 0; t < kTile; ++t) {
      keep[t] = t >= n ? __mmask16(0)
                : diagonal ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(int(start + t)), qpos)
                           : __mmask16(0xFFFF);
      s[t] = _mm512_mul_ps(s[t], scale);
      tile_max = _mm512_mask_max_ps(tile_max, keep[t], tile_max, s[t]);
    }
    const __m512 alpha = (__m512)exp16((f32x16)_mm512_sub_ps(run_max, tile_max));
    run_max = tile_max;
    __m512 sum = _mm512_mul_ps(run_sum, alpha);
    for (int t = 0; t < kTile; ++t) {
      s[t] = _mm512_maskz_mov_ps(keep[t], (__m512)exp16((f32x16)_mm512_sub_ps(s[t], tile_max)));
      sum = _mm512_add_ps(sum, s[t]);
    }
    run_sum = sum;
    for (int t = 0; t < n; ++t)
      for (int64_t c = 0; c < D; c += 16)
        _mm512_store_ps(&vt[t][c], (__m512)load16(vrow[t] + c));
    // o[d] = o[d] * alpha + sum_t p_t * v_t[d], kDims dimensions at a time: each is one
    // chain of dependent adds over t, so one dimension alone waited on the FMA's latency.
    if (n == kTile)
      weigh_values<kTile>(o, vt, s, alpha, kTile, D);
    else
      weigh_values<0>(o, vt, s, alpha, n, D);
  }
  alignas(64) float inv[kLanes];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), run_sum));
  const int valid = int(std::min<int64_t>(kLanes, n_vec - it.first));
  for (int m = 0; m < valid; ++m) {
    float* dst = p.out + ((q0 + row_of[m]) * p.H + head_of[m]) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = o[d][m] * inv[m];
  }
}

using ItemFn = void (*)(const Prefill&, const Item&);
ItemFn pick(int64_t D) {
  if (D == 64) return attend_item<64>;
  if (D == 128) return attend_item<128>;
  return attend_item<0>;
}
#else
constexpr bool kBuilt = false;
#endif

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& query_start,
                         const at::Tensor& context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(kBuilt && g_prefill_enabled,
              "paged_prefill: needs avx512_bf16, built and seen to run here "
              "(paged_prefill_available())");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_prefill: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16,
              "paged_prefill: q must be bfloat16 [T, H, D], rows contiguous");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "paged_prefill: k_cache and v_cache must be contiguous bfloat16 [num_slots, K, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), K = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && H % K == 0,
              "paged_prefill: head_dim differs or H is not a multiple of K");
  TORCH_CHECK(D % 32 == 0 && D <= kMaxHeadDim,
              "paged_prefill: head_dim must be a multiple of 32, at most ", kMaxHeadDim);
  TORCH_CHECK(query_start.scalar_type() == at::kLong && query_start.dim() == 1 &&
                  query_start.is_contiguous() && context_lens.scalar_type() == at::kLong &&
                  context_lens.is_contiguous() && query_start.numel() == context_lens.numel() + 1,
              "paged_prefill: query_start [S + 1] and context_lens [S] must be int64");
  const int64_t S = context_lens.numel();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  TORCH_CHECK(S == 0 || (qs[0] == 0 && qs[S] == T), "paged_prefill: query_start must run 0 .. T");
  std::vector<int64_t> seq_lens(S);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(qs[s + 1] > qs[s] && ctx[s] >= 0,
                "paged_prefill: every sequence needs >= 1 query row and context_lens >= 0");
    seq_lens[s] = ctx[s] + qs[s + 1] - qs[s];
  }
  at::Tensor lens = at::empty({S}, context_lens.options());
  std::copy(seq_lens.begin(), seq_lens.end(), lens.data_ptr<int64_t>());
  // every block a row reads must exist: a bad table is an error here, not a wild read below
  check_paged_tables("paged_prefill", block_tables, lens, S, k_cache.size(0), block_size);
  at::Tensor out = at::empty({T, H, D}, q.options().dtype(at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const int64_t G = H / K;
  const Prefill p{reinterpret_cast<const bf16*>(q.data_ptr()),
                  reinterpret_cast<const bf16*>(k_cache.data_ptr()),
                  reinterpret_cast<const bf16*>(v_cache.data_ptr()),
                  q.stride(0), q.stride(1), K * D, block_tables.data_ptr<int64_t>(), qs, ctx,
                  block_tables.stride(0), H, G, D, block_size, float(scale),
                  out.data_ptr<float>()};
  std::vector<Item> items;  // each sequence's last vectors (the most keys) first
  for (int64_t s = 0; s < S; ++s)
    for (int64_t first = ((qs[s + 1] - qs[s]) * G - 1) / kLanes * kLanes; first >= 0;
         first -= kLanes)
      for (int64_t kh = 0; kh < K; ++kh) items.push_back({s, kh, first});
  const ItemFn fn = pick(D);
  const int64_t n_items = int64_t(items.size());
  const int threads =
      int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items)));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < n_items; ++i) fn(p, items[i]);
#endif
  return out;
}

// Whether paged_prefill runs: `use` is Python's word that vdpbf16ps ran here (isa.py);
// returns whether it now does (false where the build had no avx512_bf16).
bool paged_prefill_use(bool use) {
  g_prefill_enabled = use && kBuilt;
  return g_prefill_enabled;
}

bool paged_prefill_available() { return g_prefill_enabled; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("paged_prefill_use(bool use) -> bool", &paged_prefill_use);
  m.def("paged_prefill_available() -> bool", &paged_prefill_available);
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start, Tensor context_lens, int block_size, float scale) -> Tensor",
        &paged_prefill);
}
