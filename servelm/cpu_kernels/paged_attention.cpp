// Paged attention on the CPU for decodes: each sequence's one query token attends to its
// context where it lies in the paged KV cache. No gather into a padded copy, no padding.
//
//   k_cache, v_cache: [num_slots, K, D]      block_tables: [B, max_blocks]
//
//   position p of sequence b  ->  slot = block_tables[b][p / block_size] * block_size
//                                        + p % block_size
//   q: [B, H, D]; the G = H / K query heads of KV head k are heads k*G .. k*G + G-1.
//
// A work item is a sequence, or one (sequence, KV head) when there are few sequences; the G
// query heads of a KV head share every K/V row loaded.
// Items are spread over torch's intra-op threads (OpenMP, dynamic: contexts differ in
// length). The context is walked in tiles of 16 positions (any block size), the next tile
// prefetched into L2 and each tile's K rows read in address order (all the item's KV heads
// of a slot at once). 16 scores per head come out of one transpose-and-add tree, softmax is
// online per tile (running max and sum in fp32), and a head's accumulator stays in
// registers while the tile's V rows stream. On a CPU without AVX-512 the same walk runs in
// 8-lane AVX2 vectors (attend8, below): the 16-lane form does not fit 16 ymm registers.
// A bfloat16 cache's rows are widened in "pair order" (load_row), and a bfloat16 q takes its
// q . k from vdpbf16ps where the probe saw it run (tile_dots_bf16).
// D must be a multiple of 16. Caches hold float32, bfloat16 or float8 e4m3 codes with a scale
// per KV head (k_scale folded into q, v_scale into the output); q float32 or bfloat16; the
// output is fp32. store_kv writes a step's new K/V rows into the cache.
// Two variants (Gemma, Mistral, Phi-3): a sliding window (a query at position p attends the
// keys at (p - window, p]: the walk starts at the window's first tile) and tanh soft-capping
// of the scores (softcap * tanh(score / softcap), before the softmax).
// Vectors are GCC vector extensions: AVX-512 under -march=native, split where narrower.
//
// Keep this file small: it is compiled on first use (servelm/cpu_kernels/__init__.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_tables.h"
#include "vec16.h"

namespace {

using namespace servelm_cpu;
constexpr int kTile = 16;
// The next tile's rows are prefetched one at a time, spread over this tile's work: one every
// kDotsPerFetch rows of q . k (8 of the 16) and one every kValuesPerFetch (head, row) steps
// of the weighted sum of V (the rest, at G = 3). Spread over the q . k loop alone the 16
// came in bursts the miss queue could not take (record paged-decode-micro-20261206T032727Z,
// Zen 5: bfloat16 from memory 14.1 / 13.8 -> 11.4 / 11.6 ms a pass; float32 the same).
constexpr int kDotsPerFetch = 2;
constexpr int kValuesPerFetch = 6;
constexpr int kRowsPerFetch = 2;  // attend_tile_group: one every 2 V rows (all heads at once)
constexpr int kMaxChunks = 16;  // D <= 256

struct Problem {
  const void* k;
  const void* v;
  int64_t slot_stride;  // K * D elements between consecutive slots
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* seq_lens;
  int64_t num_heads, group, head_dim, block_size;
  float* out;  // [B, H, D]
  int64_t window = 0;  // keys a query attends, its own included (0: all)
  float softcap = 0.0f;  // scores -> softcap * tanh(score / softcap) (0: off)
  // The first position sequence b's query attends.
  int64_t first(int64_t b) const {
    return window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
  }
};

// tanh(x) = (1 - e) / (1 + e), e = exp(-2x): exp16 clamps, so e stays finite and the result
// within [-1, 1] for any x (about 1e-7 absolute error).
inline f32x16 tanh16(f32x16 x) {
  const f32x16 e = exp16(x * -2.0f);
  return (1.0f - e) / (1.0f + e);
}

// Per-thread scratch, in 16-lane vectors: q (scaled), accumulators; per query head of the
// work item: running max and sum (the 16-lane walk's sums are vectors). The 16-lane walk
// keeps one tile of partial dots; the AVX2 walk one tile's K and V rows of a KV head widened
// to float32, and a row of zeros.
struct Scratch {
  std::vector<f32x16> q, acc;
  std::vector<float> max;
#if defined(SERVELM_VEC16_HALVES)
  std::vector<float> sum, tile, zeros;
  Scratch(int64_t heads, int64_t chunks)
      : q(heads * chunks), acc(heads * chunks), max(heads), sum(heads),
        tile(2 * kTile * 16 * chunks), zeros(16 * chunks) {}
#else
  std::vector<f32x16> dots, vtile;  // vtile: one KV head's V rows of a tile, as float32
  std::vector<f32x16> sums;         // per head: the softmax's running sum, lane by lane
  std::vector<u32x16> qbf;          // bfloat16 dot products: q as stored, 32 elements a vector
  float dot_scale = 1.0f;           // ... and the scale their scores still need
  float softcap = 0.0f;             // Problem::softcap
  Scratch(int64_t heads, int64_t chunks)
      : q(heads * chunks), acc(heads * chunks), max(heads), dots(heads * kTile),
        vtile(kTile * chunks), sums(heads), qbf(heads * (chunks + 1) / 2) {}
#endif
};

// Whether a bfloat16 q against a bfloat16 cache takes its q . k from avx512_bf16's vdpbf16ps
// (32 products a instruction, straight from the stored rows): compiled where the build
// machine has it, used only once Python has seen the instruction run here
// (servelm/cpu_kernels/isa.py, set through paged_decode_use_bf16_dot).
#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif
bool g_use_bf16_dot = false;

template <typename Q>
void load_q(const at::Tensor& q, int64_t b, int64_t h0, int64_t heads, float scale, Scratch& s) {
  const int64_t chunks = q.size(2) / 16;
  const Q* src = q.data_ptr<Q>() + b * q.stride(0) + h0 * q.stride(1);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < chunks; ++c)
      s.q[h * chunks + c] = load16(src + h * q.stride(1) + 16 * c) * scale;
}

