"""GPU benchmark of servelm's fast path (triton attention, CUDA graphs, dummy weights) and of
HF transformers continuous batching, with roofline shares measured on the same device.

Phases (run_h200.sh runs each in its own process, under a time limit):
    decode   Llama-3.1-8B shape, batch 1, 128-token prompt, 256 new tokens: decode tok/s and
             memory-bandwidth utilisation (weight + KV bytes per step / step time / copy rate)
    offline  256 requests, input and output lengths uniform in [100, 1024] (seed 0), EOS
             ignored: output tok/s and the share of the roofline
    hf       the offline workload through transformers' continuous-batching manager (the one
             generate_batch drives), attn_implementation "paged|sdpa" (else "sdpa")
    report   reads the phases' JSON and prints one table

Every GPU phase measures device-to-device copy bandwidth and a bf16 matmul rate itself, in the
same process. `--device cpu --tiny` runs the same code on a scaled-down model and workload (a
dry run of the plumbing; its numbers mean nothing).

Owns the measurements and their JSON. Never changes servelm's defaults; never downloads
(weights are random, configs are built in: servelm.loader.dummy).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # benchmarks/gpu/roofline.py, importable after the path insert

from servelm.config import EngineArgs, ModelConfig
from servelm.loader.dummy import DUMMY_CONFIGS, dummy_model_config, dummy_weights

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2}


# --- models and workloads ---------------------------------------------------------------------


def hf_config_dict(model: str, tiny: bool) -> dict:
    cfg = dict(DUMMY_CONFIGS[model.lower().removeprefix("dummy:")])
    return {**cfg, **TINY, "rope_scaling": None} if tiny else cfg


def model_config(model: str, tiny: bool) -> ModelConfig:
    if not tiny:
        return dummy_model_config(model)
    return ModelConfig.from_hf_config(hf_config_dict(model, True)).replace(name=model + "-tiny")


def uniform_workload(num: int, lo: int, hi: int, vocab: int, seed: int) -> list[tuple[list, int]]:
    """(prompt ids, output length) per request, lengths uniform in [lo, hi] (numpy PCG64)."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(lo, hi + 1, size=num)
    out_lens = rng.integers(lo, hi + 1, size=num)
    high = max(vocab - 100, 101)  # keep clear of special tokens at either end
    return [(rng.integers(100, high, size=int(n)).tolist(), int(m))
            for n, m in zip(in_lens, out_lens)]


# --- hardware ---------------------------------------------------------------------------------


