"""The engine's configuration: EngineArgs (every engine option, one frozen dataclass) and the
parts it hands each component: CacheConfig, KVTiersConfig, SchedulerConfig,
SpeculativeConfig, ParallelConfig.

Owns: the options, their defaults, their flags' help (each EngineArgs field's `option`
metadata) and their validation (a bad value names its option).
Never: mutated after start-up (values found at run time, such as the number of KV blocks, are
passed explicitly, not written back here); imports torch; parses a command line (flags.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.config.option import option
from servelm.config.quant_choices import (QUANT_ACTIVATIONS, QUANT_METHOD_NAMES,
                                          check_quant_activations)

KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks; pool size from a memory budget."""

    block_size: int = 16
    # Bytes for the KV pool. None: `memory_fraction` of the memory free after loading weights.
    kv_cache_memory_bytes: int | None = None
    memory_fraction: float = 0.25
    # Hard cap on the number of blocks (tests use it to force preemption).
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Prefix-cache blocks one tenant (OpenAI-Project) may hold under prompt_cache_retention
    # "24h", kept ahead of others in the eviction order, and as many in the KV tiers (0: off).
    max_retained_blocks: int = 512
    # "auto": blocks in the model's dtype; "fp8": float8_e4m3fn codes with a static scale per
    # layer and KV head (servelm/attention/kv_cache.py): a block takes 1 byte per element.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_retained_blocks < 0:
            raise ValueError(f"max_retained_blocks must be >= 0, got {self.max_retained_blocks}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


SCHEDULING_POLICIES = ("fcfs", "slo")


KV_RELOAD_POLICIES = ("cost", "always", "never")


@dataclass(frozen=True)
class KVTiersConfig:
    """KV tiers below the device pool (servelm/kv_tiers/, docs/kv_tiers.md): host memory and
    a directory on disk, each with its own byte limit; blocks the pool evicts move down.
    reload_policy: "cost" reloads a prefix found below the pool when its bytes over the
    tier's measured bandwidth take less than recomputing it (the step-cost model at
    `cost_model`, a `servelm bench calibrate` file, else fitted on this engine's own steps);
    "always" / "never" force one side (benchmarks)."""

    host_memory_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    reload_policy: str = "cost"
    cost_model: str | None = None

    def __post_init__(self) -> None:
        if self.host_memory_bytes < 0:
            raise ValueError(f"kv_host_memory_gb must be >= 0, got {self.host_memory_bytes} B")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ValueError("kv_disk_dir needs a positive kv_disk_gb (the disk tier's limit)")
        if self.disk_dir is None and self.disk_bytes > 0:
            raise ValueError("kv_disk_gb needs kv_disk_dir (where the disk tier's files go)")
        if self.reload_policy not in KV_RELOAD_POLICIES:
            raise ValueError(f"kv_reload_policy must be one of {KV_RELOAD_POLICIES}, got "
                             f"{self.reload_policy!r}")

    @property
    def is_enabled(self) -> bool:
        return self.host_memory_bytes > 0 or self.disk_dir is not None


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: one token budget shared by decodes and prefill chunks."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    # Image tokens whose vision encoding may start in one step (servelm/vision/budget.py);
    # 0: no limit beyond the token budget.
    max_num_encoder_tokens: int = 2048
    # "fcfs": arrival order; "slo": by class and deadline slack, prefill chunks sized from
    # the TPOT targets, early refusal of what cannot meet its TTFT (servelm/engine/slo_policy.py)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_encoder_tokens < 0:
            raise ValueError("max_num_encoder_tokens must be >= 0 (0: no encoder budget)")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                             f"{self.scheduling_policy!r}")