// rows[t] = element offset of position start + t's slot; returns how many (<= kTile).
// One division a tile, then the block and offset step along (a division a position was 5%
// of the walk with the context in cache).
inline int locate(const int64_t* table, int64_t bs, int64_t slot_stride, int64_t start,
                  int64_t len, int64_t* rows) {
  const int n = int(std::max<int64_t>(0, std::min<int64_t>(kTile, len - start)));
  if (n == 0) return 0;
  int64_t block = start / bs, off = start - block * bs;
  int64_t base = table[block] * bs;
  for (int t = 0; t < n; ++t) {
    rows[t] = (base + off) * slot_stride;
    if (++off == bs && t + 1 < n) off = 0, base = table[++block] * bs;
  }
  return n;
}

// The work items, handed out in order (each thread takes its next one when it is free, as
// OpenMP's dynamic schedule does): an item's walk claims its successor at the start of its
// last tile, so that the successor's first tile is prefetched during that tile. Unclaimed,
// each item's first tile was a full miss with nothing to overlap (64 sequences x 30 layers
// of them in a decode step).
struct Items {
  std::atomic<int64_t> taken{0};
  int64_t count, split, kv_per_item;
  Items(int64_t count, int64_t split, int64_t kv_per_item)
      : count(count), split(split), kv_per_item(kv_per_item) {}
  int64_t claim() { return taken.fetch_add(1, std::memory_order_relaxed); }
  int64_t seq(int64_t i) const { return i / split; }
  int64_t kh0(int64_t i) const { return (i % split) * kv_per_item; }
};

// One work item's walk over its context, tile by tile: sequence b's slots for KV heads
// kh0..kh1-1 (whole slots, contiguous in memory), the next tile's rows prefetched a row at a
// time while this one computes (its blocks lie anywhere in the pool).
template <typename KV>
struct Walk {
  const KV *kbase, *vbase;  // KV head kh0's part of slot 0
  const int64_t* table;
  int64_t first, len, bs, slot_stride, row_bytes;
  int64_t rows[kTile], next[kTile];  // element offsets of this tile's and the next's slots
  const KV *pk, *pv;  // the bases next[] counts from: this item's, or its successor's
  const Problem& p;
  Items* items;            // null: no successor is claimed
  int64_t successor = -1;  // claimed at the last tile (>= items->count: none was left)
  Walk(const Problem& p, int64_t b, int64_t kh0, int64_t kh1, Items* items)
      : kbase(static_cast<const KV*>(p.k) + kh0 * p.head_dim),
        vbase(static_cast<const KV*>(p.v) + kh0 * p.head_dim),
        table(p.tables + b * p.table_stride), first(p.first(b)), len(p.seq_lens[b]),
        bs(p.block_size),
        slot_stride(p.slot_stride), row_bytes((kh1 - kh0) * p.head_dim * int64_t(sizeof(KV))),
        pk(kbase), pv(vbase), p(p), items(items) {
    locate(table, bs, slot_stride, first, len, next);
  }
  // The rows of the tile at `start` into rows[]; returns how many (<= kTile).
  int n_next = 0, fetched = 0;  // the next tile's rows, and how many are prefetched
  int tile(int64_t start) {
    const int n = int(std::min<int64_t>(kTile, len - start));
    prefetch(kTile);  // any the last tile's work left
    std::copy(next, next + n, rows);
    n_next = locate(table, bs, slot_stride, start + kTile, len, next);
    if (n_next == 0 && items != nullptr && successor < 0) {  // the last tile
      successor = items->claim();
      if (successor < items->count) {  // its first tile (an item's rows are row_bytes wide)
        pk = static_cast<const KV*>(p.k) + items->kh0(successor) * p.head_dim;
        pv = static_cast<const KV*>(p.v) + items->kh0(successor) * p.head_dim;
        const int64_t b = items->seq(successor);
        n_next = locate(p.tables + b * p.table_stride, bs, slot_stride, p.first(b),
                        p.seq_lens[b], next);
      }
    }
    fetched = 0;
    return n;
  }
  // Prefetch the next tile's rows `k` at a time, called through this tile's work: all of
  // them at once, at the tile's start, kept the core waiting on a full miss queue (record
  // paged-decode-micro-20261206T024203Z, Zen 5: from memory bfloat16 21.3 -> 15.0 ms a pass,
  // float32 27.5 -> 21.5; in cache the same). Where: kDotsPerFetch, kValuesPerFetch.
  inline void prefetch(int k) {
    for (; k > 0 && fetched < n_next; --k, ++fetched)
      for (int64_t c = 0; c < row_bytes; c += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(pk + next[fetched]) + c, 0, 3);
        __builtin_prefetch(reinterpret_cast<const char*>(pv + next[fetched]) + c, 0, 3);
      }
  }
};