def _timed(fn, device: torch.device, iters: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measure_hardware(device: torch.device, tiny: bool) -> dict:
    """Copy bandwidth (bytes read + written per second by a big device-to-device copy) and
    the dense bf16 (fp32 on CPU) matmul rate, measured now on this device."""
    hw = {**_copy_rate(device, tiny), **_matmul_rate(device, tiny),
          "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                          else platform.processor() or "cpu")}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the KV budget is a share of the memory free after this
    return hw


def _copy_rate(device: torch.device, tiny: bool) -> dict:
    nbytes = 2**24 if tiny else 2**32  # 4 GiB: far past any cache
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, 3 if tiny else 20)
    return {"copy_bandwidth_Bps": 2 * nbytes / seconds}


def _matmul_rate(device: torch.device, tiny: bool) -> dict:
    n = 256 if tiny else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    seconds = _timed(lambda: a @ b, device, 3 if tiny else 50)
    return {"matmul_flops": 2 * n**3 / seconds, "matmul_dtype": str(dtype).removeprefix("torch.")}


# --- servelm ----------------------------------------------------------------------------------


def build_servelm(args, model: str, max_num_seqs: int):
    """An engine with dummy weights generated on the device, one tensor at a time."""
    from servelm.engine_builder import assemble_engine

    config = model_config(model, args.tiny)
    engine_args = EngineArgs(
        model=model, device=args.device, dtype=args.dtype,
        attention_backend=args.attention_backend, max_model_len=args.max_model_len,
        block_size=args.block_size, memory_fraction=args.memory_fraction,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    weights = dummy_weights(config, seed=0, device=args.device, dtype=DTYPES[args.dtype])
    t0 = time.perf_counter()
    engine = assemble_engine(engine_args, config, weights, None, config.name)
    load_s = time.perf_counter() - t0
    graph_s = install_cuda_graphs(engine, args, max_num_seqs) if args.cuda_graphs else None
    return engine, config, {"load_s": load_s, "graph_capture_s": graph_s}


def install_cuda_graphs(engine, args, max_batch: int) -> float:
    """Wrap the runner's model so decode steps replay CUDA graphs (until the runner has its
    own --cuda-graphs hook, this is how the benchmark opts in). -> capture seconds."""
    from servelm.runner.cuda_graph import CudaGraphRunner, GraphedModel

    runner = engine.runner
    max_blocks = math.ceil(engine.max_model_len / runner.block_size)
    graphs = CudaGraphRunner(runner.model, runner.backend, max_batch, max_blocks,
                             torch.device(args.device), make_graph=_graph_factory(args))
    seconds = graphs.capture()
    runner.model = GraphedModel(runner.model, graphs)
    return seconds


def _graph_factory(args):
    if args.device != "cpu":
        return None  # real CUDA graphs

    class EagerGraph:  # --device cpu dry run: replay re-runs the captured function
        def capture(self, fn):
            self.fn, self.out = fn, fn()
            return self.out

        def replay(self):
            self.out.copy_(self.fn())

    return EagerGraph


class StepRecorder:
    """Wraps runner.execute: each step's spans (context, new tokens, sampled) and wall time
    (execute ends with a device sync: the sampled ids are read back)."""

    def __init__(self, runner):
        self.steps: list[tuple[list[tuple[int, int, bool]], float]] = []
        self._runner = runner
        self._execute = runner.execute
        runner.execute = self

    def __call__(self, batch):
        known = self._runner.state.seqs  # the runner's sequences before this step's deltas

        def num_tokens(s) -> int:
            seq = known.get(s.seq_id)
            return (len(seq.token_ids) if seq is not None else 0) + len(s.new_token_ids)

        spans = [(s.start, s.num_new_tokens,
                  s.start + s.num_new_tokens - s.num_spec == num_tokens(s)) for s in batch.seqs]
        t0 = time.perf_counter()
        result = self._execute(batch)
        self.steps.append((spans, time.perf_counter() - t0))
        return result


def _generate(engine, requests):
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for _, n in requests]
    return LLM(engine=engine).generate([p for p, _ in requests], params, use_tqdm=False)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _peak_memory(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device != "cpu" else None


# --- phases -----------------------------------------------------------------------------------


def run_decode(args) -> dict:
    """Batch 1: one prompt, then decode steps; bandwidth utilisation per decode step."""
    device = torch.device(args.device)
    hw = measure_hardware(device, args.tiny)
    engine, config, setup = build_servelm(args, args.decode_model, max_num_seqs=1)
    prompt_len, new_tokens = (16, 8) if args.tiny else (args.decode_prompt_len,
                                                       args.decode_new_tokens)
    _generate(engine, uniform_workload(1, 8, 8, config.vocab_size, 99))  # compile, warm up
    recorder = StepRecorder(engine.runner)
    request = uniform_workload(1, prompt_len, prompt_len, config.vocab_size, args.seed)[0]
    t0 = time.perf_counter()
    out = _generate(engine, [(request[0], new_tokens)])[0].outputs[0]
    elapsed = time.perf_counter() - t0
    decode_steps = [(s, t) for s, t in recorder.steps if all(n == 1 for _, n, _ in s)]
    costs = roofline.model_costs(config, torch.empty((), dtype=DTYPES[args.dtype]).element_size())
    summary = roofline.summarize(decode_steps, costs, hw["copy_bandwidth_Bps"],
                                 hw["matmul_flops"], sum(t for _, t in decode_steps))
    step_times = sorted(t for _, t in decode_steps)
    bytes_per_s = (summary["weight_bytes"] + summary["kv_bytes"]) / summary["step_s"]
    return {"phase": "decode", "system": "servelm", "model": config.name, "hardware": hw,
            "setup": setup, "num_output_tokens": len(out.token_ids), "elapsed_s": elapsed,
            "decode_steps": len(decode_steps),
            "decode_tok_s": len(decode_steps) / summary["step_s"],
            "median_step_ms": 1e3 * step_times[len(step_times) // 2],
            "weight_bytes_per_step": costs.weight_bytes,
            "achieved_bytes_per_s": bytes_per_s,
            "bandwidth_utilisation": bytes_per_s / hw["copy_bandwidth_Bps"],
            "roofline": summary, "peak_memory_bytes": _peak_memory(args.device)}


def run_offline(args) -> dict:
    device = torch.device(args.device)
    hw = measure_hardware(device, args.tiny)
    engine, config, setup = build_servelm(args, args.model, args.max_num_seqs)
    requests = _offline_requests(args, config.vocab_size)
    _generate(engine, uniform_workload(2, 16, 16, config.vocab_size, 99))  # compile, warm up
    recorder = StepRecorder(engine.runner)
    _sync(args.device)
    t0 = time.perf_counter()
    outs = _generate(engine, requests)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if num_out != sum(n for _, n in requests):
        raise RuntimeError(f"generated {num_out} tokens, the workload asks for "
                           f"{sum(n for _, n in requests)}")
    costs = roofline.model_costs(config, torch.empty((), dtype=DTYPES[args.dtype]).element_size())
    summary = roofline.summarize(recorder.steps, costs, hw["copy_bandwidth_Bps"],
                                 hw["matmul_flops"], elapsed)
    return {"phase": "offline", "system": "servelm", "model": config.name, "hardware": hw,
            "setup": setup, **_throughput(requests, num_out, elapsed), "roofline": summary,
            "workload_bound": _bound(costs, requests, hw, elapsed),
            "peak_memory_bytes": _peak_memory(args.device)}


def _offline_requests(args, vocab: int) -> list[tuple[list, int]]:
    if args.tiny:
        return uniform_workload(8, 4, 24, vocab, args.seed)
    return uniform_workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)


def _bound(costs, requests, hw: dict, elapsed: float) -> dict:
    bound = roofline.workload_bound(costs, [(len(p), n) for p, n in requests],
                                    hw["copy_bandwidth_Bps"], hw["matmul_flops"])
    return {**bound, "share": bound["ideal_s"] / elapsed}


def _throughput(requests, num_out: int, elapsed: float) -> dict:
    num_in = sum(len(p) for p, _ in requests)
    return {"num_requests": len(requests), "num_input_tokens": num_in,
            "num_output_tokens": num_out, "elapsed_s": elapsed,
            "output_tok_s": num_out / elapsed, "total_tok_s": (num_in + num_out) / elapsed}


def run_hf(args) -> dict:
    """The offline workload through transformers' continuous-batching manager (what
    generate_batch drives), one max_new_tokens per request and EOS ignored (eos id -1)."""
    import transformers

    device = torch.device(args.device)
    hw = measure_hardware(device, args.tiny)
    model, impl = _hf_model(args)
    config = model_config(args.model, args.tiny)
    requests = _offline_requests(args, config.vocab_size)
    gen_cfg = transformers.GenerationConfig(max_new_tokens=max(n for _, n in requests),
                                            do_sample=False, pad_token_id=0)
    with torch.no_grad():  # not inference_mode: the manager's graphs and caches mind the mode
        finished, elapsed, partial = _hf_generate(model, gen_cfg, requests, args.hf_time_limit)
    num_out = sum(len(r.generated_tokens) for r in finished)
    costs = roofline.model_costs(config, torch.empty((), dtype=DTYPES[args.dtype]).element_size())
    return {"phase": "hf", "system": f"transformers {transformers.__version__}",
            "model": config.name, "hardware": hw, "attn_implementation": impl,
            "attn_implementation_used": getattr(model.config, "_attn_implementation", None),
            "partial": partial, "num_finished": len(finished),
            **_throughput(requests, num_out, elapsed),
            "workload_bound": _bound(costs, requests, hw, elapsed),
            "peak_memory_bytes": _peak_memory(args.device)}


def _hf_model(args):
    """A random-weight transformers model of the same shape; the first attention
    implementation in --hf-attn that this transformers accepts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = hf_config_dict(args.model, args.tiny)
    errors = []
    for impl in args.hf_attn.split(","):
        try:
            fields = {k: v for k, v in cfg.items() if k != "model_type"}
            hf_cfg = AutoConfig.for_model(cfg["model_type"], **fields)
            with torch.device(args.device):
                model = AutoModelForCausalLM.from_config(hf_cfg, dtype=DTYPES[args.dtype],
                                                         attn_implementation=impl)
            return model.eval(), impl
        except (ValueError, ImportError) as exc:
            errors.append(f"{impl}: {exc}")
    raise RuntimeError("no attention implementation accepted: " + "; ".join(errors))


def _hf_generate(model, gen_cfg, requests, time_limit: float):
    """-> (finished GenerationOutputs, seconds, whether the time limit cut the run short)."""
    kwargs = {}
    try:
        from transformers import ContinuousBatchingConfig
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(auto_switch_to_flash=False)
    except (ImportError, TypeError):
        pass  # older transformers: no such config, and no auto switch
    finished = []
    with model.continuous_batching_context_manager(generation_config=gen_cfg, block=True,
                                                   timeout=30, **kwargs) as manager:
        t0 = time.perf_counter()
        for ids, n in requests:
            manager.add_request(ids, max_new_tokens=n, eos_token_id=-1)
        while len(finished) < len(requests) and time.perf_counter() - t0 < time_limit:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error:
                    raise RuntimeError(f"transformers request failed: {result.error}")
                finished.append(result)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped")
        elapsed = time.perf_counter() - t0
    return finished, elapsed, len(finished) < len(requests)


# --- report and entry point -------------------------------------------------------------------


def report(paths: list[Path]) -> str:
    """One table over the phases' JSON files."""
    rows = [("phase", "system", "model", "result", "roofline share", "note")]
    for path in paths:
        if not path.is_file():
            continue  # a phase that failed or ran out of time wrote nothing
        r = json.loads(path.read_text())
        if r["phase"] == "decode":
            result = f"{r['decode_tok_s']:.1f} tok/s decode"
            share = f"{r['bandwidth_utilisation']:.0%} of copy bandwidth"
            note = f"median step {r['median_step_ms']:.2f} ms"
        else:
            result = f"{r['output_tok_s']:.0f} output tok/s"
            share = f"{r['workload_bound']['share']:.0%} (workload bound)"
            if "roofline" in r:
                share += f", {r['roofline']['roofline_share']:.0%} (own steps)"
            note = "PARTIAL: time limit" if r.get("partial") else ""
        rows.append((r["phase"], r["system"], r["model"], result, share, note))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=["decode", "offline", "hf", "report"])
    p.add_argument("--model", default="dummy:qwen3-0.6b", help="offline and hf phases")
    p.add_argument("--decode-model", default="dummy:llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--tiny", action="store_true", help="scaled-down model and workload")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--memory-fraction", type=float, default=0.8)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--decode-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-attn", default="paged|sdpa,sdpa",
                   help="attn_implementation choices for transformers, first accepted wins")
    p.add_argument("--hf-time-limit", type=float, default=150.0,
                   help="seconds; a slower transformers run reports the requests finished")
    p.add_argument("--out", type=Path, help="JSON file for this phase's result")
    p.add_argument("--inputs", type=Path, nargs="*", default=[], help="report: JSON files")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.phase == "report":
        print(report(args.inputs))
        return 0
    if args.device == "cpu" and not args.tiny:
        raise SystemExit("--device cpu needs --tiny (full-size models are for the GPU)")
    result = {"decode": run_decode, "offline": run_offline, "hf": run_hf}[args.phase](args)
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    result["versions"] = {"torch": torch.__version__, "python": platform.python_version()}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text if not args.out else f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
