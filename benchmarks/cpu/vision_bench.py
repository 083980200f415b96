"""The vision record in docs/vision.md, on a small random-weight Qwen2-VL built by
transformers (no download): engine in-process, one step at a time.

1. Text streams while image requests arrive: TEXT_STREAMS text requests decode; at step
   BURST_AT a burst of BURST images (each IMAGE_SIZE x IMAGE_SIZE) arrives, and new text
   streams keep arriving every few steps. Per encoder budget (0 = off, then the given
   values): the text streams' TPOT (mean, p99 and max inter-token gap) and TTFT, the image
   requests' TTFT, and the longest step. Arrivals are by step index, so both runs see the
   same workload.
2. Encoder time per image against its token count: images of several sizes encoded alone
   (median of 3, after a warm-up).

Writes result.json and vision.png under --out.

    .venv/bin/python benchmarks/cpu/vision_bench.py --out benchmarks/results/vision-<ts>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from servelm.bench.results import git_commit, machine_info
from servelm.config import EngineArgs, ModelConfig
from servelm.engine_builder import assemble_engine
from servelm.protocol import EngineRequest, SamplingParams
from servelm.vision.processors import image_processor
from servelm.vision.prompt import expand_image_tokens

IMAGE_PAD = 990
SIZES = {  # (vision embed, depth, heads, text hidden, text layers)
    "tiny": (32, 2, 4, 64, 2),
    "small": (384, 8, 6, 512, 6),
}


def build_model(size: str):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    embed, depth, heads, hidden, layers = SIZES[size]
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=1000, hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=8192,
                         eos_token_id=None, bos_token_id=None,
                         rope_scaling={"type": "mrope",
                                       "mrope_section": _section(hidden // 8)}),
        vision_config=dict(depth=depth, embed_dim=embed, hidden_size=hidden, num_heads=heads,
                           mlp_ratio=4, patch_size=14, spatial_merge_size=2),
        image_token_id=IMAGE_PAD, video_token_id=991, vision_start_token_id=992,
        vision_end_token_id=993)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(cfg).eval()


def _section(head_dim: int) -> list[int]:
    half = head_dim // 2
    t = half // 4
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def make_engine(hf, budget: int, threads: int):
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    config = config.replace(vision=config.vision.with_processor(
        {"min_pixels": 56 * 56, "max_pixels": 1024 * 1024}))
    args = EngineArgs(model="vision-bench", num_blocks=4096, block_size=16, num_threads=threads,
                      max_num_batched_tokens=2048, max_num_encoder_tokens=budget)
    engine = assemble_engine(args, config, hf.state_dict().items(), None, "vision-bench")
    engine.image_token_id = IMAGE_PAD
    return engine, config


def image_request(config, rid: str, size: int, seed: int) -> EngineRequest:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    processed = image_processor(config.vision)(img)
    ids, images = expand_image_tokens([5, 6, IMAGE_PAD, 7, 8], IMAGE_PAD, [processed], ["x"])
    return EngineRequest(rid, ids, SamplingParams(max_tokens=8, temperature=0.0,
                                                  ignore_eos=True), images=images)


def text_request(rid: str, seed: int, output_len: int) -> EngineRequest:
    rng = np.random.default_rng(seed)
    return EngineRequest(rid, rng.integers(10, 900, 64).tolist(), SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True))


def run_mix(hf, budget: int, a) -> dict:
    engine, config = make_engine(hf, budget, a.threads)
    arrivals: dict[int, list[EngineRequest]] = {0: [text_request(f"t{i}", i, a.output_len)
                                                    for i in range(a.text_streams)]}
    arrivals.setdefault(a.burst_at, []).extend(
        image_request(config, f"img{i}", a.image_size, 100 + i) for i in range(a.burst))
    for k in range(a.late_streams):  # text arriving during and after the burst
        arrivals.setdefault(a.burst_at + 1 + 2 * k, []).append(
            text_request(f"late{k}", 50 + k, a.output_len // 2))
    arrived, tokens, steps = {}, {}, []
    step = 0
    while step <= max(arrivals) or engine.has_unfinished:
        now = time.perf_counter()
        for r in arrivals.get(step, []):
            engine.add_request(r)
            arrived[r.request_id] = now
        t0 = time.perf_counter()
        deltas = engine.step()
        t1 = time.perf_counter()
        steps.append(t1 - t0)
        for d in deltas:
            if d.token_ids:
                tokens.setdefault(d.request_id, []).append(t1)
        step += 1
    return summarize(arrived, tokens, steps, engine, budget)


def summarize(arrived, tokens, steps, engine, budget) -> dict:
    text = [r for r in tokens if not r.startswith("img")]
    gaps = [b - a for r in text for a, b in zip(tokens[r], tokens[r][1:])]
    tpots = [(tokens[r][-1] - tokens[r][0]) / (len(tokens[r]) - 1) for r in text
             if len(tokens[r]) > 1]
    ttft = {r: tokens[r][0] - arrived[r] for r in tokens}
    late = [v for r, v in ttft.items() if r.startswith("late")]
    img = [v for r, v in ttft.items() if r.startswith("img")]
    return {"max_num_encoder_tokens": budget,
            "text_tpot_mean_s": statistics.fmean(tpots),
            "text_itl_p99_s": float(np.percentile(gaps, 99)), "text_itl_max_s": max(gaps),
            "late_text_ttft_mean_s": statistics.fmean(late) if late else None,
            "image_ttft_mean_s": statistics.fmean(img), "image_ttft_max_s": max(img),
            "max_step_s": max(steps), "num_steps": len(steps),
            "num_images_encoded": engine.stats.num_images_encoded,
            "encoder_time_s": engine.stats.encoder_time_s}


def encoder_scaling(hf, sizes: list[int], threads: int) -> list[dict]:
    engine, config = make_engine(hf, 0, threads)
    model = engine.runner.model
    out = []
    with torch.inference_mode():
        model.encode_images(image_request(config, "w", sizes[0], 0).images)  # warm-up
        for size in sizes:
            images = image_request(config, f"s{size}", size, size).images
            times = []
            for _ in range(3):
                t = time.perf_counter()
                model.encode_images(images)
                times.append(time.perf_counter() - t)
            out.append({"image_size": size, "num_patches": images[0].shape[0],
                        "num_tokens": images[0].num_tokens,
                        "encoder_s": statistics.median(times)})
            print(f"encoder {size}px: {images[0].num_tokens} tokens "
                  f"{statistics.median(times) * 1e3:.1f} ms", file=sys.stderr)
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    runs = result["mix"]
    labels = [f"budget {r['max_num_encoder_tokens'] or 'off'}" for r in runs]
    x = np.arange(len(runs))
    for i, (key, name) in enumerate([("text_tpot_mean_s", "text TPOT mean"),
                                     ("text_itl_max_s", "text max gap"),
                                     ("image_ttft_mean_s", "image TTFT mean")]):
        ax1.bar(x + i * 0.27, [r[key] * 1e3 for r in runs], 0.27, label=name)
    ax1.set_xticks(x + 0.27, labels)
    ax1.set_ylabel("ms")
    ax1.legend()
    ax1.set_title("text streams while a burst of images arrives")
    enc = result["encoder"]
    ax2.plot([e["num_tokens"] for e in enc], [e["encoder_s"] * 1e3 for e in enc], "o-")
    ax2.set_xlabel("image tokens")
    ax2.set_ylabel("encoder ms per image")
    ax2.set_title("encoder time against tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budgets", default="0,256", help="max_num_encoder_tokens values")
    p.add_argument("--text-streams", type=int, default=4)
    p.add_argument("--late-streams", type=int, default=4)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--burst", type=int, default=6)
    p.add_argument("--burst-at", type=int, default=4)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--encoder-sizes", default="112,224,336,448,672,896")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    hf = build_model(a.size)
    result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
              "machine": machine_info(a.threads), "commit": git_commit(), "size": a.size,
              "model": dict(zip(("vision_embed", "vision_depth", "vision_heads",
                                 "text_hidden", "text_layers"), SIZES[a.size])),
              "workload": {k: getattr(a, k) for k in ("text_streams", "late_streams",
                                                      "output_len", "burst", "burst_at",
                                                      "image_size")}}
    result["mix"] = []
    for budget in [int(b) for b in a.budgets.split(",")]:
        run = run_mix(hf, budget, a)
        print(json.dumps(run), file=sys.stderr)
        result["mix"].append(run)
    result["encoder"] = encoder_scaling(hf, [int(s) for s in a.encoder_sizes.split(",")],
                                        a.threads)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(a.out, "vision.png"))
    print(os.path.join(a.out, "result.json"))


if __name__ == "__main__":
    main()