#if !defined(SERVELM_VEC16_HALVES)
// out[t] = the sum of x[t]'s 16 lanes, t = 0..15: four levels that each halve the vectors
// and the lanes per token (8 -> 4 -> 2 -> 1), keeping tokens in order.
inline f32x16 sum_lanes_16(const f32x16* x) {
  const i32x16 a8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i32x16 b8 = a8 + 8;
  const i32x16 a4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i32x16 b4 = a4 + 4;
  const i32x16 a2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i32x16 b2 = a2 + 2;
  const i32x16 a1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const i32x16 b1 = a1 + 1;
  f32x16 y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)
    y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], a8) + __builtin_shuffle(x[2 * i], x[2 * i + 1], b8);
  for (int i = 0; i < 4; ++i)
    z[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1], a4) + __builtin_shuffle(y[2 * i], y[2 * i + 1], b4);
  for (int i = 0; i < 2; ++i)
    w[i] = __builtin_shuffle(z[2 * i], z[2 * i + 1], a2) + __builtin_shuffle(z[2 * i], z[2 * i + 1], b2);
  return __builtin_shuffle(w[0], w[1], a1) + __builtin_shuffle(w[0], w[1], b1);
}

// A bfloat16 row in "pair order": each 64-byte load of 32 elements gives two float32 vectors,
// the even elements (bits shifted up) and the odd ones (low bits masked off), with no lane
// shuffle: vpmovzxwd's widening runs on the one shuffle port, which the score tree below
// also needs, and cost a bfloat16 cache 30% over a float32 one with its rows in cache.
// q and the accumulators live in the same order (a dot product and a weighted sum do not
// care which lane holds which dimension); the output is put back in order at the end.
// Float32 and fp8 rows keep the natural order; with D % 32 == 16 the last chunk does too.
template <typename KV>
constexpr bool kPairOrder = std::is_same_v<KV, bf16>;

template <typename KV>
inline void load_row(const KV* p, int64_t nc, f32x16* out) {
  if constexpr (kPairOrder<KV>) {
    int64_t c = 0;
    for (; c + 1 < nc; c += 2) {
      const u32x16 w = *reinterpret_cast<const u32x16*>(p + 16 * c);
      out[c] = (f32x16)(w << 16);
      out[c + 1] = (f32x16)(w & 0xFFFF0000u);
    }
    if (c < nc) out[c] = load16(p + 16 * c);
  } else {
    for (int64_t c = 0; c < nc; ++c) out[c] = load16(p + 16 * c);
  }
}

// A tile's max and a head's sum across lanes: AVX-512's shuffle trees, else lane by lane.
inline float reduce_max16(f32x16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  return lane_max(v);
#endif
}
inline float reduce_add16(f32x16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  return lane_sum(v);
#endif
}

// x's pairs of chunks (x[c], x[c + 1]) -> (shuffle(x[c], x[c + 1], first), (..., second)).
inline void shuffle_pairs(f32x16* x, int64_t nc, i32x16 first, i32x16 second) {
  for (int64_t c = 0; c + 1 < nc; c += 2) {
    const f32x16 a = x[c], b = x[c + 1];
    x[c] = __builtin_shuffle(a, b, first);
    x[c + 1] = __builtin_shuffle(a, b, second);
  }
}
// natural order <-> pair order, for each 32-dimension pair of chunks
inline void to_pair_order(f32x16* x, int64_t nc) {
  const i32x16 even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  shuffle_pairs(x, nc, even, even + 1);
}
inline void from_pair_order(f32x16* x, int64_t nc) {
  const i32x16 lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  shuffle_pairs(x, nc, lo, lo + 8);
}

// dots[h][t] for the item's heads h over one tile of n <= 16 rows: lane-wise q * k products,
// summed over the chunks. The rows' KV heads are read in address order (whole slots).
template <int kChunks, typename KV>
void tile_dots(const Problem& p, Walk<KV>& w, int n, int64_t num_kv, Scratch& s) {
  const int64_t nc = kChunks ? kChunks : p.head_dim / 16, G = p.group, D = p.head_dim;
  const KV* kbase = w.kbase;
  const int64_t* rows = w.rows;
  for (int t = 0; t < kTile; ++t) {
    if (t % kDotsPerFetch == 0) w.prefetch(1);
    if (t >= n) {
      for (int64_t h = 0; h < num_kv * G; ++h) s.dots[h * kTile + t] = splat(0.0f);
      continue;
    }
    for (int64_t kh = 0; kh < num_kv; ++kh) {
      f32x16 k[kMaxChunks];
      load_row(kbase + rows[t] + kh * D, nc, k);
      for (int64_t g = 0; g < G; ++g) {
        const f32x16* qh = &s.q[(kh * G + g) * nc];
        f32x16 d = qh[0] * k[0];
        for (int64_t c = 1; c < nc; ++c) d += qh[c] * k[c];
        s.dots[(kh * G + g) * kTile + t] = d;
      }
    }
  }
}

