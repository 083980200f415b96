// DecodeStack: a decoder's layers for one all-decode step in one call.
//
// Why: at one token a step the CPU work per layer is ~100 us of kernels, and the Python
// around them (module calls, views, the attention backend, one dispatcher round trip per op)
// cost as much again: 30 layers x ~15 ops. This object holds the layers' tensors (shared with
// the modules, never copied) and runs the same kernels in the same order as the eager path
// (servelm/models/decoder.py with the C++ layer ops, quantized linears and paged decode):
//
//   h = rms_norm(x) | add_rms_norm(x, residual)           input_layernorm
//   q, k, v = split(qkv_proj(h)); [q_norm, k_norm]; rotary_(q, k, the layer's table)
//   [q *= q_mult]                                          query_pre_attn_scalar
//   store_kv(k_cache, v_cache, slots, k, v)
//   a = paged_decode(q, caches, tables, seq_lens, [window], [softcap])
//   plain:    h, residual = add_rms_norm(o_proj(a), residual)     post_attention_layernorm
//             x = mlp(h)
//   sandwich: h, residual = add_rms_norm(rms_norm(o_proj(a)), residual)  post-attn, pre-ffw
//             x = rms_norm(mlp(h))                                        post-ffw
//   mlp: down_proj(act_and_mul(gate_up_proj(h))), act SiLU (a DotLinear's gated form: one
//        op) or tanh-GELU; or a mixture of experts (router, top-k, each chosen expert over
//        its rows, the shared expert behind its gate: servelm/layers/moe.py's ops in order)
//   (tensor parallel: o_proj's and the MLP's outputs all-reduced, see set_all_reduce)
//   ... final: add_rms_norm(x, residual, norm)
//
// Multi-head latent attention (DeepSeek-V2/V3, servelm/models/deepseek.py MLAttention) in
// place of the q..o lines, absorbed as its eager decode runs it:
//   q = q_proj(h) | q_b_proj(rms_norm(q_a_proj(h)));  [q_nope | q_pe] per head
//   [c | k_pe] = kv_a_proj(h); c = rms_norm(c); q_pe, k_pe reordered (rope pairs) and rotary_
//   store [c | k_pe] (the latent cache's entry); q_lat = [q_nope W_k | q_pe]
//   a = paged_decode_mla(q_lat, entries, scale) W_v;  o_proj(a)
// (W_k, W_v: kv_b's rows per head; the einsums are the eager path's.)
//
// Each layer's variant is data: its flags (attention kind, window, sandwich norms,
// activation, MLP kind) and tensors come from the model's description of itself
// (servelm/models/fast_path.py), never from its type. (1 + w) norms come as their scale tensor; the embedding's scale and the
// logits' soft-cap are outside the stack (servelm/runner/cpu_decode.py, the model's head).
//
// Linears are float (at::linear), oneDNN-packed float (PackedLinear), int4 (int4_gemm on
// panels), int8 (int8_gemm on panels), batch-invariant float (det_linear, deterministic
// mode, where the runner sends prefill chunks through the stack too: one row per token) or a
// GGUF K-quant matrix (kquant_gemm.h on the file's super-blocks). Two kinds hold other
// linears: row parts (a fused q/k/v or gate/up whose parts are separate layers, each writing
// its columns of the output; K-quant parts share one rounding of x to q8_K) and a permuted
// layer (its inner linear on x's columns gathered into the codes' order).
// A bfloat16 model runs the same ops on bfloat16 rows (float32 arithmetic inside each op),
// its float linears on oneDNN's bfloat16 GEMM, its cache bfloat16.
// Every op is reached through the dispatcher's typed handles (no boxing), so the results are
// the eager path's, bit for bit. servelm/runner/cpu_decode.py builds it and decides when a
// step may take it (CPU, float32, all sequences decoding one token).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "kquant_gemm.h"

#include <chrono>
#include <string>
#include <tuple>
#include <vector>

namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using T = const at::Tensor&;

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(T, T, double)> rms_norm =
      find_op<at::Tensor(T, T, double)>("servelm_cpu::rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(T, T, T, double)> add_rms_norm =
      find_op<std::tuple<at::Tensor, at::Tensor>(T, T, T, double)>("servelm_cpu::add_rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, T, T, T)> rotary =
      find_op<void(at::Tensor, at::Tensor, T, T, T)>("servelm_cpu::rotary_");
  c10::TypedOperatorHandle<at::Tensor(T)> silu_and_mul =
      find_op<at::Tensor(T)>("servelm_cpu::silu_and_mul");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, T, T, T)> store_kv =
      find_op<void(at::Tensor, at::Tensor, T, T, T)>("servelm_cpu::store_kv");
  using OptT = const c10::optional<at::Tensor>&;
  using PagedDecode = at::Tensor(T, T, T, T, T, int64_t, double, OptT, OptT, int64_t, double);
  c10::TypedOperatorHandle<PagedDecode> paged_decode =
      find_op<PagedDecode>("servelm_cpu::paged_decode");
  using PagedDecodeMla = at::Tensor(T, T, T, T, int64_t, double, int64_t);
  c10::TypedOperatorHandle<PagedDecodeMla> paged_decode_mla =
      find_op<PagedDecodeMla>("servelm_cpu::paged_decode_mla");
  c10::TypedOperatorHandle<at::Tensor(T, T, T, int64_t, int64_t)> int4_gemm =
      find_op<at::Tensor(T, T, T, int64_t, int64_t)>("servelm_cpu::int4_gemm");
  c10::TypedOperatorHandle<at::Tensor(T, T, T, int64_t, int64_t)> int8_gemm =
      find_op<at::Tensor(T, T, T, int64_t, int64_t)>("servelm_cpu::int8_gemm");
  c10::TypedOperatorHandle<at::Tensor(T, T, T, int64_t, int64_t)> int4_gemm_a8 =
      find_op<at::Tensor(T, T, T, int64_t, int64_t)>("servelm_cpu::int4_gemm_a8");
  c10::TypedOperatorHandle<at::Tensor(T, T, T, int64_t, int64_t)> int8_gemm_a8 =
      find_op<at::Tensor(T, T, T, int64_t, int64_t)>("servelm_cpu::int8_gemm_a8");
  c10::TypedOperatorHandle<at::Tensor(T, T, OptT, int64_t)> amx_linear =
      find_op<at::Tensor(T, T, OptT, int64_t)>("servelm_cpu::amx_linear");
  c10::TypedOperatorHandle<at::Tensor(T, T, OptT, int64_t)> dot_linear =
      find_op<at::Tensor(T, T, OptT, int64_t)>("servelm_cpu::dot_linear");
  c10::TypedOperatorHandle<at::Tensor(T, T, OptT, int64_t)> dot_linear_silu =
      find_op<at::Tensor(T, T, OptT, int64_t)>("servelm_cpu::dot_linear_silu");
  c10::TypedOperatorHandle<at::Tensor(T, T, OptT, int64_t)> det_linear =
      find_op<at::Tensor(T, T, OptT, int64_t)>("servelm_cpu::det_linear");
};

// kPacked: servelm/layers/linear.py's PackedLinear (oneDNN's packed float weight), called
// boxed: its schema's C++ types differ between torch versions. kDet: deterministic mode's
// DetLinear (servelm/layers/det_linear.py, det_gemm.cpp). kInt4A8 / kInt8A8: the same
// layers with int8 activations (quant_gemm_a8.cpp; the ops pad x to the codes' width).
// kAmx: a bfloat16 model's AmxLinear (servelm/layers/amx_linear.py, amx_gemm.cpp); kDot: its
// DotLinear (servelm/layers/dot_linear.py, dot_gemm.cpp), the same packed weight and bias.
// kKQuant: servelm/quant/kquant_linear.py's KQuantLinear (a: codes; group: ggml's type;
// k_padded: the most rows the q8_K kernel takes, more run a dequantized GEMM as it does).
// kParts: servelm/quant/row_parts_linear.py's RowPartsLinear (group: its number of parts,
// held in `parts`, rows in order). kPermuted: servelm/quant/permuted_linear.py's
// PermutedLinear (a: perm, the input column of each code column; parts[0]: its inner).
enum LinearKind : int64_t {
  kFloat = 0, kInt4 = 1, kInt8 = 2, kPacked = 3, kDet = 4, kInt4A8 = 5, kInt8A8 = 6, kAmx = 7,
  kDot = 8, kKQuant = 9, kParts = 10, kPermuted = 11
};

struct Linear {
  int64_t kind = kFloat, n = 0, group = 0, k_padded = 0;
  at::Tensor a, b, bias;  // float: (weight, -); int4: (codes, sz); int8: (codes, scale32)
  std::vector<Linear> parts;  // kParts: the row parts; kPermuted: the inner linear
};

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };
enum MlpKind : int64_t { kDense = 0, kMoE = 1 };
enum AttentionKind : int64_t { kGqa = 0, kMla = 1 };

// A gated MLP: down(act(gate_up(x))).
struct Mlp {
  int64_t act = kSilu;
  Linear gate_up, down;
};

// servelm/layers/moe.py's MoE: the router, E experts, the optional shared expert and its gate.
struct MoE {
  int64_t top_k = 1, num_groups = 1, topk_groups = 1;
  bool renormalize = true, sigmoid = false, top2_groups = false;
  double scaling = 1.0;
  Linear router;
  at::Tensor score_bias;    // DeepSeek-V3's correction bias; else undefined
  at::Tensor routed;        // Experts.num_routed_tokens [E], counted as the eager path does
  std::vector<Mlp> experts;
  bool has_shared = false;
  Mlp shared;
  c10::optional<Linear> shared_gate;
};

// Multi-head latent attention (servelm/models/fast_path.py StackMLA).
struct Mla {
  int64_t heads = 0, nope = 0, rope = 0, v_dim = 0, latent = 0;
  double scale = 1.0;  // the softmax's (YaRN's mscale folded in)
  bool low_rank = false;  // q = q_b(rms_norm(q_a(h))); else q = q(h)
  at::Tensor q_a_norm, kv_a_norm;
  at::Tensor kv_b;  // [heads * (nope + v_dim), latent]: each head's W_k rows, then W_v's
  at::Tensor perm;  // [rope] int64: the rope channels in rotate-half order
  Linear q, q_b, kv_a, o;  // q: q_proj, or q_a_proj when low_rank
};

