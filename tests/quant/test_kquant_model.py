"""The shipped model in llama.cpp's K-quants, served with its codes kept: greedy next tokens
against the same file's dequantized float model, and the held bytes against the file's.

The files are made by llama.cpp's own quantizer (servelm/bench/setup_peers.sh puts them in
PEERS_DIR/gguf); without them these tests skip, saying so. The kernels' unit tests
(tests/quant/test_kquant_linear.py) always run."""

import os
from pathlib import Path

import pytest

from servelm.llm import LLM
from servelm.protocol import SamplingParams
from servelm.quant.kquant_linear import KQuantLinear
from tiny_models import prefill_logits

PEERS = Path(os.environ.get("SERVELM_PEERS_DIR", "/work/peers"))
FILES = {kind: PEERS / "gguf" / f"SmolLM2-135M-Instruct.{kind}.gguf"
         for kind in ("Q4_K_M", "Q5_K_M", "Q6_K")}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _file(kind: str) -> Path:
    path = FILES[kind]
    if not path.is_file():
        pytest.skip(f"{path} is absent: llama.cpp's {kind} file of the shipped model is made by "
                    "servelm/bench/setup_peers.sh (llama-quantize in the peers directory)")
    return path


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), kv_cache_memory=32 * 2**20, max_model_len=512, dtype="float32",
               **kwargs)


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M", "Q6_K"])
def test_codes_kept_give_the_float_models_next_tokens(kind):
    path = _file(kind)
    # float values: without servelm's quantized kernels a K-quant file is not kept as codes
    kept, dequantized = _llm(path, quantization="gguf"), _llm(path, cpu_kernels="quant=torch")
    assert not any(isinstance(m, KQuantLinear)
                   for m in dequantized.engine.runner.model.modules())
    model = kept.engine.runner.model
    kquant = [m for m in model.modules() if isinstance(m, KQuantLinear)]
    assert kquant, "no K-quant matrix kept as codes"
    assert all(m.codes.dtype.itemsize == 1 for m in kquant)
    # Teacher-forced on the float model's own continuations: the kept codes compute with
    # int8 activations (q8_K), so an occasional near-tie may flip; the weights are the same.
    same = total = 0
    for text in PROMPTS:
        prompt = kept.tokenizer.encode(text)
        out = dequantized.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        ids = prompt + list(out)
        a = prefill_logits(dequantized.engine, ids).argmax(-1)[len(prompt) - 1:-1]
        b = prefill_logits(kept.engine, ids).argmax(-1)[len(prompt) - 1:-1]
        same, total = same + (a == b).sum().item(), total + len(out)
    assert same / total >= 0.9, f"{kind}: {same}/{total} next tokens agree"


def _llama_server_tokens(path: Path, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's own greedy continuation of `prompt` on the same file (its llama-server)."""
    import json
    import socket
    import subprocess
    import time
    import urllib.request

    server = PEERS / "llama.cpp" / "bin" / "llama-server"
    if not server.is_file():
        pytest.skip(f"{server} is absent: servelm/bench/setup_peers.sh builds llama.cpp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(server), "-m", str(path), "--port", str(port), "-t", "2",
                             "-c", "512", "--no-warmup"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                           "return_tokens": True, "cache_prompt": False}).encode()
        for _ in range(240):  # the model loads in a few seconds
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=120) as response:
                    return json.loads(response.read())["tokens"]
            except OSError:
                assert proc.poll() is None, "llama-server exited"
                time.sleep(0.5)
        raise AssertionError("llama-server did not answer")
    finally:
        proc.terminate()
        proc.wait(30)


def test_codes_kept_follow_llama_cpps_own_tokens():
    """Teacher-forced on llama.cpp's greedy continuation of the same Q4_K_M file: servelm's
    next-token choice with the codes kept (both compute with int8 activations here)."""
    path = _file("Q4_K_M")
    kept = _llm(path, quantization="gguf")
    same = total = 0
    for text in PROMPTS:
        prompt = kept.tokenizer.encode(text)
        out = _llama_server_tokens(path, prompt, 24)
        ids = prompt + list(out)
        ours = prefill_logits(kept.engine, ids).argmax(-1)[len(prompt) - 1:-1]
        same += sum(int(a) == b for a, b in zip(ours.tolist(), out))
        total += len(out)
    assert same / total >= 0.9, f"{same}/{total} of llama.cpp's next tokens agree"


