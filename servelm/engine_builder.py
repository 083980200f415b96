"""build_engine: EngineArgs -> a ready Engine (weights loaded, KV cache allocated).

The one place that wires loader, model, attention backend, runner and engine together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

import torch

from servelm import cpu_kernels, dtype_choice, startup
from servelm.attention import get_backend_class
from servelm.attention.kv_cache import PREFAULT_BYTES, KVCache, kv_storage_dtype
from servelm.config import EngineArgs, ModelConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.engine import Engine
from servelm.engine.kv_connector import KVConnector, combine
from servelm.layers.linear import can_pack, pack_linears
from servelm.layers.rotary import RotaryEmbedding
from servelm.loader import (iter_weights, kquant_default, load_model_config, load_tokenizer,
                            prepared, resolve_model)
from servelm.loader.community_checkpoint import METHODS as CODES_METHODS
from servelm.models import get_model_class
from servelm.parallel import build as parallel_build
from servelm.protocol import InvalidParameterError
from servelm.runner.host_memory import keep_freed_memory
from servelm.runner.model_runner import ModelRunner, available_memory_bytes, num_kv_blocks

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(config: ModelConfig, weights, dtype: torch.dtype,
                device: torch.device, quantization: str | None = None,
                prepared_key: str | None = None,
                deterministic: bool = False, parallel=None,
                quant_activations: str = "float") -> torch.nn.Module:
    """Build on the meta device (no throwaway init), then fill from the checkpoint.

    quantization: a `servelm.quant` method name; its layers quantize once loading is done.
    quant_activations: "float" | "int8", what its CPU layers round activations to.
    prepared_key: the prepared-weights cache entry (servelm/loader/prepared.py) to read the
    finished float parameters from instead of `weights`, or to write once they are loaded.
    deterministic: leave the float linears unpacked (the runner repacks them as DetLinear).
    parallel: a model-parallel rank's ParallelGroup (servelm/parallel/): `config` is then the
    rank's local config and `weights` its slices; the built model is its tensor-parallel shard.
    """
    timer = startup.timer()
    quant = None
    if quantization is not None:
        from servelm.quant import get_quant_method

        quant = get_quant_method(quantization, quant_activations)
        quant.check_device(device)  # e.g. fp8 needs sm89+: refuse before loading anything
    # Only quantized builds pass `quant`: a family without the hook still loads in float.
    extra = {} if quant is None else {"quant": quant}
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, None, **extra)
    if parallel is not None:
        parallel_build.prepare_model(parallel, model)
    if quant is not None or device.type != "cpu":
        prepared_key = None
    with timer.stage("weights_read"):
        state = None if prepared_key is None else prepared.load(prepared_key)
        if state is not None:
            model.load_state_dict(state, strict=True, assign=True)
            timer.note("weights_read", "prepared-weights cache")
        else:
            model = model.to_empty(device=device).to(dtype)
            model.load_weights((name, t.to(dtype)) for name, t in weights)
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.materialize(device)
    if state is None and prepared_key is not None and prepared.cacheable(model):
        timer.add("weights_cache", prepared.save(prepared_key, model))
    if quant is not None:
        model.process_weights_after_loading()
    # float layers are packed for oneDNN; of quantized builds only gguf-mixed keeps some
    if (quant is None or getattr(quant, "packs_float_layers", False)) and \
            can_pack(device, dtype) and not deterministic:  # DetLinear packs its own
        with timer.stage("weights_pack"), _one_thread():
            if not _servelm_gemm(model, quant, dtype, parallel):
                pack_linears(model)
    if parallel is not None:
        model = parallel_build.wrap_model(parallel, model)
    return model.eval()


def _resolve_dtype(args: EngineArgs, source) -> EngineArgs:
    """--dtype auto made concrete (servelm/dtype_choice.py), logged with its reason."""
    if args.dtype != "auto":
        return args
    dtype, why = dtype_choice.resolve(args.dtype, args.device, source, args.quantization,
                                      args.quant_activations)
    dtype_choice.log_choice(args.dtype, dtype, why)
    return dataclasses.replace(args, dtype=dtype)


def _servelm_gemm(model, quant, dtype: torch.dtype, parallel) -> bool:
    """--cpu-kernels gemm: whether servelm's own GEMMs took the float linears (True), else
    the caller packs them for oneDNN alone. float32: the panel GEMM paired with oneDNN; a
    bfloat16 model: the avx512_bf16 GEMM alone (quantized builds' float layers too), or AMX
    tiles paired with oneDNN. Not under tensor parallelism."""
    if parallel is not None:
        return False
    if dtype == torch.float32:
        return quant is None and _pair_with_panels(model)
    if dtype == torch.bfloat16:
        return _pack_for_dots(model) or (quant is None and _pair_with_tiles(model))
    return False


def _pack_for_dots(model) -> bool:
    """--cpu-kernels gemm: a bfloat16 model's float linears become DotLinears (servelm's
    avx512_bf16 GEMM, every row count, one copy of the weights) where the probe saw vdpbf16ps
    run here and AMX does not (AMX pairs with oneDNN instead: _pair_with_tiles). False: not
    done."""
    from servelm.layers.amx_linear import amx_usable
    from servelm.layers.dot_linear import dot_usable
    from servelm.layers.linear import pack_dot_linears

    if _gemm_mode() is None or amx_usable() or not dot_usable():
        return False
    num = pack_dot_linears(model)
    logger.info("bfloat16 linears on avx512_bf16 dot products (servelm's GEMM, %d linears; "
                "--cpu-kernels gemm=torch: oneDNN)", num)
    return True


def _pair_with_panels(model) -> bool:
    """--cpu-kernels gemm: float32 linears packed for oneDNN and also for servelm's panel
    GEMM for steps of few rows (servelm/layers/linear.py, pair_with_panels), where this CPU
    has a measured row count for it. False: not done (the caller packs for oneDNN alone)."""
    from servelm.layers.linear import pair_with_panels, panel_rows

    if _gemm_mode() is None:
        return False
    rows = panel_rows()
    return _pair(model, "float32", "the panel GEMM", rows,
                 "no AVX2 on this CPU" if rows == 0 else None, pair_with_panels)


def _pair_with_tiles(model) -> bool:
    """--cpu-kernels gemm: bfloat16 linears packed for oneDNN and also for servelm's AMX tile
    GEMM for steps of few rows (servelm/layers/linear.py, pair_with_tiles), where the probe
    saw AMX-BF16 run here. False: not done (the caller packs for oneDNN alone)."""
    from servelm.layers.amx_linear import amx_usable
    from servelm.layers.linear import AMX_ROWS, pair_with_tiles

    if _gemm_mode() is None:
        return False
    return _pair(model, "bfloat16", "AMX tiles (servelm's GEMM)", AMX_ROWS,
                 None if amx_usable() else "AMX-BF16 does not run here", pair_with_tiles)


def _gemm_mode() -> str | None:
    """The gemm part's mode where servelm's GEMMs may run ('auto' / 'kernel'), else None."""
    chosen = cpu_kernels.mode("gemm")
    if chosen == "torch" or cpu_kernels.ops_for_mode("gemm", chosen) is None:
        return None
    return chosen


def _pair(model, dtype: str, form: str, rows: int, why_not: str | None, pair) -> bool:
    """pair(model, rows) unless `why_not` or the second copy of the weights would take more
    than a quarter of the free memory: then oneDNN alone, logged (gemm=kernel: an error)."""
    from servelm.layers.linear import float_weight_bytes

    chosen = _gemm_mode()
    extra = float_weight_bytes(model)
    if why_not is None and extra > available_memory_bytes(torch.device("cpu")) // 4:
        why_not = (f"a second copy of the weights ({extra >> 20} MiB) would take more than a "
                   f"quarter of the free memory")
    if why_not is not None:
        if chosen == "kernel":
            raise ValueError(f"cpu_kernels: gemm=kernel: {form} cannot be used: {why_not}")
        logger.info("%s linears on oneDNN alone (--cpu-kernels gemm=%s): %s", dtype, chosen,
                    why_not)
        return False
    num = pair(model, rows)
    logger.info("%s linears: steps of up to %d rows on %s, oneDNN above (%d linears, +%d MiB "
                "of weights; --cpu-kernels gemm=torch: oneDNN only)", dtype, rows, form, num,
                extra >> 20)
    return True


@contextlib.contextmanager
def _one_thread():
    """oneDNN's weight reorder is memory-bound: on one thread it packs the default model in
    0.11-0.15 s on the CI machine, on two 0.4-1 s (the threads wait on each other, worst
    when another process holds a core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def bind_attention(model: torch.nn.Module, backend) -> None:
    """Attach the attention backend once the KV cache is sized (after the weights)."""
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = backend


def build_engine(args: EngineArgs, parallel=None) -> Engine:
    """Resolve the model (cached name, GGUF file or HF directory) and assemble an engine.

    With --tensor-parallel-size N > 1 this process is rank 0: it starts the other ranks'
    workers first (servelm/parallel/launcher.py); a worker passes its own `parallel` group."""
    start = time.monotonic()
    timer = startup.begin_engine()
    if parallel is None and args.parallel_config().world_size > 1:
        from servelm.parallel.launcher import RankMain, start_workers

        # the other ranks' process (it imports this module, so it is named, not imported)
        # and what builds their shards: this same function
        args, parallel = start_workers(args, RankMain("servelm.core_process.worker",
                                                      build_engine))
        try:
            return _build_engine(args, parallel, start, timer)
        except BaseException:
            parallel_build.abandon(parallel)  # the workers fail their build too
            raise
    return _build_engine(args, parallel, start, timer)


def _build_engine(args: EngineArgs, parallel, start: float, timer) -> Engine:
    source = resolve_model(args.model)
    with timer.stage("config"):
        config = load_model_config(source)
    if source.kind == "gguf":
        from servelm.loader.gguf_loader import gguf_reader

        if gguf_reader(source.path).from_cache:  # the metadata parse skipped (gguf_index.py)
            timer.note("config", "GGUF index cache")
    with timer.stage("tokenizer"):
        tokenizer = load_tokenizer(source)
    checkpoint = None
    if source.kind == "hf":
        from servelm.loader.quantized_checkpoint import read_quantized_checkpoint

        checkpoint = read_quantized_checkpoint(source.path)
    if checkpoint is not None:  # its method, before --dtype auto reads it
        args = dataclasses.replace(args, quantization=checkpoint.method_for(args.quantization))
    elif args.quantization is None:  # a GGUF K-quant file keeps its codes (kquant_default.py)
        args = kquant_default.default_args(source, args)
    args = _resolve_dtype(args, source)
    key = None
    if args.quantization is None and args.prepared_weights_cache and parallel is None:
        key = prepared.prepared_key(source, get_model_class(config.architecture),
                                    _DTYPES[args.dtype])
    select = None  # a model-parallel rank reads only its slices (servelm/parallel/sharding.py)
    if parallel is not None:
        select = parallel_build.shard_for(parallel, config).select
        if checkpoint is not None:
            raise InvalidParameterError("quantized checkpoints (servelm quantize output) do "
                                        "not shard yet; --quantization int8/int4/gguf do",
                                        param="tensor_parallel_size")
    if checkpoint is not None:  # a quantized checkpoint: its codes, under its own method
        weights = checkpoint.iter_weights(config)
    elif args.quantization in CODES_METHODS:  # GPTQ / AWQ / compressed-tensors codes
        raise InvalidParameterError(f"quantization {args.quantization!r} loads such a "
                                    f"checkpoint's codes; {args.model!r} is not one",
                                    param="quantization")
    elif args.quantization in ("gguf", "gguf-mixed"):  # the file's blocks, not their values
        if source.kind != "gguf":
            raise InvalidParameterError(f"quantization {args.quantization!r} needs a GGUF "
                                        "model file; "
                                        f"{args.model!r} is a {source.kind} model (use int8 "
                                        "or int4)", param="quantization")
        from servelm.loader.gguf_loader import iter_gguf_quantized_weights

        weights = iter_gguf_quantized_weights(source.path, config, select)
    else:
        weights = iter_weights(source, config, select, _DTYPES[args.dtype],
                               _unread_mtp(args, config))
    engine = assemble_engine(args, config, weights, tokenizer, source.name,
                             prepared_key=None if checkpoint is not None else key,
                             parallel=parallel)
    if parallel is not None and parallel.global_rank != 0:
        return engine  # a worker: rank 0's warm-up steps reach it as broadcasts
    with timer.stage("warmup"):
        startup.warm_up(engine)
    timer.add("engine_other", time.monotonic() - start - sum(
        v for k, v in timer.stages.items() if k not in ("interpreter", "imports")))
    logger.info("engine ready in %.1fs (start-up: %s)", time.monotonic() - start,
                timer.summary())
    return engine


def assemble_engine(args: EngineArgs, config: ModelConfig, weights, tokenizer,
                    name: str = "", prepared_key: str | None = None,
                    parallel=None) -> Engine:
    """Engine from a config and a weights iterator (tests pass in-memory checkpoints).
    parallel: this rank's ParallelGroup; `weights` are then its slices (build_engine)."""
    cpu_choice = _prepare_process(args)
    device = torch.device(args.device)
    args = _resolve_dtype(args, None)  # weights handed in: as if stored in float32
    dtype = _DTYPES[args.dtype]
    eos = _eos_token_ids(config, tokenizer)
    max_model_len = _max_model_len(args, config)
    cache_config = args.cache_config()
    # A model-parallel rank builds, caches and attends over its share of the heads.
    model_config = config if parallel is None else parallel_build.local_config(parallel, config)
    spec_config = args.speculative_config()
    mtp_tensors = None
    if spec_config is not None and spec_config.method == "mtp":
        weights, mtp_tensors = _take_mtp_tensors(args, config, weights, parallel)
        prepared_key = None  # the MTP tensors come from the checkpoint's stream
    # Weights first, so a KV budget given as a fraction counts the memory left after them.
    model = build_model(model_config, weights, dtype, device, args.quantization, prepared_key,
                        args.deterministic, parallel, args.quant_activations)
    kv_dtype = kv_storage_dtype(cache_config.kv_cache_dtype, dtype)  # fp8: 1 byte/element
    draft = None
    if spec_config is not None and spec_config.method == "draft" \
            and spec_config.draft_layers is None:
        draft = _build_draft_model(args, spec_config, config, dtype, device)
    num_blocks = _num_blocks(config, model_config, cache_config, kv_dtype, device, parallel,
                             draft, dtype)
    kv_cache = _allocate_kv_cache(args, model_config, num_blocks, kv_dtype, device,
                                  max_model_len)
    backend = get_backend_class(args.attention_backend)(kv_cache, model_config.num_heads,
                                                        config.head_dim ** -0.5)
    bind_attention(model, backend)
    proposer, speculator = _build_speculation(args, spec_config, config, model, backend, draft,
                                              num_blocks, dtype, device, mtp_tensors)
    graphs = _build_cuda_graphs(args, model, backend, device, max_model_len, num_blocks)
    lora_manager, lora_slots = _build_lora(args, config, model, dtype, device)
    runner = ModelRunner(model, config, kv_cache, backend, eos, device, args.seed, graphs,
                         proposer, grammars=_build_grammars(tokenizer, config, eos),
                         lora=lora_manager,
                         # a rank's sharded stack: parallel_build.attach_decode_stack
                         cpu_decode=cpu_choice.decode if parallel is None else "torch",
                         deterministic=args.deterministic)
    runner = _parallel_runner(parallel, runner, cpu_choice)
    if device.type == "cpu":
        _log_cpu_paths(cpu_choice, model, backend, runner, dtype, device)
    block_manager = BlockManager(num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching,
                                 sliding_window=config.uniform_sliding_window,
                                 max_retained_blocks=cache_config.max_retained_blocks)
    max_model_len = min(max_model_len, num_blocks * cache_config.block_size)
    kv_connector = _build_kv_connector(args, config, kv_cache.block_nbytes, str(kv_dtype),
                                       name, prepared_key, model)
    engine = Engine(runner, tokenizer, block_manager, args.scheduler_config(), max_model_len,
                    config.vocab_size, eos, model_name=name or config.name,
                    speculator=speculator, loras=lora_slots, kv_connector=kv_connector)
    _finish_engine(engine, args, config, runner)
    logger.info("%s: %d KV blocks of %d tokens (%.2f GB), context %d", name, num_blocks,
                cache_config.block_size,
                num_blocks * KVCache.bytes_per_block(config, cache_config.block_size,
                                                     kv_dtype) / 1e9,
                max_model_len)
    return engine


def _prepare_process(args: EngineArgs):
    """Threads, the CPU kernel choice (configured before the model: its layers read it as
    they build) and the kernel library loaded; returns the choice."""
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cpu_choice = args.cpu_kernel_choice()
    cpu_kernels.configure(cpu_choice)
    if torch.device(args.device).type == "cpu" and str(cpu_choice) != "torch":
        with startup.timer().stage("kernels"):
            try:
                cpu_kernels.load()  # built once per machine; a failure is reported where used
            except Exception:  # noqa: BLE001 - 'auto' falls back to torch, 'kernel' raises later
                pass
        if cpu_kernels.source():  # where the library came from: compiled now, prebuilt, ...
            startup.timer().add("kernels", 0.0, note=cpu_kernels.source())
    if torch.device(args.device).type == "cpu":
        keep_freed_memory()
    return cpu_choice


def _build_speculation(args: EngineArgs, spec_config, config: ModelConfig, model, backend,
                       draft, num_blocks: int, dtype: torch.dtype, device, mtp_tensors):
    """(proposer, controller), or (None, None) without --speculative-method."""
    if spec_config is None:
        return None, None
    proposer = _build_proposer(args, spec_config, config, model, backend, draft, num_blocks,
                               args.cache_config().block_size, dtype, device, mtp_tensors)
    from servelm.spec import SpecController

    if spec_config.tree != "off":  # servelm/spec/tree.py
        return _tree_speculation(args, spec_config, config, backend, proposer)
    return proposer, SpecController(spec_config.num_tokens, spec_config.adaptive)


def _tree_speculation(args, spec_config, config: ModelConfig, backend, proposer):
    """eagle3's drafter drafting trees, and a controller choosing their size."""
    from servelm.spec.tree import UnsupportedTreeError, build_tree_speculation

    try:
        return build_tree_speculation(proposer, spec_config, backend, config,
                                      args.deterministic)
    except UnsupportedTreeError as e:
        raise InvalidParameterError(str(e), param="spec_tree") from e


def _parallel_runner(parallel, runner: ModelRunner, cpu_choice):
    """A model-parallel rank's runner: its sharded decode stack, and rank 0 broadcasting
    each step to the others; the runner itself without parallelism."""
    if parallel is None:
        return runner
    parallel_build.attach_decode_stack(parallel, runner, cpu_choice.decode)
    return parallel_build.wrap_runner(parallel, runner)


def _eos_token_ids(config: ModelConfig, tokenizer) -> tuple[int, ...]:
    eos = set(config.eos_token_ids)
    if tokenizer is not None:
        eos |= set(tokenizer.eos_token_ids)
    return tuple(sorted(eos))


def _max_model_len(args: EngineArgs, config: ModelConfig) -> int:
    max_model_len = args.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"{config.max_position_embeddings} positions")
    return max_model_len