#if defined(__AVX512BF16__)
// tile_dots for a bfloat16 q and cache: each pair of products of q's and k's stored values is
// exact in float32 and added in float32, as the widened form computes them (in another
// order); the scale is applied to the summed scores. D % 32 == 0.
template <int kChunks>
void tile_dots_bf16(const Problem& p, Walk<bf16>& w, int n, int64_t num_kv, Scratch& s) {
  const int64_t np = (kChunks ? kChunks : p.head_dim / 16) / 2, G = p.group, D = p.head_dim;
  const bf16* kbase = w.kbase;
  const int64_t* rows = w.rows;
  for (int t = 0; t < kTile; ++t) {
    if (t % kDotsPerFetch == 0) w.prefetch(1);
    if (t >= n) {
      for (int64_t h = 0; h < num_kv * G; ++h) s.dots[h * kTile + t] = splat(0.0f);
      continue;
    }
    for (int64_t kh = 0; kh < num_kv; ++kh) {
      __m512bh k[kMaxChunks / 2];
      for (int64_t c = 0; c < np; ++c)
        k[c] = (__m512bh)_mm512_loadu_si512(kbase + rows[t] + kh * D + 32 * c);
      for (int64_t g = 0; g < G; ++g) {
        const u32x16* qh = &s.qbf[(kh * G + g) * np];
        __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qh[0], k[0]);
        for (int64_t c = 1; c < np; ++c) d = _mm512_dpbf16_ps(d, (__m512bh)qh[c], k[c]);
        s.dots[(kh * G + g) * kTile + t] = (f32x16)d;
      }
    }
  }
}
#endif

// Query head `head`'s softmax weights over one tile of n rows, from its partial dots; its
// running max and sum move on, and acc (its nc accumulators) is rescaled to a new max.
// The running sum stays a vector (summed across lanes once, at the end) and the tile's max is
// a shuffle tree: both were 16-step dependent scalar chains a head and a tile.
template <bool kDot>
inline f32x16 tile_weights(int n, int64_t head, f32x16* acc, int64_t nc, Scratch& s) {
  float& max = s.max[head];
  f32x16& sum = s.sums[head];
  f32x16 scores = sum_lanes_16(&s.dots[head * kTile]);
  if (kDot) scores *= s.dot_scale;
  if (s.softcap != 0.0f) scores = tanh16(scores * (1.0f / s.softcap)) * s.softcap;
  scores = keep_first(scores, n, -std::numeric_limits<float>::infinity());
  const float mx = std::max(max, reduce_max16(scores));
  if (mx > max) {  // rescale what came before to the new max
    const float alpha = exp16(splat(max - mx))[0];
    for (int64_t c = 0; c < nc; ++c) acc[c] *= alpha;
    sum *= alpha;
    max = mx;
  }
  const f32x16 e = keep_first(exp16(scores - mx), n, 0.0f);
  sum += e;
  return e;
}

// Softmax and values of one tile for the G query heads of one KV head: vbase points at that
// head's part of slot 0; h is the item's index of the group's first head.
// A bfloat16 or fp8 tile's V rows are widened into scratch once, for all G heads.
template <int kChunks, typename KV, bool kDot>
void attend_tile(const Problem& p, const KV* vbase, const int64_t* rows, int n, int64_t h,
                 Scratch& s, Walk<KV>& walk) {
  const int64_t nc = kChunks ? kChunks : p.head_dim / 16, G = p.group;
  if constexpr (!std::is_same_v<KV, float>)
    for (int t = 0; t < n; ++t) load_row(vbase + rows[t], nc, &s.vtile[t * nc]);
  for (int64_t g = 0; g < G; ++g) {
    f32x16 acc[kMaxChunks];
    for (int64_t c = 0; c < nc; ++c) acc[c] = s.acc[(h + g) * nc + c];
    const f32x16 e = tile_weights<kDot>(n, h + g, acc, nc, s);
    for (int t = 0; t < n; ++t) {
      if ((g * kTile + t) % kValuesPerFetch == 0) walk.prefetch(1);
      const float w = e[t];
      if constexpr (std::is_same_v<KV, float>) {
        const float* vr = vbase + rows[t];
        for (int64_t c = 0; c < nc; ++c) acc[c] += w * load16(vr + 16 * c);
      } else {
        const f32x16* vr = &s.vtile[t * nc];
        for (int64_t c = 0; c < nc; ++c) acc[c] += w * vr[c];
      }
    }
    for (int64_t c = 0; c < nc; ++c) s.acc[(h + g) * nc + c] = acc[c];
  }
}

