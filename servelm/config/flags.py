"""The engine's command-line flags, shared by `generate`, `chat`, `serve` and `bench`.

Owns: add_engine_cli_args (each flag's default read from EngineArgs, never repeated here),
engine_args_from_cli, parse_bytes.
Never: holds a default of its own or validates beyond parsing (EngineArgs does).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from servelm.config.engine import (KV_CACHE_DTYPES, KV_RELOAD_POLICIES, PARALLEL_LAUNCHERS,
                                   RAY_PLACEMENTS, SCHEDULING_POLICIES, SPEC_METHODS, SPEC_TREES,
                                   EngineArgs)
from servelm.quant import quant_method_names  # torch-free: the registry's names
from servelm.quant.int8_act import ACTIVATIONS as QUANT_ACTIVATIONS  # torch-free


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2GB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    s = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(s)


def _default(name: str) -> Any:
    """EngineArgs' default for a field: the flags never repeat the dataclass's literals."""
    return _ENGINE_DEFAULTS[name]


_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}


def _cpu_kernels_arg(text: str) -> str:
    import argparse

    from servelm.config.cpu_kernel_choice import CpuKernelChoice

    try:
        CpuKernelChoice.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_engine_cli_args(parser) -> None:
    """Engine flags shared by `generate`, `chat`, `serve` and `bench`; defaults from
    EngineArgs."""
    d = _default
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=d("max_model_len"),
                   help="longest prompt + output a request may reach, in tokens (default: "
                        "the model's context length)")
    g.add_argument("--block-size", type=int, default=d("block_size"),
                   help="tokens per KV cache block, a power of two (default %(default)s)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=d("kv_cache_memory"),
                   help="bytes for the KV cache, e.g. 2GiB (default: a fraction of free memory)")
    g.add_argument("--memory-fraction", type=float, default=d("memory_fraction"),
                   help="share of free memory for the KV cache when --kv-cache-memory is unset")
    g.add_argument("--num-blocks", type=int, default=d("num_blocks"),
                   help="KV cache blocks, overriding the memory budget (small pools for "
                        "tests and experiments; default: from --kv-cache-memory)")
    g.add_argument("--max-num-seqs", type=int, default=d("max_num_seqs"),
                   help="sequences in one step's batch, at most (default %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d("max_num_batched_tokens"),
                   help="tokens in one step (decodes and prefill chunks share it; default "
                        "%(default)s)")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   default=d("enable_chunked_prefill"),
                   help="compute a prompt in one step instead of chunks within the token "
                        "budget")
    g.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                   default=d("enable_prefix_caching"),
                   help="disable prefix caching (for comparison)")
    g.add_argument("--prompt-cache-retention-blocks", dest="max_retained_blocks", type=int,
                   default=d("max_retained_blocks"),
                   help="prefix-cache blocks one tenant (OpenAI-Project) may keep ahead of "
                        "others for requests with prompt_cache_retention 24h, and as many "
                        "in the KV tiers; past it its oldest go back to LRU (0: off)")
    g.add_argument("--max-num-encoder-tokens", type=int, default=d("max_num_encoder_tokens"),
                   help="vision models: image tokens whose encoding may start in one step, so "
                        "a burst of images cannot stall decoding (0: no limit; default "
                        "%(default)s)")
    g.add_argument("--encoder-cache-tokens", type=int, default=d("encoder_cache_tokens"),
                   help="vision models: image embeddings kept by content hash, in tokens "
                        "(default %(default)s)")
    g.add_argument("--scheduling-policy", default=d("scheduling_policy"),
                   choices=list(SCHEDULING_POLICIES),
                   help="fcfs: arrival order; slo: by SLO class and deadline slack, chunks "
                        "sized from the TPOT targets, early 429 for a TTFT that cannot be met "
                        "(docs/slo.md; default %(default)s)")
    g.add_argument("--slo-cost-model", default=d("slo_cost_model"), metavar="FILE",
                   help="step-cost model (`servelm bench calibrate`) the slo policy sizes "
                        "chunks and predicts TTFTs with; without one it only orders the queue")
    g.add_argument("--step-trace", default=d("step_trace"), metavar="FILE",
                   help="write each step's shape and wall time (start to next start) to FILE, "
                        "as JSON lines, for `servelm bench calibrate --served-steps` (docs/sim.md)")
    g.add_argument("--device", default=d("device"),
                   help="cpu, cuda or cuda:N (default %(default)s)")
    g.add_argument("--dtype", default=d("dtype"),
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype; auto: bfloat16 where the CPU runs bfloat16 dot products "
                        "(checked at start-up) and the checkpoint is stored in 16 bits or "
                        "fewer, else float32; on a GPU bfloat16 (default %(default)s)")
    g.add_argument("--attention-backend", default=d("attention_backend"),
                   choices=["torch", "triton"],
                   help="torch: the CPU reference and C++ kernels; triton: GPU kernels "
                        "(default %(default)s)")
    g.add_argument("--cuda-graphs", action="store_true", default=d("cuda_graphs"),
                   help="capture decode steps as CUDA graphs (GPU, triton backend)")
    g.add_argument("--engine-seed", dest="seed", type=int, default=d("seed"),
                   help="seed of the stream unseeded requests sample from")
    g.add_argument("--threads", dest="num_threads", type=int, default=d("num_threads"),
                   help="torch's intra-op threads on the CPU (default: torch's choice)")
    g.add_argument("--deterministic", action="store_true", default=d("deterministic"),
                   help="batch-invariant kernels: the same request gives the same tokens and "
                        "logprobs whatever the batch, chunking, prefix-cache hits, preemption "
                        "or speculation (CPU: float32 or bfloat16; GPU: attention backend "
                        "'triton'; dense models; docs/determinism.md)")
    g.add_argument("--quantization", default=d("quantization"), choices=quant_method_names(),
                   help="quantization of the linear layers: weight-only int8/int4; 'gguf' "
                        "keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks as they are; 'gguf-mixed' "
                        "uses them for steps of a few rows and their bf16 values for larger "
                        "ones (docs/quantization.md); 'fp8' is W8A8 "
                        "on CUDA sm89+ GPUs (default: float)")
    g.add_argument("--quant-activations", default=d("quant_activations"),
                   choices=list(QUANT_ACTIVATIONS),
                   help="quantized layers on the CPU: 'int8' rounds activations to int8 per 32 "
                        "values and multiplies with integer dot products (where the CPU runs "
                        "avx512_vnni, else float; docs/quantization.md has its accuracy cost), "
                        "'float' keeps float32 (default %(default)s)")
    g.add_argument("--kv-cache-dtype", default=d("kv_cache_dtype"),
                   choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: 'auto' = the model's --dtype; 'fp8' = e4m3 codes "
                        "with a scale per layer and KV head (half the bytes of bf16)")
    g.add_argument("--cpu-kernels", type=_cpu_kernels_arg, default=d("cpu_kernels"),
                   metavar="MODE|PART=MODE,...",
                   help="servelm's C++ CPU kernels: 'auto' (where they build, else torch), "
                        "'kernel' (or an error), 'torch' (never); per part, e.g. "
                        "'attention=torch,decode=kernel' (parts: attention, decode, "
                        "layer_ops, quant, gemm (float32 decode steps on servelm's panel "
                        "GEMM); default %(default)s). The start-up log (-v) says "
                        "which path each part took")
    g.add_argument("--no-prepared-weights-cache", dest="prepared_weights_cache",
                   action="store_false", default=d("prepared_weights_cache"),
                   help="load the checkpoint every start instead of the float parameters "
                        "prepared at the last one ($SERVELM_HOME/prepared; docs/server.md)")
    pa = parser.add_argument_group("model parallelism (docs/parallel.md)")
    pa.add_argument("--tensor-parallel-size", type=int,
                    default=d("tensor_parallel_size"), metavar="N",
                    help="shard every layer over N worker processes (torch.distributed: gloo "
                         "on the CPU, cores split between them; NCCL on GPUs)")
    pa.add_argument("--pipeline-parallel-size", type=int,
                    default=d("pipeline_parallel_size"), metavar="M",
                    help="split the layers into M stages of --tensor-parallel-size workers each")
    pa.add_argument("--enable-expert-parallel", action="store_true",
                    default=d("enable_expert_parallel"),
                    help="MoE: place whole experts across the tensor-parallel ranks (tokens "
                         "dispatched and combined by all-to-all) instead of slicing each")
    pa.add_argument("--parallel-master", default=d("parallel_master"), metavar="HOST:PORT",
                    help="the workers are started elsewhere (other machines: torchrun-style "
                         "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or Ray) and join this "
                         "rank 0 at HOST:PORT (default: rank 0 starts them here)")
    pa.add_argument("--parallel-launcher", choices=PARALLEL_LAUNCHERS,
                    default=d("parallel_launcher"),
                    help="how rank 0 starts the other ranks: process (child processes on "
                         "this machine) or ray (Ray actors in one placement group over the "
                         "cluster: $RAY_ADDRESS or one started here; docs/parallel.md)")
    pa.add_argument("--parallel-placement", choices=RAY_PLACEMENTS,
                    default=d("parallel_placement"),
                    help="with --parallel-launcher ray: the placement group's strategy "
                         "(PACK: as few nodes as fit; STRICT_PACK: one node; SPREAD: one "
                         "rank per node where it can; STRICT_SPREAD: always)")
    lo = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    lo.add_argument("--lora", dest="lora_modules", action="append", default=None,
                    metavar="NAME=PATH",
                    help="serve the PEFT adapter at PATH as model NAME (repeatable)")
    lo.add_argument("--enable-lora", action="store_true", default=d("enable_lora"),
                    help="accept adapters loaded at run time (implied by --lora)")
    lo.add_argument("--max-loras", type=int, default=d("max_loras"),
                    help="adapter slots: distinct adapters in one step (default %(default)s)")
    lo.add_argument("--max-lora-rank", type=int, default=d("max_lora_rank"),
                    help="largest adapter rank r accepted (default %(default)s)")
    kv = parser.add_argument_group("KV tiers below the device pool (docs/kv_tiers.md)")
    kv.add_argument("--kv-host-memory-gb", type=float, default=d("kv_host_memory_gb"),
                    help="host memory for KV blocks evicted from the device pool (GB; "
                         "default %(default)s: off)")
    kv.add_argument("--kv-disk-dir", default=d("kv_disk_dir"),
                    help="directory for KV blocks evicted from host memory, kept across "
                         "restarts of the same model and servelm version")
    kv.add_argument("--kv-disk-gb", type=float, default=d("kv_disk_gb"),
                    help="most bytes the disk tier's files take (GB)")
    kv.add_argument("--kv-reload-policy", default=d("kv_reload_policy"),
                    choices=list(KV_RELOAD_POLICIES),
                    help="a prefix found below the pool: reload it when that is cheaper "
                         "than recomputing it ('cost'), or always / never")
    kv.add_argument("--kv-tiers-cost-model", default=d("kv_tiers_cost_model"),
                    metavar="PATH",
                    help="step-cost model (servelm bench calibrate) for the recompute "
                         "estimate (default: fitted on this engine's own steps)")
    dg = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    dg.add_argument("--role", dest="disagg_role", default=d("disagg_role"),
                    choices=["colocated", "prefill", "decode"],
                    help="prefill: compute prompts and serve their KV blocks to decode "
                         "workers; decode: pull a request's prompt KV from the prefill worker "
                         "the router names, then decode (default %(default)s: both here)")
    dg.add_argument("--kv-transport", default=d("kv_transport"),
                    help="how KV blocks move: tcp (any two hosts), shm (same host, shared "
                         "memory) or inproc (one process) (default %(default)s)")
    dg.add_argument("--kv-address", default=d("kv_address"), metavar="ADDR",
                    help="prefill role: where decode workers pull KV from, tcp://HOST:PORT "
                         "or shm:///path.sock (default: the HTTP port + 1000 on tcp)")
    dg.add_argument("--kv-lease-s", type=float, default=d("kv_lease_s"),
                    help="decode role: seconds blocks reserved for a transfer wait for it "
                         "before the prompt is computed here instead (default %(default)s)")
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", default=d("speculative_method"), choices=SPEC_METHODS,
                   help="propose tokens with an n-gram lookup, a draft model, an EAGLE-3 "
                        "head or the model's own multi-token-prediction layers (mtp: "
                        "DeepSeek-V3) and verify them in one target step (default: off)")
    s.add_argument("--num-speculative-tokens", type=int, default=d("num_speculative_tokens"),
                   help="most draft tokens per sequence and step (k)")
    s.add_argument("--spec-ngram-max", type=int, default=d("spec_ngram_max"),
                   help="ngram: longest suffix looked up in the context (default %(default)s)")
    s.add_argument("--spec-ngram-min", type=int, default=d("spec_ngram_min"),
                   help="ngram: shortest suffix looked up (default %(default)s)")
    s.add_argument("--spec-draft-model", "--speculative-model", default=d("spec_draft_model"),
                   help="draft model (cached name, GGUF file, HF dir or ORG/NAME; same "
                        "tokenizer), or for eagle3 the EAGLE-3 head's directory")
    s.add_argument("--spec-draft-layers", type=int, default=d("spec_draft_layers"),
                   help="draft with the target's own first N layers and its head")
    s.add_argument("--spec-draft-quantization", default=d("spec_draft_quantization"),
                   choices=quant_method_names(),
                   help="draft with a copy of the target (or --spec-draft-model) quantized so")
    s.add_argument("--no-spec-adaptive", dest="spec_adaptive", action="store_false",
                   default=d("spec_adaptive"),
                   help="always speculate k tokens, even past the break-even batch")
    s.add_argument("--spec-tree", default=d("spec_tree"), choices=SPEC_TREES,
                   help="eagle3: draft a tree of up to k nodes and verify it in one step "
                        "(static: top-k per depth; dynamic: EAGLE-2's confidence-pruned "
                        "tree) (default %(default)s: a chain)")
    s.add_argument("--spec-tree-topk", type=int, default=d("spec_tree_topk"),
                   help="tree drafting: children per expanded node (default %(default)s)")


def engine_args_from_cli(args) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(args).items() if k in names})