struct Layer {
  bool sandwich = false;  // rms norms after attention and after the MLP as well
  int64_t attn_kind = kGqa;
  at::Tensor in_norm, post_norm, pre_ff_norm, post_ff_norm, k_cache, v_cache;
  at::Tensor cos, sin;  // the layer's rotary table [positions, D/2] (MLA: R/2)
  // GQA
  int64_t window = 0;  // keys a query attends (0: all)
  double softcap = 0.0, q_mult = 1.0;
  at::Tensor q_norm, k_norm;
  at::Tensor k_scale, v_scale;  // an fp8 cache's scales per KV head [K]; else undefined
  Linear qkv, o;
  Mla mla;  // kMla: the cache is the latent one ([slots, 1, latent + rope]), v_cache empty
  int64_t mlp_kind = kDense;
  Mlp mlp;
  MoE moe;
};

at::Tensor optional(const at::Tensor& t) { return t.numel() ? t : at::Tensor(); }

class DecodeStack : public torch::CustomClassHolder {
 public:
  // Three flat lists, read in this order (servelm/runner/cpu_decode.py writes them):
  //   ints: num_layers, heads, kv_heads, head_dim, block_size; floats: rms eps, attention
  //   scale; tensors: the final norm's scale. Then per layer:
  //     ints sandwich, MLP kind, attention kind;
  //     tensors in norm, post-attention norm, pre-ffw norm, post-ffw norm, K cache, V cache
  //     (absent ones empty); then the attention: GQA (read_gqa) or latent (read_mla); then
  //     the MLP: dense (read_mlp) or MoE (read_moe).
  // A linear is 3 tensors (a, b, bias) and 4 ints (kind, n, group, k_padded), then those of
  // the linears it holds (kParts, kPermuted; see layers/decode_entry.py).
  DecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
              std::vector<double> floats) {
    TORCH_CHECK(ints.size() >= 5 && floats.size() >= 2 && tensors.size() >= 1,
                "DecodeStack: bad header");
    Reader in{tensors, ints, floats, 0, 0, 0};
    const int64_t L = in.integer();
    heads_ = in.integer(), kv_heads_ = in.integer(), head_dim_ = in.integer();
    block_size_ = in.integer();
    eps_ = in.real(), scale_ = in.real();
    final_norm_ = in.tensor();
    for (int64_t i = 0; i < L; ++i) layers_.push_back(read_layer(in));
    TORCH_CHECK(in.t == tensors.size() && in.m == ints.size() && in.f == floats.size(),
                "DecodeStack: expected ", L, " layers of tensors, ints and floats, got ",
                tensors.size() - in.t, " tensors, ", ints.size() - in.m, " ints and ",
                floats.size() - in.f, " floats more");
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // Tensor parallelism (servelm/parallel/decode_stack.py): the layers hold one rank's shard
  // (its heads, its slice of the MLP), and o_proj's and down_proj's partial sums are summed
  // over the torch.distributed group named `group` where the eager path's reduction hooks
  // sum them (servelm/layers/parallel_linear.py), through torch's functional collectives
  // (gloo on the CPU). Boxed calls: their C++ signatures are not part of torch's API.
  void set_all_reduce(std::string group) {
    auto& d = c10::Dispatcher::singleton();
    all_reduce_op_ = d.findSchemaOrThrow("_c10d_functional::all_reduce_", "");
    wait_op_ = d.findSchemaOrThrow("_c10d_functional::wait_tensor", "");
    reduce_group_ = std::move(group);
  }

  // Seconds spent in all-reduces since the last call (the parallel benchmark reads it).
  double take_reduce_seconds() {
    const double s = reduce_s_;
    reduce_s_ = 0.0;
    return s;
  }

  // run() over contiguous slices of the rows at once, a thread each, every slice through
  // every layer on its own (each kernel in it single-threaded: a nested parallel_for runs
  // inline). bounds: the slices' first rows, then B. Every row's arithmetic is run()'s (each
  // kernel computes a row, or a sequence's attention, the same way at any row count), so
  // the result is run()'s, bit for bit. Rows must be independent (plain decodes: no
  // sequence's verification rows in two slices) and there must be no all-reduce.
  //
  // Why: run() splits each kernel's work between the threads, which meet at the end of
  // every kernel (~240 barriers a step; 8% of two cores' time in OpenMP's spin-waits at a
  // 64-row step on an AMD EPYC, Zen 5). A slice a thread keeps the linears' rate (one thread
  // with 32 rows does what two do with 64) and meets the other once.
  // servelm/runner/cpu_decode.py (row_parts) decides when: each slice must keep enough rows,
  // or every slice streaming all the weights costs more than it saves.
  at::Tensor run_parts(at::Tensor x, at::Tensor positions, at::Tensor slots, at::Tensor tables,
                       at::Tensor seq_lens, int64_t layers, bool final_norm,
                       std::vector<int64_t> bounds) {
    const int64_t parts = int64_t(bounds.size()) - 1;
    TORCH_CHECK(parts >= 1 && bounds.front() == 0 && bounds.back() == x.size(0),
                "DecodeStack.run_parts: bounds must run from 0 to the number of rows");
    for (int64_t p = 0; p < parts; ++p)
      TORCH_CHECK(bounds[p] < bounds[p + 1], "DecodeStack.run_parts: empty part ", p);
    TORCH_CHECK(reduce_group_.empty(), "DecodeStack.run_parts: not with an all-reduce");
    if (parts == 1) return run(x, positions, slots, tables, seq_lens, layers, final_norm);
    std::vector<at::Tensor> outs(parts);
    const at::ThreadLocalState tls;  // inference mode and the like, for the other threads
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      at::ThreadLocalStateGuard guard(tls);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t r0 = bounds[p], n = bounds[p + 1] - r0;
        outs[p] = run(x.narrow(0, r0, n), positions.narrow(0, r0, n), slots.narrow(0, r0, n),
                      tables.narrow(0, r0, n), seq_lens.narrow(0, r0, n), layers, final_norm);
      }
    });
    return at::cat(outs);
  }

  // x [B, hidden] (embedded tokens), positions / slots [B], tables [>=B, max_blocks],
  // seq_lens [B] (all int64) -> hidden states after `layers` layers (-1: all) and, with
  // final_norm, the model's final norm.
  at::Tensor run(at::Tensor x, at::Tensor positions, at::Tensor slots, at::Tensor tables,
                 at::Tensor seq_lens, int64_t layers, bool final_norm) {
    return forward(x, positions, slots, tables, seq_lens, layers, final_norm, {}, nullptr);
  }

  // run() through every layer with the final norm, and the hidden state (x + residual) after
  // each of `aux_layers` as well (an EAGLE-3 drafter's features, as DecoderLM.forward's
  // aux_layers): [final hidden states, then one [B, hidden] per aux layer, in order].
  std::vector<at::Tensor> run_aux(at::Tensor x, at::Tensor positions, at::Tensor slots,
                                  at::Tensor tables, at::Tensor seq_lens,
                                  std::vector<int64_t> aux_layers) {
    for (int64_t a : aux_layers)
      TORCH_CHECK(a >= 0 && a < num_layers(), "DecodeStack.run_aux: aux layer ", a,
                  " is not among the ", num_layers(), " layers");
    std::vector<at::Tensor> aux(aux_layers.size());
    at::Tensor out = forward(x, positions, slots, tables, seq_lens, -1, true, aux_layers, &aux);
    aux.insert(aux.begin(), out);
    return aux;
  }

 private:
  at::Tensor forward(at::Tensor x, const at::Tensor& positions, const at::Tensor& slots,
                     const at::Tensor& tables, const at::Tensor& seq_lens, int64_t layers,
                     bool final_norm, const std::vector<int64_t>& aux_layers,
                     std::vector<at::Tensor>* aux) {
    const int64_t L = layers < 0 ? num_layers() : std::min(layers, num_layers());
    at::Tensor residual;
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      at::Tensor h;
      if (i == 0) {
        residual = x;
        h = ops_.rms_norm.call(x, l.in_norm, eps_);
      } else {
        std::tie(h, residual) = ops_.add_rms_norm.call(x, residual, l.in_norm, eps_);
      }
      const at::Tensor o = l.attn_kind == kMla
                               ? mla_attention(l, h, positions, slots, tables, seq_lens)
                               : attention(l, h, positions, slots, tables, seq_lens);
      if (l.sandwich) {  // as DecoderLayer.forward with sandwich norms
        std::tie(h, residual) = ops_.add_rms_norm.call(ops_.rms_norm.call(o, l.post_norm, eps_),
                                                       residual, l.pre_ff_norm, eps_);
        x = ops_.rms_norm.call(all_reduce(mlp_of(l, h)), l.post_ff_norm, eps_);
      } else {
        std::tie(h, residual) = ops_.add_rms_norm.call(o, residual, l.post_norm, eps_);
        x = all_reduce(mlp_of(l, h));
      }
      for (size_t a = 0; a < aux_layers.size(); ++a)
        if (aux_layers[a] == i) (*aux)[a] = x + residual;
    }
    if (!final_norm) return L == 0 ? x : x + residual;
    if (L == 0) return ops_.rms_norm.call(x, final_norm_, eps_);
    return std::get<0>(ops_.add_rms_norm.call(x, residual, final_norm_, eps_));
  }

  // o_proj(attention(qkv_proj(h))), all-reduced: as Attention.forward and the torch backend's
  // decode (the C++ paged kernel, with the layer's window and soft-cap).
  at::Tensor attention(const Layer& l, const at::Tensor& h, const at::Tensor& positions,
                       const at::Tensor& slots, const at::Tensor& tables,
                       const at::Tensor& seq_lens) {
    const int64_t B = h.size(0);
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const at::Tensor qkv = linear(l.qkv, h);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({B, heads_, head_dim_});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({B, kv_heads_, head_dim_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, kv_heads_, head_dim_});
    if (l.q_norm.defined()) {
      q = head_norm(q, l.q_norm);
      k = head_norm(k, l.k_norm);
    }
    ops_.rotary.call(q, k, positions, l.cos, l.sin);
    if (l.q_mult != 1.0) q = q * l.q_mult;  // as Attention.forward: after rotary, in q's dtype
    c10::optional<at::Tensor> ks, vs;
    if (l.k_scale.defined()) {  // fp8: as KVCache.store and quantize_fp8, byte for byte
      ks = l.k_scale, vs = l.v_scale;
      store_fp8(l.k_cache, slots, k, l.k_scale);
      store_fp8(l.v_cache, slots, v, l.v_scale);
    } else {
      ops_.store_kv.call(l.k_cache, l.v_cache, slots, k, v);  // as KVCache.store
    }
    at::Tensor attn = ops_.paged_decode.call(q, l.k_cache, l.v_cache, tables, seq_lens,
                                             block_size_, scale_, ks, vs, l.window, l.softcap);
    if (attn.scalar_type() != h.scalar_type()) attn = attn.to(h.scalar_type());  // fp32 out
    return all_reduce(linear(l.o, attn.view({B, q_size})));
  }

  // o_proj(latent attention(h)), all-reduced: as MLAttention.forward and the torch backend's
  // forward_mla for a step of decodes (absorbed; the C++ latent kernel), op for op.
  at::Tensor mla_attention(const Layer& l, const at::Tensor& h, const at::Tensor& positions,
                           const at::Tensor& slots, const at::Tensor& tables,
                           const at::Tensor& seq_lens) {
    const Mla& m = l.mla;
    const int64_t B = h.size(0), H = m.heads;
    // the norms as RMSNorm.forward runs them on row-contiguous input: the fused kernel over
    // x.contiguous()
    at::Tensor q = linear(m.q, h);
    if (m.low_rank) q = linear(m.q_b, ops_.rms_norm.call(q.contiguous(), m.q_a_norm, eps_));
    const std::vector<at::Tensor> qs =
        q.view({B, H, m.nope + m.rope}).split_with_sizes({m.nope, m.rope}, -1);
    const std::vector<at::Tensor> kv =
        linear(m.kv_a, h).split_with_sizes({m.latent, m.rope}, -1);
    const at::Tensor latent = ops_.rms_norm.call(kv[0].contiguous(), m.kv_a_norm, eps_);
    at::Tensor q_pe = qs[1].index_select(-1, m.perm).contiguous();
    at::Tensor k_pe = kv[1].index_select(-1, m.perm).reshape({B, 1, m.rope}).contiguous();
    ops_.rotary.call(q_pe, k_pe, positions, l.cos, l.sin);
    const at::Tensor entry = at::cat({latent, k_pe.select(1, 0)}, -1);  // [B, L + R]
    const at::Tensor w = m.kv_b.view({H, m.nope + m.v_dim, m.latent});
    const at::Tensor q_lat =
        at::cat({at::einsum("thn,hnl->thl", {qs[0], w.narrow(1, 0, m.nope)}), q_pe}, -1);
    l.k_cache.index_copy_(0, slots, entry.unsqueeze(1).to(l.k_cache.scalar_type()));
    const at::Tensor lat = ops_.paged_decode_mla
                               .call(q_lat.contiguous(), l.k_cache.view({l.k_cache.size(0), -1}),
                                     tables, seq_lens, block_size_, m.scale, m.latent)
                               .to(h.scalar_type());  // float32 out
    const at::Tensor out = at::einsum("thl,hvl->thv", {lat, w.narrow(1, m.nope, m.v_dim)});
    return all_reduce(linear(m.o, out.reshape({B, H * m.v_dim})));
  }

  at::Tensor mlp_of(const Layer& l, const at::Tensor& h) {
    return l.mlp_kind == kMoE ? moe(l.moe, h) : mlp(l.mlp, h);
  }

  // As GatedMLP.forward.
  at::Tensor mlp(const Mlp& m, const at::Tensor& x) {
    return linear(m.down, act_and_mul(m, x));
  }

  // act(gate) * up of gate_up(x): SiLU through gate_up_silu, tanh-GELU as
  // servelm/layers/activation.py's gelu_tanh_and_mul.
  at::Tensor act_and_mul(const Mlp& m, const at::Tensor& x) {
    if (m.act == kSilu) return gate_up_silu(m.gate_up, x);
    const std::vector<at::Tensor> parts = linear(m.gate_up, x).chunk(2, -1);
    return at::gelu(parts[0], "tanh") * parts[1];
  }

  // As MoE.forward: route (servelm/layers/moe.py's route), then Experts.forward's grouping
  // of the T * k assignments by expert, each chosen expert over its rows, weighted and
  // summed back per token; then the shared expert. The same ATen ops in the same order.
  at::Tensor moe(const MoE& m, const at::Tensor& x) {
    const at::Tensor logits = linear(m.router, x).to(at::kFloat);
    const at::Tensor scores = m.sigmoid ? logits.sigmoid() : logits.softmax(-1);
    at::Tensor choice = m.score_bias.defined() ? scores + m.score_bias.to(at::kFloat) : scores;
    if (m.num_groups > 1) choice = mask_groups(m, choice);
    const at::Tensor ids = std::get<1>(choice.topk(m.top_k, -1, true, true));
    at::Tensor weights = scores.gather(1, ids);
    if (m.renormalize && m.top_k > 1)
      weights = weights / (weights.sum(at::IntArrayRef{-1}, true) + (m.sigmoid ? 1e-20 : 0.0));
    weights = weights * m.scaling;
    const int64_t k = ids.size(1), E = int64_t(m.experts.size());
    const at::Tensor flat = ids.reshape(-1);
    const at::Tensor order = at::argsort(flat, /*stable=*/true, -1, false);
    const at::Tensor token_of = at::div(order, k, "floor");
    const at::Tensor counts = at::bincount(flat, {}, E);
    m.routed.add_(counts);
    const at::Tensor rows = x.index_select(0, token_of);
    at::Tensor out = at::empty_like(rows);
    const int64_t* count = counts.data_ptr<int64_t>();
    for (int64_t e = 0, start = 0; e < E; ++e) {
      if (!count[e]) continue;
      out.narrow(0, start, count[e]).copy_(mlp(m.experts[e], rows.narrow(0, start, count[e])));
      start += count[e];
    }
    out = out * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out.scalar_type());
    at::Tensor y = at::zeros_like(x).index_add_(0, token_of, out);
    if (!m.has_shared) return y;
    at::Tensor s = mlp(m.shared, x);
    if (m.shared_gate) s = at::sigmoid(linear(*m.shared_gate, x)) * s;
    return y + s;
  }

  // moe.py's _mask_groups: the experts of each token's topk_groups best groups keep their
  // scores, the rest get 0.
  static at::Tensor mask_groups(const MoE& m, const at::Tensor& choice) {
    const int64_t t = choice.size(0), e = choice.size(1);
    const at::Tensor grouped = choice.view({t, m.num_groups, e / m.num_groups});
    const at::Tensor group_scores = m.top2_groups
        ? std::get<0>(grouped.topk(2, -1)).sum(at::IntArrayRef{-1})
        : grouped.amax(at::IntArrayRef{-1});
    const at::Tensor keep = std::get<1>(group_scores.topk(m.topk_groups, -1, true, false));
    const at::Tensor mask = at::zeros_like(group_scores).scatter_(1, keep, 1.0);
    return (grouped * mask.unsqueeze(-1)).view({t, e});
  }

  // The constructor's cursor over its flat lists.
  struct Reader {
    const std::vector<at::Tensor>& tensors;
    const std::vector<int64_t>& ints;
    const std::vector<double>& floats;
    size_t t, m, f;
    const at::Tensor& tensor() {
      TORCH_CHECK(t < tensors.size(), "DecodeStack: too few tensors");
      return tensors[t++];
    }
    int64_t integer() {
      TORCH_CHECK(m < ints.size(), "DecodeStack: too few ints");
      return ints[m++];
    }
    double real() {
      TORCH_CHECK(f < floats.size(), "DecodeStack: too few floats");
      return floats[f++];
    }
  };

  Layer read_layer(Reader& in) {
    Layer l;
    l.sandwich = in.integer() != 0, l.mlp_kind = in.integer(), l.attn_kind = in.integer();
    TORCH_CHECK((l.mlp_kind == kDense || l.mlp_kind == kMoE) &&
                    (l.attn_kind == kGqa || l.attn_kind == kMla),
                "DecodeStack: bad layer flags");
    l.in_norm = in.tensor(), l.post_norm = in.tensor();
    l.pre_ff_norm = optional(in.tensor()), l.post_ff_norm = optional(in.tensor());
    TORCH_CHECK(!l.sandwich || (l.pre_ff_norm.defined() && l.post_ff_norm.defined()),
                "DecodeStack: sandwich norms without their weights");
    l.k_cache = in.tensor(), l.v_cache = in.tensor();
    if (l.attn_kind == kMla)
      read_mla(in, l);
    else
      read_gqa(in, l);
    if (l.mlp_kind == kMoE)
      l.moe = read_moe(in);
    else
      l.mlp = read_mlp(in);
    return l;
  }

  // ints window; floats softcap, q_mult; tensors cos, sin, q norm, k norm, K scale, V scale
  // (absent ones empty); linears qkv, o.
  void read_gqa(Reader& in, Layer& l) {
    l.window = in.integer();
    TORCH_CHECK(l.window >= 0, "DecodeStack: bad window ", l.window);
    l.softcap = in.real(), l.q_mult = in.real();
    l.cos = in.tensor(), l.sin = in.tensor();
    l.q_norm = optional(in.tensor()), l.k_norm = optional(in.tensor());
    l.k_scale = optional(in.tensor()), l.v_scale = optional(in.tensor());
    l.qkv = read_linear(in), l.o = read_linear(in);
  }

  // ints heads, nope, rope, v_dim, latent, low rank; floats scale; tensors cos, sin, q_a
  // norm (empty unless low rank), kv_a norm, kv_b, the rope order; linears q_proj (or
  // q_a_proj, q_b_proj), kv_a_proj, o_proj.
  void read_mla(Reader& in, Layer& l) {
    Mla& m = l.mla;
    m.heads = in.integer(), m.nope = in.integer(), m.rope = in.integer();
    m.v_dim = in.integer(), m.latent = in.integer(), m.low_rank = in.integer() != 0;
    m.scale = in.real();
    l.cos = in.tensor(), l.sin = in.tensor();
    m.q_a_norm = optional(in.tensor()), m.kv_a_norm = in.tensor();
    m.kv_b = in.tensor(), m.perm = in.tensor();
    TORCH_CHECK(m.heads > 0 && m.nope > 0 && m.rope > 0 && m.rope % 2 == 0 && m.v_dim > 0 &&
                    m.latent > 0 && m.low_rank == m.q_a_norm.defined(),
                "DecodeStack: bad latent attention layer");
    TORCH_CHECK(m.kv_b.dim() == 2 && m.kv_b.is_contiguous() &&
                    m.kv_b.size(0) == m.heads * (m.nope + m.v_dim) && m.kv_b.size(1) == m.latent,
                "DecodeStack: kv_b must be contiguous [heads * (nope + v_dim), latent]");
    TORCH_CHECK(m.perm.dim() == 1 && m.perm.numel() == m.rope &&
                    m.perm.scalar_type() == at::kLong,
                "DecodeStack: the rope order must be int64 [rope]");
    TORCH_CHECK(l.k_cache.dim() == 3 && l.k_cache.size(1) == 1 &&
                    l.k_cache.size(2) == m.latent + m.rope && l.k_cache.is_contiguous(),
                "DecodeStack: the latent cache must be contiguous [slots, 1, latent + rope]");
    TORCH_CHECK(l.cos.dim() == 2 && l.cos.size(1) * 2 == m.rope,
                "DecodeStack: the rope table must be [positions, rope / 2]");
    m.q = read_linear(in);
    if (m.low_rank) m.q_b = read_linear(in);
    m.kv_a = read_linear(in), m.o = read_linear(in);
  }

  // ints: activation; linears gate_up, down.
  Mlp read_mlp(Reader& in) {
    Mlp m;
    m.act = in.integer();
    TORCH_CHECK(m.act == kSilu || m.act == kGeluTanh, "DecodeStack: unknown activation ", m.act);
    m.gate_up = read_linear(in), m.down = read_linear(in);
    return m;
  }

  // ints: E, top_k, renormalize, sigmoid scores, num_groups, topk_groups, top-2 group score,
  // has shared expert, has shared gate; floats: scaling; tensors: score bias (or empty), the
  // routed-token counts [E] int64; linears: the router; then E experts and the shared expert
  // (read_mlp each), then the shared gate.
  MoE read_moe(Reader& in) {
    MoE m;
    const int64_t E = in.integer();
    m.top_k = in.integer(), m.renormalize = in.integer() != 0, m.sigmoid = in.integer() != 0;
    m.num_groups = in.integer(), m.topk_groups = in.integer();
    m.top2_groups = in.integer() != 0;
    m.has_shared = in.integer() != 0;
    const bool has_gate = in.integer() != 0;
    m.scaling = in.real();
    m.score_bias = optional(in.tensor()), m.routed = in.tensor();
    TORCH_CHECK(E >= 1 && m.top_k >= 1 && m.top_k <= E && m.num_groups >= 1 &&
                    E % m.num_groups == 0 && m.routed.numel() == E &&
                    m.routed.scalar_type() == at::kLong && m.routed.is_contiguous(),
                "DecodeStack: bad mixture-of-experts layer");
    m.router = read_linear(in);
    for (int64_t e = 0; e < E; ++e) m.experts.push_back(read_mlp(in));
    if (m.has_shared) m.shared = read_mlp(in);
    if (has_gate) m.shared_gate = read_linear(in);
    return m;
  }

  Linear read_linear(Reader& in) {
    Linear l;
    l.kind = in.integer(), l.n = in.integer(), l.group = in.integer();
    l.k_padded = in.integer();
    TORCH_CHECK(l.kind >= kFloat && l.kind <= kPermuted, "DecodeStack: unknown linear kind ",
                l.kind);
    l.a = in.tensor(), l.b = in.tensor(), l.bias = optional(in.tensor());
    if (l.kind == kPacked && !mkldnn_linear_)
      mkldnn_linear_ = c10::Dispatcher::singleton().findSchemaOrThrow(
          "mkldnn::_linear_pointwise", "");
    if (l.kind == kParts || l.kind == kPermuted) {
      const int64_t held = l.kind == kParts ? l.group : 1;
      TORCH_CHECK(held >= 1, "DecodeStack: a row-parts linear without parts");
      int64_t n = 0;
      for (int64_t p = 0; p < held; ++p) {
        l.parts.push_back(read_linear(in));
        n += l.parts.back().n;
      }
      TORCH_CHECK(n == l.n, "DecodeStack: parts of ", n, " rows for a linear of ", l.n);
    }
    return l;
  }

  // silu_and_mul(gate_up(x)): in one pass for a DotLinear of 2 I rows, I a multiple of 16, as
  // its eager forward takes it (servelm/layers/activation.py, gate_up_silu).
  at::Tensor gate_up_silu(const Linear& l, const at::Tensor& x) {
    if (l.kind == kDot && l.n % 32 == 0)
      return ops_.dot_linear_silu.call(
          x.stride(1) == 1 ? x : x.contiguous(), l.a,
          l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt, l.n);
    return ops_.silu_and_mul.call(linear(l, x));
  }

  at::Tensor linear(const Linear& l, const at::Tensor& x) {
    if (l.kind == kKQuant) {
      c10::optional<servelm_kquant::QuantizedRows> q8;
      return kquant_linear(l, x, q8);
    }
    if (l.kind == kParts) return row_parts(l, x);
    if (l.kind == kPermuted) return linear(l.parts[0], x.index_select(1, l.a));  // as its forward
    if (l.kind == kAmx || l.kind == kDot)  // as AmxLinear / DotLinear.forward; bias float32
      return (l.kind == kAmx ? ops_.amx_linear : ops_.dot_linear)
          .call(x.stride(1) == 1 ? x : x.contiguous(), l.a,
                l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt, l.n);
    if (l.kind == kDet)
      return ops_.det_linear.call(x, l.a, l.bias.defined() ? c10::optional<at::Tensor>(l.bias)
                                                           : c10::nullopt, l.n);
    if (l.kind == kFloat) return at::linear(x, l.a, l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt);
    if (l.kind == kPacked) {  // as PackedLinear.forward: (x, w, bias, "none", [], "")
      torch::jit::Stack stack{x, l.a, l.bias.defined() ? c10::IValue(l.bias) : c10::IValue(),
                              std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                              std::string("")};
      mkldnn_linear_->callBoxed(&stack);
      return stack[0].toTensor();
    }
    if (x.scalar_type() != at::kFloat && (l.kind == kInt4 || l.kind == kInt8)) {
      // float32 rows only: a bfloat16 row widens exactly, the result rounds back once (as
      // Int4Linear / Int8Linear.forward do for a bfloat16 model's MixedLinear)
      return linear(l, x.to(at::kFloat)).to(x.scalar_type());
    }
    at::Tensor y;
    if (l.kind == kInt4A8) {
      y = ops_.int4_gemm_a8.call(x.contiguous(), l.a, l.b, l.n, l.group);
    } else if (l.kind == kInt8A8) {
      y = ops_.int8_gemm_a8.call(x.contiguous(), l.a, l.b, l.n, l.group);
    } else if (l.kind == kInt4) {
      at::Tensor xp = x.size(1) == l.k_padded ? x : at::constant_pad_nd(x, {0, l.k_padded - x.size(1)});
      y = ops_.int4_gemm.call(xp.contiguous(), l.a, l.b, l.n, l.group);
    } else {
      y = ops_.int8_gemm.call(x.contiguous(), l.a, l.b, l.n, l.group);
    }
    return l.bias.defined() ? y + l.bias : y;
  }

  // As KQuantLinear.forward: at most k_padded rows on x rounded to q8_K (once, into q8, for
  // every K-quant part of a fused layer), else the dequantized weight's GEMM; then its bias
  // as it adds it, in x's dtype.
  static at::Tensor kquant_linear(const Linear& l, const at::Tensor& x,
                                  c10::optional<servelm_kquant::QuantizedRows>& q8) {
    const int64_t M = x.size(0);
    at::Tensor y;
    if (M <= l.k_padded) {
      if (!q8) q8 = servelm_kquant::quantize_rows(x.contiguous());
      y = at::empty({M, l.n}, x.options().dtype(at::kFloat));
      servelm_kquant::gemm(*q8, l.a, l.group, l.n, y.data_ptr<float>(), l.n);
      if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
    } else {
      y = at::mm(x, servelm_kquant::dequant(l.a, l.group, l.n, x.scalar_type()).t());
    }
    if (l.bias.defined()) y = y + l.bias;
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }

  // As RowPartsLinear.forward (its parts' outputs side by side), each part written into its
  // columns: a float32 K-quant part without a bias by the kernel itself, the others copied.
  at::Tensor row_parts(const Linear& l, const at::Tensor& x) {
    const int64_t M = x.size(0);
    at::Tensor y = at::empty({M, l.n}, x.options());
    c10::optional<servelm_kquant::QuantizedRows> q8;
    int64_t col = 0;
    for (const Linear& p : l.parts) {
      if (p.kind == kKQuant && M <= p.k_padded && !p.bias.defined() &&
          x.scalar_type() == at::kFloat) {
        if (!q8) q8 = servelm_kquant::quantize_rows(x.contiguous());
        servelm_kquant::gemm(*q8, p.a, p.group, p.n, y.data_ptr<float>() + col, l.n);
      } else {
        y.narrow(1, col, p.n).copy_(p.kind == kKQuant ? kquant_linear(p, x, q8) : linear(p, x));
      }
      col += p.n;
    }
    return y;
  }

  // code = saturate(x / scale) rounded to e4m3, written through byte views (index_copy_ has
  // no fp8 kernel on the CPU): the ops of servelm/quant/fp8.py and KVCache.store.
  static void store_fp8(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& x,
                        const at::Tensor& scale) {
    const at::Tensor codes = (x.to(at::kFloat) / scale.unsqueeze(1))
                                 .clamp_(-448.0, 448.0)
                                 .to(at::kFloat8_e4m3fn);
    cache.view(at::kByte).index_copy_(0, slots, codes.view(at::kByte));
  }

  // RMSNorm over each head's D values (Qwen3's q_norm / k_norm), as RMSNorm.forward does for
  // a [T, H, D] view: copied to contiguous rows, then the fused kernel.
  at::Tensor head_norm(const at::Tensor& t, const at::Tensor& w) {
    if (t.stride(-1) == 1) return ops_.rms_norm.call(t.contiguous(), w, eps_);
    return at::rms_norm(t, {t.size(-1)}, w, eps_);
  }

  // In place over the group set by set_all_reduce; t itself when there is none.
  at::Tensor all_reduce(at::Tensor t) {
    if (reduce_group_.empty()) return t;
    const auto start = std::chrono::steady_clock::now();
    torch::jit::Stack stack{t, std::string("sum"), reduce_group_};
    all_reduce_op_->callBoxed(&stack);
    wait_op_->callBoxed(&stack);  // wait_tensor(the all-reduce's output): t, summed
    reduce_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return t;
  }

  Ops ops_;
  c10::optional<c10::OperatorHandle> mkldnn_linear_;
  c10::optional<c10::OperatorHandle> all_reduce_op_, wait_op_;
  std::string reduce_group_;  // a torch.distributed group's name; "" without parallelism
  double reduce_s_ = 0.0;  // seconds in all-reduces (waiting for the peers included)
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0, block_size_ = 0;
  double eps_ = 0.0, scale_ = 0.0;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(servelm_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_all_reduce", &DecodeStack::set_all_reduce)
      .def("take_reduce_seconds", &DecodeStack::take_reduce_seconds)
      .def("run", &DecodeStack::run)
      .def("run_aux", &DecodeStack::run_aux)
      .def("run_parts", &DecodeStack::run_parts);
}