def _num_blocks(config: ModelConfig, model_config: ModelConfig, cache_config, kv_dtype,
                device, parallel, draft, dtype: torch.dtype) -> int:
    """KV blocks from the memory left after the weights; every rank agrees on the fewest."""
    num_blocks = num_kv_blocks(model_config, cache_config, kv_dtype, device)
    if parallel is not None:
        num_blocks = parallel_build.agree_num_blocks(parallel, num_blocks)
    if draft is not None and cache_config.num_blocks_override is None:
        # The draft's KV shares the block tables: every block costs both caches.
        per_target = KVCache.bytes_per_block(config, cache_config.block_size, kv_dtype)
        per_draft = KVCache.bytes_per_block(draft.config, cache_config.block_size, dtype)
        num_blocks = max(1, num_blocks * per_target // (per_target + per_draft))
    return num_blocks


def _allocate_kv_cache(args: EngineArgs, model_config: ModelConfig, num_blocks: int,
                       kv_dtype, device, max_model_len: int) -> KVCache:
    block_size = args.cache_config().block_size
    with startup.timer().stage("kv_alloc"):
        kv_cache = KVCache(model_config, num_blocks, block_size, kv_dtype, device)
        # the blocks handed out first, mapped now: never more than max_num_seqs sequences of
        # max_model_len tokens could hold (a small model's tests map next to nothing)
        per_token = kv_cache.block_nbytes // block_size
        kv_cache.prefault(min(PREFAULT_BYTES, args.max_num_seqs * max_model_len * per_token))
    return kv_cache


def _build_cuda_graphs(args: EngineArgs, model, backend, device, max_model_len: int,
                       num_blocks: int):
    if not args.cuda_graphs:
        return None
    if device.type != "cuda":
        raise ValueError("cuda_graphs needs a CUDA device (--device cuda)")
    from servelm.runner.cuda_graph import CudaGraphRunner

    block_size = args.cache_config().block_size
    graphs = CudaGraphRunner(model, backend, args.max_num_seqs,
                             -(-min(max_model_len, num_blocks * block_size) // block_size),
                             device)
    with startup.timer().stage("graph_capture"):
        logger.info("CUDA graphs captured in %.1fs", graphs.capture())
    return graphs


def _build_grammars(tokenizer, config: ModelConfig, eos: tuple[int, ...]):
    if tokenizer is None:  # structured outputs need the vocabulary's strings
        return None
    from servelm.structured import GrammarMasks, compiler_for

    return GrammarMasks(compiler_for(tokenizer, config.vocab_size, eos))


def _log_cpu_paths(cpu_choice, model, backend, runner, dtype: torch.dtype, device) -> None:
    from servelm.own_env import startup_line
    from servelm.runner.kernel_paths import describe, kernel_paths

    if startup_line():
        logger.info("%s", startup_line())
    logger.info("cpu kernels (--cpu-kernels %s): %s", cpu_choice, describe(
        kernel_paths(model, backend, runner.cpu_stack, dtype, device)))


def _finish_engine(engine: Engine, args: EngineArgs, config: ModelConfig, runner) -> None:
    """What the engine is told after it is built: its model and args (read back by the
    server and the core), the SLO policy's step time, the vision limits."""
    engine.model_config = config
    if args.slo_cost_model is not None and engine.scheduler.policy is not None:
        from servelm.engine.step_cost_model import StepCostModel  # torch-free (docs/slo.md)

        engine.scheduler.policy.step_time = StepCostModel.load(args.slo_cost_model).step_time
    if config.vision is not None:  # requests may carry images (docs/vision.md)
        engine.image_token_id = config.vision.image_token_id
        vision = getattr(runner, "vision", None)
        if vision is not None:
            vision.cache.capacity_tokens = args.encoder_cache_tokens
    engine.engine_args = args


def _build_kv_connector(args: EngineArgs, config: ModelConfig, block_nbytes: int,
                        kv_dtype: str, name: str, prepared_key, model) -> KVConnector:
    """KV entering or leaving the pool: --role prefill | decode (servelm/disagg/) and host
    memory and disk below the pool (servelm/kv_tiers/); none, one, or both at once (the
    role's hooks first). The tiers are built first: a role listens once built."""
    parts = []
    if args.kv_tiers_config().is_enabled:
        from servelm.kv_tiers.build import kv_tiers_from_args, weights_digest

        parts.append(kv_tiers_from_args(args, config, block_nbytes, kv_dtype, name,
                                        prepared_key or weights_digest(model)))
    if args.disagg_role != "colocated":
        from servelm.disagg.roles import role_from_args

        parts.insert(0, role_from_args(args, block_nbytes))
    return combine(parts)


def _build_lora(args: EngineArgs, config: ModelConfig, model, dtype, device):
    """(LoraManager for the runner, LoraSlots for the engine) with the --lora adapters
    registered, or (None, None) when LoRA is off."""
    if not args.is_lora_enabled:
        return None, None
    from servelm.lora.adapter import check_model_supports_lora
    from servelm.lora.manager import LoraManager
    from servelm.lora.slots import LoraSlots

    check_model_supports_lora(config)
    if args.speculative_method is not None:
        raise InvalidParameterError("speculative decoding with LoRA adapters is not supported "
                                    "(drafts would run without the adapter)",
                                    param="speculative_method")
    slots = LoraSlots(args.max_loras, args.max_lora_rank, config)
    manager = LoraManager(model, config, args.max_loras, args.max_lora_rank, device, dtype)
    for name, path in args.lora_adapters():
        slots.register(name, path)
    logger.info("LoRA: %d slots of rank <= %d (%.1f MB each), adapters: %s", args.max_loras,
                args.max_lora_rank, manager.slot_bytes / 1e6,
                ", ".join(slots.names()) or "none yet")
    return manager, slots


def _build_draft_model(args: EngineArgs, spec, target: ModelConfig, dtype: torch.dtype,
                       device: torch.device) -> torch.nn.Module:
    """A separate draft: --spec-draft-model (optionally quantized), or the target's own
    checkpoint quantized with --spec-draft-quantization."""
    source = resolve_model(spec.draft_model or args.model)
    config = load_model_config(source)
    if config.vocab_size != target.vocab_size:
        raise InvalidParameterError(
            f"draft model {spec.draft_model!r} has a vocabulary of {config.vocab_size} "
            f"tokens, the target {target.vocab_size}: a draft must share the tokenizer",
            param="spec_draft_model")
    quant = spec.draft_quantization
    if quant == "gguf":
        if source.kind != "gguf":
            raise InvalidParameterError("spec_draft_quantization 'gguf' needs a GGUF draft "
                                        "(or target) file", param="spec_draft_quantization")
        from servelm.loader.gguf_loader import iter_gguf_quantized_weights

        weights = iter_gguf_quantized_weights(source.path, config)
    else:
        weights = iter_weights(source, config)
    return build_model(config, weights, dtype, device, quant)


def _build_proposer(args, spec, config, model, backend, draft, num_blocks, block_size,
                    dtype, device, mtp_tensors=None):
    if spec.method == "mtp":
        return _build_mtp(model, mtp_tensors)
    if spec.method == "ngram":
        from servelm.spec.ngram import NgramProposer

        return NgramProposer(spec.ngram_max, spec.ngram_min)
    if spec.method == "eagle3":
        return _build_eagle3(args, spec, config, model)
    from servelm.spec.draft import DraftModelProposer

    if draft is None:  # early exit: the target's first layers, its KV cache and backend
        if spec.draft_layers >= config.num_layers:
            raise InvalidParameterError(
                f"spec_draft_layers must be below the target's {config.num_layers} layers, "
                f"got {spec.draft_layers}", param="spec_draft_layers")
        return DraftModelProposer(model, backend, block_size, device,
                                  num_layers=spec.draft_layers, shares_target_kv=True)
    draft_kv = KVCache(draft.config, num_blocks, block_size, dtype, device)
    draft_backend = get_backend_class(args.attention_backend)(draft_kv, draft.config.num_heads,
                                                              draft.config.head_dim ** -0.5)
    bind_attention(draft, draft_backend)
    return DraftModelProposer(draft, draft_backend, block_size, device)


def _unread_mtp(args: EngineArgs, config: ModelConfig):
    """The checkpoint's multi-token-prediction modules, left unread unless they draft."""
    if not config.num_mtp_layers or args.speculative_method == "mtp":
        return None
    from servelm.models.deepseek import mtp_module_index

    logger.info("layers %d..%d: multi-token-prediction modules, not read (--speculative-method "
                "mtp drafts with them)", config.num_layers,
                config.num_layers + config.num_mtp_layers - 1)
    return lambda name: mtp_module_index(name, config) is not None


def _take_mtp_tensors(args, config: ModelConfig, weights, parallel):
    """--speculative-method mtp: refused before anything loads for a model without
    multi-token-prediction layers (or a setup the drafter cannot run in); else the weights
    without the MTP modules' tensors, and the list those fill as the model's load reads the
    stream (servelm/spec/mtp.py)."""
    from servelm.spec.mtp import UnsupportedMTPError, check_mtp_target, split_mtp_tensors

    try:
        check_mtp_target(config)
    except UnsupportedMTPError as e:
        raise InvalidParameterError(str(e), param="speculative_method") from e
    if args.cuda_graphs or parallel is not None:
        raise InvalidParameterError("speculative method 'mtp' runs the target eagerly on one "
                                    "rank: not with --cuda-graphs or model parallelism",
                                    param="speculative_method")
    return split_mtp_tensors(weights, config)


def _build_mtp(model, mtp_tensors):
    """The target's own MTP module as a chain drafter (servelm/spec/mtp.py)."""
    from servelm.spec.mtp import UnsupportedMTPError, build_mtp_proposer

    try:
        proposer = build_mtp_proposer(model, mtp_tensors)
    except UnsupportedMTPError as e:
        raise InvalidParameterError(str(e), param="speculative_method") from e
    logger.info("mtp: the target's steps run eagerly (not the C++ decode stack): the drafter "
                "reads the hidden states after layer %d", proposer.aux_layers[0])
    return proposer


def _build_eagle3(args, spec, config, model):
    """An EAGLE-3 head for the target (servelm/spec/eagle.py); its features are the target's
    hidden states after some layers, which the eager forward and the C++ decode stack return
    (CUDA graphs return only final hidden states)."""
    from servelm.spec.eagle import UnsupportedDrafterError, build_eagle3_proposer

    if args.cuda_graphs or config.vision is not None:
        raise InvalidParameterError("speculative method 'eagle3' runs the target eagerly: "
                                    "not with --cuda-graphs or a vision-language model",
                                    param="speculative_method")
    try:
        path = spec.draft_model
        if not os.path.isdir(path):  # a Hub name: fetched or found in the cache
            path = str(resolve_model(path).path)
        proposer = build_eagle3_proposer(path, model, config)
    except UnsupportedDrafterError as e:
        raise InvalidParameterError(str(e), param="spec_draft_model") from e
    logger.info("eagle3: the drafter reads the target's hidden states after layers %s (the "
                "C++ decode stack returns them with the final ones)", list(proposer.aux_layers))
    return proposer