// attend_tile with the group's heads known at compile time (kG * kChunks <= 16): each head's
// softmax first, then one pass over the tile's V rows with all kG heads' accumulators in
// registers, each row widened once in registers and feeding every head (attend_tile widens
// the rows into scratch and reads them back once a head: 23% more instructions at G = 3,
// D = 64). Each head's sums are added in attend_tile's order: the same bits.
template <int kChunks, typename KV, bool kDot, int kG>
void attend_tile_group(const KV* vbase, const int64_t* rows, int n, int64_t h, Scratch& s,
                       Walk<KV>& walk) {
  static_assert(kChunks > 0 && kG * kChunks <= 16, "accumulators must fit the registers");
  alignas(64) float weights[kG][kTile];
  f32x16 acc[kG][kChunks];
  for (int g = 0; g < kG; ++g) {
    for (int c = 0; c < kChunks; ++c) acc[g][c] = s.acc[(h + g) * kChunks + c];
    *reinterpret_cast<f32x16*>(weights[g]) = tile_weights<kDot>(n, h + g, acc[g], kChunks, s);
  }
  for (int t = 0; t < n; ++t) {
    if (t % kRowsPerFetch == 0) walk.prefetch(1);
    f32x16 v[kChunks];
    load_row(vbase + rows[t], kChunks, v);
    for (int g = 0; g < kG; ++g) {
      const float w = weights[g][t];
      for (int c = 0; c < kChunks; ++c) acc[g][c] += w * v[c];
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kChunks; ++c) s.acc[(h + g) * kChunks + c] = acc[g][c];
}

// The tile's softmax and values for one KV head's group: the register form where it fits.
template <int kChunks, typename KV, bool kDot>
void attend_group(const Problem& p, const KV* vbase, const int64_t* rows, int n, int64_t h,
                  Scratch& s, Walk<KV>& walk) {
  if constexpr (kChunks == 4) {
    switch (p.group) {
      case 1: return attend_tile_group<4, KV, kDot, 1>(vbase, rows, n, h, s, walk);
      case 2: return attend_tile_group<4, KV, kDot, 2>(vbase, rows, n, h, s, walk);
      case 3: return attend_tile_group<4, KV, kDot, 3>(vbase, rows, n, h, s, walk);
      case 4: return attend_tile_group<4, KV, kDot, 4>(vbase, rows, n, h, s, walk);
      default: break;
    }
  } else if constexpr (kChunks == 8) {
    switch (p.group) {
      case 1: return attend_tile_group<8, KV, kDot, 1>(vbase, rows, n, h, s, walk);
      case 2: return attend_tile_group<8, KV, kDot, 2>(vbase, rows, n, h, s, walk);
      default: break;
    }
  }
  attend_tile<kChunks, KV, kDot>(p, vbase, rows, n, h, s, walk);
}

// Sequence b, KV heads kh0..kh1-1; s.q holds their query heads. kChunks = D / 16, 0: runtime.
// Each tile is read for all the item's KV heads at once: whole slots, contiguous in memory.
// kDot: q . k from tile_dots_bf16 (s.qbf holds q), else tile_dots (s.q).
template <int kChunks, typename KV, bool kDot = false>
[[gnu::flatten]] int64_t attend(const Problem& p, int64_t b, int64_t kh0, int64_t kh1, Scratch& s,
                                Items* items) {
  const int64_t nc = kChunks ? kChunks : p.head_dim / 16, G = p.group, D = p.head_dim;
  const int64_t heads = (kh1 - kh0) * G;
  Walk<KV> w(p, b, kh0, kh1, items);
  std::fill(s.acc.begin(), s.acc.begin() + heads * nc, splat(0.0f));
  std::fill(s.max.begin(), s.max.begin() + heads, -std::numeric_limits<float>::infinity());
  std::fill(s.sums.begin(), s.sums.begin() + heads, splat(0.0f));
  for (int64_t start = w.first; start < w.len; start += kTile) {
    const int n = w.tile(start);
#if defined(__AVX512BF16__)
    if constexpr (kDot)
      tile_dots_bf16<kChunks>(p, w, n, kh1 - kh0, s);
    else
#endif
      tile_dots<kChunks, KV>(p, w, n, kh1 - kh0, s);
    for (int64_t kh = 0; kh < kh1 - kh0; ++kh)
      attend_group<kChunks, KV, kDot>(p, w.vbase + kh * D, w.rows, n, kh * G, s, w);
  }
  float* out = p.out + (b * p.num_heads + kh0 * G) * D;
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.0f / reduce_add16(s.sums[h]);
    f32x16* acc = &s.acc[h * nc];
    if constexpr (kPairOrder<KV>) from_pair_order(acc, nc);
    for (int64_t c = 0; c < nc; ++c)
      *reinterpret_cast<f32x16*>(out + h * D + 16 * c) = acc[c] * inv;
  }
  return w.successor;
}