SPEC_METHODS = ("ngram", "draft", "eagle3", "mtp")
SPEC_TREES = ("off", "static", "dynamic")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to `num_tokens` tokens per sequence and the
    target scores them all in one step (servelm/spec/).

    method: "ngram" (prompt lookup, no model) or "draft" (a draft model: `draft_model`, a
    smaller model with the same tokenizer; or the target itself made cheaper: its first
    `draft_layers` layers plus its head, or a copy quantized with `draft_quantization`), or
    "eagle3" (an EAGLE-3 head in `draft_model` reading the target's hidden states), or
    "mtp" (the target checkpoint's own multi-token-prediction layers, DeepSeek-V3's).
    adaptive: shrink k, or turn speculation off for a step, when the measured acceptance and
    step times say it no longer pays at the current batch size.
    tree: eagle3 drafts a tree of up to `num_tokens` nodes ("static": top-k per depth;
    "dynamic": EAGLE-2's confidence-pruned tree, `tree_topk` children per expanded node) and
    verifies it in one step (servelm/spec/tree.py); "off": a chain.
    """

    method: str
    num_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 2
    draft_model: str | None = None
    draft_layers: int | None = None
    draft_quantization: str | None = None
    adaptive: bool = True
    tree: str = "off"
    tree_topk: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.method == "eagle3" and (self.draft_model is None or self.draft_layers
                                        or self.draft_quantization):
            raise ValueError("speculative method 'eagle3' needs --speculative-model (an "
                             "EAGLE-3 checkpoint) and takes no --spec-draft-layers or "
                             "--spec-draft-quantization")
        if self.method == "mtp" and (self.draft_model or self.draft_layers
                                     or self.draft_quantization):
            raise ValueError("speculative method 'mtp' drafts with the target's own "
                             "multi-token-prediction layers: it takes no --speculative-model, "
                             "--spec-draft-layers or --spec-draft-quantization")
        if self.tree not in SPEC_TREES:
            raise ValueError(f"spec_tree must be one of {SPEC_TREES}, got {self.tree!r}")
        if self.tree != "off" and self.method != "eagle3":
            raise ValueError(f"spec_tree {self.tree!r}: tree drafting needs --speculative-method "
                             f"eagle3, got {self.method!r} (ngram and draft models propose one "
                             "chain; mtp's targets keep an MLA cache the tree mask does not cover)")
        if self.tree_topk < 1:
            raise ValueError(f"spec_tree_topk must be >= 1, got {self.tree_topk}")
        if self.method == "draft":
            if (self.draft_model, self.draft_layers, self.draft_quantization) == (None,) * 3:
                raise ValueError("speculative method 'draft' needs --spec-draft-model, "
                                 "--spec-draft-layers or --spec-draft-quantization")
            if self.draft_layers is not None and (self.draft_model or self.draft_quantization):
                raise ValueError("spec_draft_layers drafts with the target's own layers: it "
                                 "takes no --spec-draft-model or --spec-draft-quantization")
            if self.draft_layers is not None and self.draft_layers < 1:
                raise ValueError(f"spec_draft_layers must be >= 1, got {self.draft_layers}")


@dataclass(frozen=True)
class ParallelConfig:
    """Model parallelism of one replica (servelm/parallel/, docs/parallel.md): tensor-parallel
    ranks times pipeline stages, one worker process each; with expert parallelism the
    tensor-parallel ranks hold whole experts (a share each) instead of a slice of every one."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError("enable_expert_parallel places experts across the "
                             "tensor-parallel ranks: it needs tensor_parallel_size >= 2")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


# EngineArgs.parallel_launcher's names (servelm/parallel/launcher.py) and, for "ray", Ray's
# placement group strategies (PACK: as few nodes as fit; STRICT_PACK: one node; SPREAD: one
# rank per node where it can; STRICT_SPREAD: always).
PARALLEL_LAUNCHERS = ("process", "ray")
RAY_PLACEMENTS = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "triton")
DISAGG_ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine, as the CLI and the Python API take it. Each
    option's flag and help are in its field's metadata (`option`): config/flags.py builds
    the command line from them."""

    model: str
    max_model_len: int | None = option(None,
                                       "longest prompt + output a request may reach, in tokens "
                                       "(default: the model's context length)")
    block_size: int = option(16, "tokens per KV cache block, a power of two (default %(default)s)")
    # bytes
    kv_cache_memory: int | None = option(None,
                                         "bytes for the KV cache, e.g. 2GiB (default: a fraction "
                                         "of free memory)",
                                         parse="bytes")
    memory_fraction: float = option(0.25,
                                    "share of free memory for the KV cache when --kv-cache-memory "
                                    "is unset")
    num_blocks: int | None = option(None,
                                    "KV cache blocks, overriding the memory budget (small pools "
                                    "for tests and experiments; default: from --kv-cache-memory)")
    max_num_seqs: int = option(128, "sequences in one step's batch, at most (default %(default)s)")
    max_num_batched_tokens: int = option(2048,
                                         "tokens in one step (decodes and prefill chunks share it; "
                                         "default %(default)s)")
    enable_chunked_prefill: bool = option(True,
                                          "compute a prompt in one step instead of chunks within "
                                          "the token budget",
                                          names=("--no-chunked-prefill",))
    enable_prefix_caching: bool = option(True, "disable prefix caching (for comparison)",
                                         names=("--no-prefix-cache",))
    max_retained_blocks: int = option(CacheConfig.max_retained_blocks,
                                      "prefix-cache blocks one tenant (OpenAI-Project) may keep "
                                      "ahead of others for requests with prompt_cache_retention "
                                      "24h, and as many in the KV tiers; past it its oldest go "
                                      "back to LRU (0: off)",
                                      names=("--prompt-cache-retention-blocks",))
    # Vision-language models (docs/vision.md): image tokens whose encoding may start in one
    # step (0: no encoder budget), and the runner's encoder cache size in image tokens.
    max_num_encoder_tokens: int = option(2048,
                                         "vision models: image tokens whose encoding may start in "
                                         "one step, so a burst of images cannot stall decoding (0: "
                                         "no limit; default %(default)s)")
    encoder_cache_tokens: int = option(16384,
                                       "vision models: image embeddings kept by content hash, in "
                                       "tokens (default %(default)s)")
    device: str = option("cpu", "cpu, cuda or cuda:N (default %(default)s)")
    # "auto": bfloat16 on a CPU that runs bfloat16 dot products (probed) for a checkpoint
    # stored in 16 bits or fewer, else float32; bfloat16 on a GPU (servelm/dtype_choice.py).
    dtype: str = option("auto",
                        "compute dtype; auto: bfloat16 where the CPU runs bfloat16 dot products "
                        "(checked at start-up) and the checkpoint is stored in 16 bits or fewer, "
                        "else float32; on a GPU bfloat16 (default %(default)s)",
                        choices=DTYPES)
    attention_backend: str = option("torch",
                                    "torch: the CPU reference and C++ kernels; triton: GPU kernels "
                                    "(default %(default)s)",
                                    choices=ATTENTION_BACKENDS)
    # capture decode steps (needs --device cuda, triton backend)
    cuda_graphs: bool = option(False, "capture decode steps as CUDA graphs (GPU, triton backend)")
    seed: int = option(0, "seed of the stream unseeded requests sample from",
                       names=("--engine-seed",))
    # torch intra-op threads on CPU; None: torch's default
    num_threads: int | None = option(None, "torch's intra-op threads on the CPU (default: torch's "
                                     "choice)",
                                     names=("--threads",))
    # Batch-invariant kernels: a request's tokens and logprobs do not depend on the load
    # (servelm/runner/deterministic.py, docs/determinism.md). CPU float32 or bfloat16 (the
    # model's dtype) or the GPU's Triton path; dense models.
    deterministic: bool = option(False,
                                 "batch-invariant kernels: the same request gives the same tokens "
                                 "and logprobs whatever the batch, chunking, prefix-cache hits, "
                                 "preemption or speculation (CPU: float32 or bfloat16; GPU: "
                                 "attention backend 'triton'; dense models; docs/determinism.md)")
    # weight-only method (servelm.quant): int8, int4-g32, gguf
    quantization: str | None = option(None,
                                      "quantization of the linear layers: weight-only int8/int4; "
                                      "'gguf' keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks as they "
                                      "are; 'gguf-mixed' uses them for steps of a few rows and "
                                      "their bf16 values for larger ones (docs/quantization.md); "
                                      "'fp8' is W8A8 on CUDA sm89+ GPUs (default: float)",
                                      choices=QUANT_METHOD_NAMES)
    # What the quantized CPU linears round activations to: "float" (float32), "int8" (per
    # 32 values, integer dot products where the CPU runs avx512_vnni; servelm/quant/int8_act.py)
    # or "auto" (by each step's rows).
    quant_activations: str = option("float",
                                    "quantized layers on the CPU: 'int8' rounds activations to "
                                    "int8 per 32 values and multiplies with integer dot products "
                                    "(where the CPU runs avx512_vnni, else float; "
                                    "docs/quantization.md has its accuracy cost), 'float' keeps "
                                    "float32, 'auto' takes each step by its rows (float for "
                                    "few, int8 for many, where this CPU's dot products win; "
                                    "what a GGUF K-quant file runs without --quantization) "
                                    "(default %(default)s)",
                                    choices=QUANT_ACTIVATIONS)
    # "fp8": KV blocks as float8_e4m3fn (CacheConfig)
    kv_cache_dtype: str = option("auto",
                                 "KV cache storage: 'auto' = the model's --dtype; 'fp8' = e4m3 "
                                 "codes with a scale per layer and KV head (half the bytes of "
                                 "bf16)",
                                 choices=KV_CACHE_DTYPES)
    # servelm's C++ CPU kernels: "auto" | "kernel" | "torch", or per part, e.g.
    # "attention=torch,decode=kernel" (servelm/config/cpu_kernel_choice.py).
    cpu_kernels: str = option("auto",
                              "servelm's C++ CPU kernels: 'auto' (where they build, else torch), "
                              "'kernel' (or an error), 'torch' (never); per part, e.g. "
                              "'attention=torch,decode=kernel' (parts: attention, decode, "
                              "layer_ops, quant, gemm (float32 decode steps on servelm's panel "
                              "GEMM); default %(default)s). The start-up log (-v) says which path "
                              "each part took",
                              metavar="MODE|PART=MODE,...", parse="cpu_kernels")
    # Keep a float model's finished parameters under $SERVELM_HOME/prepared and read them
    # back on the next start instead of dequantizing the checkpoint (servelm/loader/prepared.py).
    prepared_weights_cache: bool = option(True,
                                          "load the checkpoint every start instead of the float "
                                          "parameters prepared at the last one "
                                          "($SERVELM_HOME/prepared; docs/server.md)",
                                          names=("--no-prepared-weights-cache",))
    # Speculative decoding (servelm/spec/): None = off; "ngram" or "draft".
    speculative_method: str | None = option(None,
                                            "propose tokens with an n-gram lookup, a draft model, "
                                            "an EAGLE-3 head or the model's own "
                                            "multi-token-prediction layers (mtp: DeepSeek-V3) and "
                                            "verify them in one target step (default: off)",
                                            group="spec", choices=SPEC_METHODS)
    num_speculative_tokens: int = option(4, "most draft tokens per sequence and step (k)",
                                         group="spec")
    spec_ngram_max: int = option(4, "ngram: longest suffix looked up in the context (default "
                                 "%(default)s)",
                                 group="spec")
    spec_ngram_min: int = option(2, "ngram: shortest suffix looked up (default %(default)s)",
                                 group="spec")
    spec_draft_model: str | None = option(None, "draft model (cached name, GGUF file, HF dir or "
                                          "ORG/NAME; same tokenizer), or for eagle3 the EAGLE-3 "
                                          "head's directory",
                                          names=("--spec-draft-model", "--speculative-model"),
                                          group="spec")
    spec_draft_layers: int | None = option(None,
                                           "draft with the target's own first N layers and its "
                                           "head",
                                           group="spec")
    spec_draft_quantization: str | None = option(None, "draft with a copy of the target (or "
                                                 "--spec-draft-model) quantized so",
                                                 group="spec", choices=QUANT_METHOD_NAMES)
    spec_adaptive: bool = option(True, "always speculate k tokens, even past the break-even batch",
                                 names=("--no-spec-adaptive",), group="spec")
    # off | static | dynamic (eagle3: tree drafting and verification)
    spec_tree: str = option("off",
                            "eagle3: draft a tree of up to k nodes and verify it in one step "
                            "(static: top-k per depth; dynamic: EAGLE-2's confidence-pruned tree) "
                            "(default %(default)s: a chain)",
                            group="spec", choices=SPEC_TREES)
    spec_tree_topk: int = option(4,
                                 "tree drafting: children per expanded node (default %(default)s)",
                                 group="spec")
    # LoRA adapters (servelm/lora/, docs/lora.md): "name=path" each, loaded at start-up;
    # enable_lora: serve adapters loaded at run time even when none is given here.
    lora_modules: tuple[str, ...] = option((), "serve the PEFT adapter at PATH as model NAME "
                                           "(repeatable)",
                                           names=("--lora",), group="lora", metavar="NAME=PATH")
    enable_lora: bool = option(False, "accept adapters loaded at run time (implied by --lora)",
                               group="lora")
    # adapter slots: adapters in one step's batch, at most
    max_loras: int = option(4, "adapter slots: distinct adapters in one step (default %(default)s)",
                            group="lora")
    # the largest r an adapter may have (slot buffers are this wide)
    max_lora_rank: int = option(16, "largest adapter rank r accepted (default %(default)s)",
                                group="lora")
    # KV tiers below the device pool (KVTiersConfig, docs/kv_tiers.md); 0 / None: off.
    kv_host_memory_gb: float = option(0.0,
                                      "host memory for KV blocks evicted from the device pool (GB; "
                                      "default %(default)s: off)",
                                      group="kv_tiers")
    kv_disk_dir: str | None = option(None, "directory for KV blocks evicted from host memory, kept "
                                     "across restarts of the same model and servelm version",
                                     group="kv_tiers")
    kv_disk_gb: float = option(0.0, "most bytes the disk tier's files take (GB)",
                               group="kv_tiers")
    kv_reload_policy: str = option("cost",
                                   "a prefix found below the pool: reload it when that is cheaper "
                                   "than recomputing it ('cost'), or always / never",
                                   group="kv_tiers", choices=KV_RELOAD_POLICIES)
    kv_tiers_cost_model: str | None = option(None,
                                             "step-cost model (servelm bench calibrate) for the "
                                             "recompute estimate (default: fitted on this engine's "
                                             "own steps)",
                                             group="kv_tiers", metavar="PATH")
    # Prefill/decode disaggregation (servelm/disagg/, docs/disaggregation.md): this engine's
    # role, the KV transport by name, where a prefill worker listens for pulls (""): from the
    # HTTP port, servelm/disagg/transport.py default_address) and the decode side's lease.
    disagg_role: str = option("colocated",
                              "prefill: compute prompts and serve their KV blocks to decode "
                              "workers; decode: pull a request's prompt KV from the prefill worker "
                              "the router names, then decode (default %(default)s: both here)",
                              names=("--role",), group="disagg", choices=DISAGG_ROLES)
    kv_transport: str = option("tcp",
                               "how KV blocks move: tcp (any two hosts), shm (same host, shared "
                               "memory) or inproc (one process) (default %(default)s)",
                               group="disagg")
    kv_address: str = option("",
                             "prefill role: where decode workers pull KV from, tcp://HOST:PORT or "
                             "shm:///path.sock (default: the HTTP port + 1000 on tcp)",
                             group="disagg", metavar="ADDR")
    kv_lease_s: float = option(30.0,
                               "decode role: seconds blocks reserved for a transfer wait for it "
                               "before the prompt is computed here instead (default %(default)s)",
                               group="disagg")
    # The scheduler's policy (SchedulerConfig.scheduling_policy) and, for "slo", the step-cost
    # model (a `servelm bench calibrate` file) it sizes chunks and predicts TTFTs with.
    scheduling_policy: str = option("fcfs",
                                    "fcfs: arrival order; slo: by SLO class and deadline slack, "
                                    "chunks sized from the TPOT targets, early 429 for a TTFT that "
                                    "cannot be met (docs/slo.md; default %(default)s)",
                                    choices=SCHEDULING_POLICIES)
    slo_cost_model: str | None = option(None, "step-cost model (`servelm bench calibrate`) the slo "
                                        "policy sizes chunks and predicts TTFTs with; without one "
                                        "it only orders the queue",
                                        metavar="FILE")
    # A JSON-lines file of every step's shape and wall time, start to next start
    # (servelm/engine/step_trace.py): what `servelm bench calibrate --served-steps` fits.
    step_trace: str | None = option(None,
                                    "write each step's shape and wall time (start to next start) "
                                    "to FILE, as JSON lines, for `servelm bench calibrate "
                                    "--served-steps` (docs/sim.md)",
                                    metavar="FILE")
    # Model parallelism (ParallelConfig, servelm/parallel/): worker processes per replica.
    tensor_parallel_size: int = option(1, "shard every layer over N worker processes "
                                       "(torch.distributed: gloo on the CPU, cores split between "
                                       "them; NCCL on GPUs)",
                                       group="parallel", metavar="N")
    pipeline_parallel_size: int = option(1,
                                         "split the layers into M stages of --tensor-parallel-size "
                                         "workers each",
                                         group="parallel", metavar="M")
    enable_expert_parallel: bool = option(False,
                                          "MoE: place whole experts across the tensor-parallel "
                                          "ranks (tokens dispatched and combined by all-to-all) "
                                          "instead of slicing each",
                                          group="parallel")
    # "host:port": the workers are started elsewhere (torchrun-style environment variables,
    # Ray; docs/parallel.md) and join rank 0 there; None: rank 0 starts them on this machine.
    parallel_master: str | None = option(None, "the workers are started elsewhere (other machines: "
                                         "torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, "
                                         "or Ray) and join this rank 0 at HOST:PORT (default: rank "
                                         "0 starts them here)",
                                         group="parallel", metavar="HOST:PORT")
    # How rank 0 starts the other ranks (PARALLEL_LAUNCHERS): "process", child processes on
    # this machine; "ray", Ray actors in one placement group of a bundle per rank
    # (servelm/parallel/ray_launcher.py), placed by Ray's strategy parallel_placement.
    parallel_launcher: str = option("process",
                                    "how rank 0 starts the other ranks: process (child processes "
                                    "on this machine) or ray (Ray actors in one placement group "
                                    "over the cluster: $RAY_ADDRESS or one started here; "
                                    "docs/parallel.md)",
                                    group="parallel", choices=PARALLEL_LAUNCHERS)
    parallel_placement: str = option("PACK",
                                     "with --parallel-launcher ray: the placement group's strategy "
                                     "(PACK: as few nodes as fit; STRICT_PACK: one node; SPREAD: "
                                     "one rank per node where it can; STRICT_SPREAD: always)",
                                     group="parallel", choices=RAY_PLACEMENTS)

    def __post_init__(self) -> None:
        self.cpu_kernel_choice()  # a bad value is an error here, not deep in a layer
        check_quant_activations(self.quant_activations)
        self.kv_tiers_config()  # likewise the KV tier flags (--kv-disk-dir needs --kv-disk-gb)
        self.check_parallel_launcher()
        if self.slo_cost_model is not None and self.scheduling_policy != "slo":
            raise ValueError("slo_cost_model: the step-cost model is for --scheduling-policy "
                             f"slo, not {self.scheduling_policy!r}")
        if not isinstance(self.lora_modules, tuple):  # argparse: a list, or None
            mods = self.lora_modules
            object.__setattr__(self, "lora_modules",
                               (mods,) if isinstance(mods, str) else tuple(mods or ()))
        self.lora_adapters()

    @property
    def is_lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def lora_adapters(self) -> list[tuple[str, str]]:
        """--lora name=path entries as (name, path)."""
        out = []
        for item in self.lora_modules or ():
            name, sep, path = str(item).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora: expected name=path, got {item!r}")
            out.append((name.strip(), path.strip()))
        return out

    def cpu_kernel_choice(self):
        from servelm.config.cpu_kernel_choice import CpuKernelChoice  # torch-free

        return CpuKernelChoice.parse(self.cpu_kernels)

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(self.speculative_method, self.num_speculative_tokens,
                                 self.spec_ngram_max, self.spec_ngram_min,
                                 self.spec_draft_model, self.spec_draft_layers,
                                 self.spec_draft_quantization, self.spec_adaptive,
                                 self.spec_tree, self.spec_tree_topk)

    def check_parallel_launcher(self) -> None:
        if self.parallel_launcher not in PARALLEL_LAUNCHERS:
            raise ValueError(f"parallel_launcher: {self.parallel_launcher!r} is not one of "
                             f"{PARALLEL_LAUNCHERS}")
        if self.parallel_placement not in RAY_PLACEMENTS:
            raise ValueError(f"parallel_placement: {self.parallel_placement!r} is not one of "
                             f"{RAY_PLACEMENTS}")

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                              self.enable_expert_parallel)

    def kv_tiers_config(self) -> KVTiersConfig:
        return KVTiersConfig(int(self.kv_host_memory_gb * 1e9), self.kv_disk_dir,
                             int(self.kv_disk_gb * 1e9), self.kv_reload_policy,
                             self.kv_tiers_cost_model)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size,
                           kv_cache_memory_bytes=self.kv_cache_memory,
                           memory_fraction=self.memory_fraction,
                           num_blocks_override=self.num_blocks,
                           enable_prefix_caching=self.enable_prefix_caching,
                           max_retained_blocks=self.max_retained_blocks,
                           kv_cache_dtype=self.kv_cache_dtype)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                               max_num_seqs=self.max_num_seqs,
                               max_num_encoder_tokens=self.max_num_encoder_tokens,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               scheduling_policy=self.scheduling_policy)