def test_q4_k_m_holds_about_the_files_bytes():
    path = _file("Q4_K_M")
    model = _llm(path, quantization="gguf").engine.runner.model
    held = sum(m.num_weight_bytes for m in model.modules()
               if hasattr(m, "num_weight_bytes") and not hasattr(m, "parts"))
    # the file's matrices plus the int8 head's group scales and Q5_0 widened to a byte
    assert held < 1.6 * path.stat().st_size


@pytest.mark.parametrize("activations", ["float", "int8", "auto"])
def test_q4_k_m_decodes_on_the_stack_as_eagerly(activations):
    """The Q4_K_M file with its codes kept (K-quant matrices, q/k/v and down as row parts of
    two types, Q5_0 / Q8_0 as int8 codes) decodes on the C++ stack with the eager path's
    tokens and logprobs, exactly: the stack runs the same kernels. With activations "auto"
    the steps of 3 rows take the int8 form and those of 1 row the float one (the boundary
    set at 2 rows), in the stack as eagerly."""
    from servelm.quant import int8_act
    from servelm.runner.cpu_decode import refusal

    path = _file("Q4_K_M")
    kwargs = dict(quantization="gguf", quant_activations=activations)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    outs = {}
    int8_act.set_a8_min_rows(2 if int8_act.int8_dot_usable() else None)
    try:
        for mode in ("kernel", "torch"):
            llm = _llm(path, cpu_kernels=f"decode={mode}", **kwargs)
            runner = llm.engine.runner
            prompts = [llm.tokenizer.encode(text) for text in PROMPTS]
            outs[mode] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            if activations == "auto":  # one row a step: the few-row form
                outs[mode] += [o.outputs[0] for o in llm.generate(prompts[:1], params,
                                                                  use_tqdm=False)]
            if mode == "kernel":
                assert runner.cpu_stack is not None, refusal(
                    runner.model, runner.backend.kv_cache, runner.backend)
                assert runner.cpu_stack.steps >= 15
                if activations == "auto" and int8_act.int8_dot_usable():
                    assert set(runner.cpu_stack._stacks) == {"small", "full"}
    finally:
        int8_act.set_a8_min_rows(None)
    for a, b in zip(outs["kernel"], outs["torch"]):
        assert a.token_ids == b.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs] == \
            [(lp.token_id, lp.logprob, lp.top) for lp in b.logprobs]


def test_default_keeps_a_k_quant_files_codes_where_gguf_keeps_every_matrix_exactly():
    """Without --quantization: the Q4_K_M file (K-quants, Q5_0 and Q8_0: all kept exactly)
    runs as --quantization gguf on the stack; the Q5_K_M file (its Q5_1 matrices would be
    requantized) keeps its float values, as does the Q4_K_M file with --cpu-kernels
    quant=torch."""
    from servelm.config import EngineArgs
    from servelm.loader import resolve_model
    from servelm.loader.kquant_default import default_method

    from servelm.quant import int8_act
    from servelm.quant.mixed_linear import MixedLinear

    q4 = _file("Q4_K_M")
    llm = LLM(str(q4), kv_cache_memory=32 * 2**20, max_model_len=512)
    runner = llm.engine.runner
    assert any(isinstance(m, KQuantLinear) for m in runner.model.modules())
    # its int8 layers by each step's rows: float activations for few, int8 for many
    rows = int8_act.a8_min_rows()
    mixed = [m for m in runner.model.modules() if type(m) is MixedLinear]
    if rows is not None and rows > 1:
        assert mixed and all(m.max_rows == rows - 1 for m in mixed)
        assert {m.full.activations for m in mixed if hasattr(m.full, "activations")} == {"int8"}
    else:
        assert not mixed
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    assert runner.cpu_stack is not None and runner.cpu_stack.steps >= 3
    assert default_method(resolve_model(str(q4)), EngineArgs(model=str(q4))) == "gguf"
    assert default_method(resolve_model(str(q4)), EngineArgs(
        model=str(q4), cpu_kernels="quant=torch")) is None
    q5 = _file("Q5_K_M")
    assert default_method(resolve_model(str(q5)), EngineArgs(model=str(q5))) is None