#else
// AVX2 (no AVX-512): the same walk in 8-lane vectors. With 16 ymm registers the 16-lane form
// above spills: a tile's K row (D / 8 halves) and a group's query heads (G D / 8) do not fit,
// so GCC moves every operand through the stack (record paged-decode-micro-20261203T154318Z:
// 1.8x slower than this from memory and 4.7x in cache for a float32 cache, 14x for fp8).
// Here a bfloat16 or fp8 tile's rows are first widened to float32 in scratch (once per
// element; a float32 tile is read where it lies), then each query head of the group takes
// its scores against the tile with its q in registers (D = 64) and keeps its D / 8
// accumulators in registers while the tile's V rows stream. Same online softmax; sums are
// added in another order (another rounding of the same sums).

// bfloat16 / fp8 cache rows widened to float32, 8 lanes (load16 in vec16.h goes through the
// stack on AVX2 for these: 3-6x slower here).
inline __m256 load8(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const fp8_e4m3* p) {  // exact, as load16 (vec16.h)
  const __m256i w =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
  const __m256 is_normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(7)));
  const __m256 v = _mm256_blendv_ps(sub, normal, is_normal);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}

// exp16's polynomial (vec16.h: x clamped to [-87, 88], about 1 ulp) on one 8-lane register:
// exp16 on a joined pair of them goes through the stack (measured: 1.3-1.7x the whole walk).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 big = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), big), big);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(1.9875691500e-4f), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}

// out lane t = the sum of x[t]'s 8 lanes, t = 0..7: hadd rounds, then the two 128-bit halves.
// a: lanes (0 1 2 3 | 0 1 2 3) of vectors 0-3, each half a partial sum; b the same of 4-7.
inline __m256 sum_lanes_8(const __m256* x) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// kH: D / 8 (8 for D = 64, 16 for 128), 0: runtime.
template <int kH, typename KV>
int64_t attend8(const Problem& p, int64_t b, int64_t kh0, int64_t kh1, Scratch& s, Items* items) {
  const int64_t nh = kH ? kH : p.head_dim / 8, G = p.group, D = p.head_dim;
  const int64_t heads = (kh1 - kh0) * G;
  Walk<KV> walk(p, b, kh0, kh1, items);
  const KV *kbase = walk.kbase, *vbase = walk.vbase;
  const float* q = reinterpret_cast<const float*>(s.q.data());  // [heads][D], scaled
  float* accs = reinterpret_cast<float*>(s.acc.data());         // [heads][D]
  std::vector<float>& tile = s.tile;  // one KV head's K and V rows of a tile: [kTile][D] each
  std::fill(accs, accs + heads * D, 0.0f);
  std::fill(s.max.begin(), s.max.begin() + heads, -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.begin() + heads, 0.0f);
  const int64_t* rows = walk.rows;
  for (int64_t start = walk.first; start < walk.len; start += kTile) {
    const int n = walk.tile(start);
    for (int64_t kh = 0; kh < kh1 - kh0; ++kh) {
      // The tile's K and V rows as float32: the cache's own rows, or widened into scratch.
      const float *krow[kTile], *vrow[kTile];
      float* kt = tile.data();
      float* vt = kt + kTile * D;
      for (int t = 0; t < n; ++t) {
        const KV *kr = kbase + rows[t] + kh * D, *vr = vbase + rows[t] + kh * D;
        if constexpr (std::is_same_v<KV, float>) {
          krow[t] = kr, vrow[t] = vr;
        } else {
          for (int64_t c = 0; c < nh; ++c) {  // nh: a constant for D = 64 and 128
            _mm256_storeu_ps(kt + t * D + 8 * c, load8(kr + 8 * c));
            _mm256_storeu_ps(vt + t * D + 8 * c, load8(vr + 8 * c));
          }
          krow[t] = kt + t * D, vrow[t] = vt + t * D;
        }
      }
      for (int t = n; t < kTile; ++t) krow[t] = s.zeros.data();  // finite scores, masked below
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kh * G + g;
        const float* qh = q + h * D;
        __m256 qv[kH ? kH : 32];  // in registers for D = 64 (8 of the 16)
        for (int64_t c = 0; c < nh; ++c) qv[c] = _mm256_loadu_ps(qh + 8 * c);
        __m256 part[kTile];
        for (int t = 0; t < kTile; ++t) {
          const float* kr = krow[t];
          __m256 d0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
          __m256 d1 = _mm256_mul_ps(qv[1], _mm256_loadu_ps(kr + 8));
          for (int64_t c = 2; c < nh; c += 2) {
            d0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + 8 * c), d0);
            d1 = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(kr + 8 * c + 8), d1);
          }
          part[t] = _mm256_add_ps(d0, d1);
        }
        const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256 sc[2], valid[2];
        for (int i = 0; i < 2; ++i) {
          valid[i] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * i), idx));
          __m256 x = sum_lanes_8(part + 8 * i);
          if (p.softcap != 0.0f) {  // softcap * tanh(x / softcap), tanh16's formula
            const __m256 one = _mm256_set1_ps(1.0f);
            const __m256 e = exp8(_mm256_mul_ps(x, _mm256_set1_ps(-2.0f / p.softcap)));
            x = _mm256_mul_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)),
                              _mm256_set1_ps(p.softcap));
          }
          sc[i] = _mm256_blendv_ps(ninf, x, valid[i]);
        }
        float &max = s.max[h], &sum = s.sum[h];
        const float mx = std::max(max, hmax8(_mm256_max_ps(sc[0], sc[1])));
        float* acc = accs + h * D;
        __m256 a[kH ? kH : 32];
        for (int64_t c = 0; c < nh; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
        if (mx > max) {  // rescale what came before to the new max
          const __m256 alpha = exp8(_mm256_set1_ps(max - mx));
          for (int64_t c = 0; c < nh; ++c) a[c] = _mm256_mul_ps(a[c], alpha);
          sum *= _mm256_cvtss_f32(alpha);
          max = mx;
        }
        alignas(32) float w[kTile];
        for (int i = 0; i < 2; ++i) {
          const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(sc[i], _mm256_set1_ps(mx))), valid[i]);
          _mm256_store_ps(w + 8 * i, e);
        }
        sum += hsum8(_mm256_add_ps(_mm256_load_ps(w), _mm256_load_ps(w + 8)));
        for (int t = 0; t < n; ++t) {
          walk.prefetch(1);
          const __m256 wt = _mm256_broadcast_ss(w + t);
          const float* vr = vrow[t];
          for (int64_t c = 0; c < nh; ++c)
            a[c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vr + 8 * c), a[c]);
        }
        for (int64_t c = 0; c < nh; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
      }
    }
  }
  float* out = p.out + (b * p.num_heads + kh0 * G) * D;
  for (int64_t h = 0; h < heads; ++h) {
    const __m256 inv = _mm256_set1_ps(1.0f / s.sum[h]);
    for (int64_t c = 0; c < nh; ++c)
      _mm256_storeu_ps(out + h * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(accs + h * D + 8 * c), inv));
  }
  return walk.successor;
}
#endif

// Each returns the item its walk claimed as its successor (-1: none; see Items).
using AttendFn = int64_t (*)(const Problem&, int64_t, int64_t, int64_t, Scratch&, Items*);

template <typename KV>
AttendFn pick(int64_t head_dim) {
#if defined(SERVELM_VEC16_HALVES)
  if (head_dim == 64) return attend8<8, KV>;
  if (head_dim == 128) return attend8<16, KV>;
  return attend8<0, KV>;
#else
  if (head_dim == 64) return attend<4, KV>;
  if (head_dim == 128) return attend<8, KV>;
  return attend<0, KV>;
#endif
}

#if !defined(SERVELM_VEC16_HALVES)
AttendFn pick_bf16_dot(int64_t head_dim) {
  if (head_dim == 64) return attend<4, bf16, true>;
  if (head_dim == 128) return attend<8, bf16, true>;
  return attend<0, bf16, true>;
}
#endif

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode: q must be [B, H, D], rows contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode: q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "paged_decode: k_cache and v_cache must be contiguous [num_slots, K, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16 ||
                   k_cache.scalar_type() == at::kFloat8_e4m3fn),
              "paged_decode: caches must both be float32, bfloat16 or float8_e4m3fn");
  TORCH_CHECK(k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(1) == 0,
              "paged_decode: head_dim differs or H is not a multiple of K");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 16 * kMaxChunks,
              "paged_decode: head_dim must be a multiple of 16, at most ", 16 * kMaxChunks);
  // Every block read must exist: a bad table is an error here, not a wild read below.
  check_paged_tables("paged_decode", block_tables, seq_lens, q.size(0), k_cache.size(0),
                     block_size);
}

// k_scale, v_scale: float32 [K], required for (and only for) float8 caches. window: keys a
// query attends, its own included (0: all); softcap: the scores' tanh cap (0: none).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, double scale, const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale, int64_t window, double softcap) {
  check_inputs(q, k_cache, v_cache, block_tables, seq_lens, block_size);
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_decode: window and softcap must be >= 0");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), K = k_cache.size(1);
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()),
              "paged_decode: k_scale and v_scale go with (and only with) float8 caches");
  const float *ks = nullptr, *vs = nullptr;
  if (fp8) {
    for (const at::Tensor* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == K,
                  "paged_decode: k_scale and v_scale must be float32 [K]");
    ks = k_scale->data_ptr<float>(), vs = v_scale->data_ptr<float>();
  }
  at::Tensor out = at::empty({B, H, D}, q.options().dtype(at::kFloat));
  const Problem p{k_cache.data_ptr(), v_cache.data_ptr(), K * D,
                  block_tables.data_ptr<int64_t>(), block_tables.stride(0),
                  seq_lens.data_ptr<int64_t>(), H, H / K, D, block_size, out.data_ptr<float>(),
                  window, float(softcap)};
  const AttendFn attend_kv = fp8 ? pick<fp8_e4m3>(D)
                             : k_cache.scalar_type() == at::kBFloat16 ? pick<bf16>(D)
                                                                       : pick<float>(D);
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const bool bf16_dot = kHaveBf16Dot && g_use_bf16_dot && q_bf16 &&
                        k_cache.scalar_type() == at::kBFloat16 && D % 32 == 0;
#if !defined(SERVELM_VEC16_HALVES)
  const AttendFn attend_item = bf16_dot ? pick_bf16_dot(D) : attend_kv;
#else
  const AttendFn attend_item = attend_kv;
#endif
  // Whole sequences (all KV heads: contiguous slots) when there are enough to share out;
  // (sequence, KV head) items when few sequences must still keep every thread busy.
  const int64_t threads_wanted = at::get_num_threads();
  const int64_t split = B >= 4 * threads_wanted ? 1 : K;
  const int64_t kv_per_item = K / split, items = B * split;
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(threads_wanted, items)));
  Items work(items, split, kv_per_item);
  // Item i into s; returns the successor its walk claimed (-1: none).
  auto run_item = [&](int64_t i, Scratch& s) -> int64_t {
    const int64_t b = work.seq(i), kh0 = work.kh0(i);
    const int64_t h0 = kh0 * p.group, heads = kv_per_item * p.group;
#if !defined(SERVELM_VEC16_HALVES)
    if (bf16_dot) {  // q as stored, 32 elements a vector; the scale goes on the scores
      const at::BFloat16* src = q.data_ptr<at::BFloat16>() + b * q.stride(0) + h0 * q.stride(1);
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < D / 32; ++c)
          s.qbf[h * (D / 32) + c] =
              *reinterpret_cast<const u32x16*>(src + h * q.stride(1) + 32 * c);
      s.dot_scale = float(scale);
      return attend_item(p, b, kh0, kh0 + kv_per_item, s, &work);
    }
#endif
    if (q_bf16)
      load_q<at::BFloat16>(q, b, h0, heads, float(scale), s);
    else
      load_q<float>(q, b, h0, heads, float(scale), s);
    const int64_t nc = D / 16;
#if !defined(SERVELM_VEC16_HALVES)
    if (k_cache.scalar_type() == at::kBFloat16)
      for (int64_t h = 0; h < heads; ++h) to_pair_order(&s.q[h * nc], nc);
#endif
    if (fp8)  // a scale per KV head commutes with q . k: fold K's into q
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < nc; ++c) s.q[h * nc + c] *= ks[kh0 + h / p.group];
    const int64_t successor = attend_item(p, b, kh0, kh0 + kv_per_item, s, &work);
    if (fp8) {  // ... and V's into the output
      float* o = p.out + (b * H + h0) * D;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < D; ++d) o[h * D + d] *= vs[kh0 + h / p.group];
    }
    return successor;
  };
#pragma omp parallel num_threads(threads)
  {
    Scratch s(kv_per_item * p.group, D / 16);
#if !defined(SERVELM_VEC16_HALVES)
    s.softcap = p.softcap;
#endif
    // Each item's walk may claim the next one (Items): then that is this thread's next.
    for (int64_t i = work.claim(); i < items;) {
      const int64_t claimed = run_item(i, s);
      i = claimed >= 0 ? claimed : work.claim();
    }
  }
  return out;
}

// k, v [T, K, D] (rows contiguous, any other strides) into k_cache, v_cache [num_slots, K, D]
// at slots [T]: index_copy_'s work for both in one call, without its per-call set-up
// (about 40 us a call at a 64-sequence decode step, for 24 KB of rows).
void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
              const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k_cache.device().is_cpu() && k.device().is_cpu(), "store_kv: CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "store_kv: k_cache and v_cache must be contiguous [num_slots, K, D]");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) &&
                  k.size(2) == k_cache.size(2) && k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv: k and v must be [T, K, D] with contiguous rows, K and D as the cache's");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "store_kv: k, v and the caches must have one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "store_kv: slots must be int64 [T]");
  const int64_t T = k.size(0), K = k.size(1), row = k.size(2) * k.element_size();
  const int64_t num_slots = k_cache.size(0), slot_bytes = K * row;
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "store_kv: slot ", sl[t], " out of range [0, ",
                num_slots, ")");
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < K; ++h) {
      const int64_t dst = sl[t] * slot_bytes + h * row;
      std::memcpy(kc + dst, ks + (t * k.stride(0) + h * k.stride(1)) * es, row);
      std::memcpy(vc + dst, vs + (t * v.stride(0) + h * v.stride(1)) * es, row);
    }
}

// Whether bfloat16 decodes take vdpbf16ps: `use` is Python's word that the instruction ran
// here; returns whether they now do (false where the build had no avx512_bf16).
bool paged_decode_use_bf16_dot(bool use) {
  g_use_bf16_dot = use && kHaveBf16Dot;
  return g_use_bf16_dot;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.def("paged_decode_use_bf16_dot(bool use) -> bool", &paged_decode_use_bf16_dot);
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()",
        &store_kv);
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, int block_size, float scale, Tensor? k_scale=None, "
        "Tensor? v_scale=None, int window=0, float softcap=0.0) -> Tensor",
        &paged_decode);
}
