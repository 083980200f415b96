"""Training an EAGLE-3 head for the served model by self-distillation, on the CPU.

    prompts (JSONL, or the set shipped in servelm/spec/data)
      -> the target answers them greedily                       samples.json
      -> draft vocabulary: the most frequent tokens (d2t / t2d)  vocab.pt
      -> per sample: hidden states after the aux layers and the
         target's top-32 next-token probabilities over the draft
         vocabulary                                              features/N.pt
      -> steps of the EAGLE-3 objective with training-time test  trainer_state.pt + the head

Training-time test (EAGLE-3): step 0 is teacher-forced (the target's features at every
position); at step j each position p takes as its hidden input the drafter's own output for
p - 1 from step j - 1, as a chain drafted from position p - j would at inference. Its
attention sees the real positions <= p - j and, for i = 1..j, the keys step i computed for
position p - j + i: exactly the keys that chain would hold. Every step's loss is the soft
cross-entropy to the target's distribution (restricted to the draft vocabulary, positions
whose target argmax lies outside it masked), weighted 0.8^j.

Owns: the data pipeline, the objective and the resumable loop. Every phase resumes: samples,
features and the trainer state are files in the output directory, and the head is written
(in the layout servelm/spec/eagle.py loads) at every checkpoint.
Never: serving, or building the target's engine and LLM API: the command does
(servelm/spec_tools/cli.py) and hands the LLM in, since both sit above the spec package.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from dataclasses import dataclass

import torch

from servelm.spec.eagle import (Eagle3Config, Eagle3Drafter, default_aux_layers,
                                random_drafter, save_drafter)

TOPK = 32  # target probabilities kept per position
DEFAULT_PROMPTS = os.path.join(os.path.dirname(__file__), "data", "train_prompts.jsonl")


@dataclass(frozen=True)
class TrainOptions:
    out: str
    prompts: str = DEFAULT_PROMPTS
    num_prompts: int | None = None  # all
    max_new_tokens: int = 256
    steps: int = 2000
    ttt_steps: int = 3
    draft_vocab_size: int = 8192
    lr: float = 3e-4
    save_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "steps", "ttt_steps", "draft_vocab_size",
                     "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def read_prompts(path: str, limit: int | None) -> list:
    """JSONL lines: {"prompt": text}, {"messages": [...]} or {"token_ids": [...]}."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            for key in ("messages", "prompt", "token_ids"):
                if key in row:
                    out.append(row[key])
                    break
            else:
                raise ValueError(f"prompts {path}:{n}: needs 'prompt', 'messages' or "
                                 "'token_ids'")
    return out[:limit] if limit else out


def generate_samples(llm, prompts: list, max_new_tokens: int) -> list[list[int]]:
    """The target's own greedy answers: prompt ids + output ids per prompt."""
    from servelm.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0)
    ids = []
    for p in prompts:
        if isinstance(p, str) and llm.tokenizer is not None \
                and getattr(llm.tokenizer, "chat_template", None):
            p = [{"role": "user", "content": p}]
        ids.append(llm.encode_chat(p) if isinstance(p, list) and p
                   and isinstance(p[0], dict) else p)
    outs = llm.generate(ids, params, use_tqdm=True)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def draft_vocabulary(samples: list[list[int]], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the samples (then the lowest unused ids),
    ascending: draft id i is target id vocab[i]."""
    size = min(size, vocab_size)
    counts = torch.bincount(torch.tensor([t for s in samples for t in s]),
                            minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True)
    return order[:size].sort().values


@torch.inference_mode()
def target_features(engine, token_ids: list[int], aux_layers: tuple[int, ...]):
    """One forward of the target over `token_ids` -> (aux [T, 3 Ht] float32, logits [T, V])."""
    from servelm.core.runner_state import score_item
    from servelm.engine.sequence import Sequence
    from servelm.protocol import RequestTimings, SamplingParams

    runner = engine.runner
    seq = Sequence("features", 0, token_ids, SamplingParams(max_tokens=1), RequestTimings(), 1)
    engine.block_manager.allocate(seq, len(token_ids))
    try:
        fb = runner._build_forward_batch([score_item(seq.token_ids, seq.block_table, 0,
                                                     len(token_ids))])
        fb.attn_metadata = runner.backend.build_metadata(fb)
        hidden, aux = runner.model(fb.input_ids, fb.positions, fb, aux_layers=aux_layers)
        return torch.cat(aux, dim=-1).float(), runner.model.compute_logits(hidden).float()
    finally:
        engine.block_manager.free(seq)


def sample_features(engine, ids: list[int], aux_layers, vocab: torch.Tensor) -> dict:
    aux, logits = target_features(engine, ids, aux_layers)
    in_draft = torch.zeros(logits.shape[1], dtype=torch.bool)
    in_draft[vocab] = True
    probs = torch.softmax(logits[:, vocab], dim=-1)
    top_p, top_i = probs.topk(min(TOPK, len(vocab)), dim=-1)
    return {"ids": torch.tensor(ids), "aux": aux.half(), "top_p": top_p.half(),
            "top_i": top_i.int(), "valid": in_draft[logits.argmax(-1)]}


# -- the objective ------------------------------------------------------------------------

def ttt_loss(drafter: Eagle3Drafter, feat: dict, steps: int) -> tuple[torch.Tensor, list]:
    """EAGLE-3's loss over one sample, with `steps` training-time-test steps -> (loss,
    top-1 accuracy per step). Row p: feature h_p, token x_{p+1}, target: the target's
    distribution at p + 1."""
    ids, t = feat["ids"], feat["ids"].shape[0] - 1
    hidden = drafter.fc(feat["aux"][:t].float())
    tokens, positions = ids[1:t + 1], torch.arange(t)
    target = torch.zeros(t, drafter.cfg.draft_vocab_size)
    target.scatter_(1, feat["top_i"][1:t + 1].long(), feat["top_p"][1:t + 1].float())
    target = target / target.sum(-1, keepdim=True)
    valid = feat["valid"][1:t + 1].clone()
    ks, vs, total, accs = [], [], 0.0, []
    for j in range(steps):
        q, k, v, residual = drafter.qkv(hidden, tokens, positions)
        ks.append(k)
        vs.append(v)
        out = drafter.finish(_ttt_attention(drafter, q, ks, vs, j), residual)
        logp = torch.log_softmax(drafter.logits(out), dim=-1)
        mask = valid & (positions >= j)
        if mask.any():
            total = total + 0.8 ** j * -(target[mask] * logp[mask]).sum(-1).mean()
            accs.append((logp[mask].argmax(-1) == target[mask].argmax(-1)).float().mean()
                        .item())
        hidden = torch.cat((out[:1], out[:-1]))  # row p next takes the output for p - 1
    return total, accs


def _ttt_attention(drafter, q, ks, vs, j: int) -> torch.Tensor:
    """Attention of step j: real keys (step 0) at positions <= p - j, and key i of the chain
    (i = 1..j) at position p - j + i (step i's keys shifted down by j - i rows)."""
    t, nh, d = q.shape
    rep = nh // ks[0].shape[1]
    scale = 1.0 / math.sqrt(d)

    def shift(x, n):  # row p <- row p - n (rows < n: zeros, masked by the loss)
        return x if n == 0 else torch.cat((torch.zeros_like(x[:n]), x[:-n]))

    k0, v0 = ks[0].repeat_interleave(rep, 1), vs[0].repeat_interleave(rep, 1)
    s0 = torch.einsum("thd,shd->hts", q, k0) * scale
    pos = torch.arange(t)
    s0 = s0.masked_fill(~(pos[None, :] <= pos[:, None] - j)[None], float("-inf"))
    chain_k = [shift(ks[i], j - i).repeat_interleave(rep, 1) for i in range(1, j + 1)]
    chain_v = [shift(vs[i], j - i).repeat_interleave(rep, 1) for i in range(1, j + 1)]
    extra = [(q * kc).sum(-1).T[:, :, None] * scale for kc in chain_k]  # [H, T, 1] each
    p = torch.softmax(torch.cat([s0, *extra], dim=-1), dim=-1)
    out = torch.einsum("hts,shd->thd", p[..., :t], v0)
    for i, vc in enumerate(chain_v):
        out = out + p[..., t + i].T[:, :, None] * vc
    return out  # [T, H, D]


# -- the loop -----------------------------------------------------------------------------

def new_drafter(target_config, embed: torch.Tensor, vocab: torch.Tensor,
                seed: int) -> Eagle3Drafter:
    """A head shaped like one of the target's layers, over the draft vocabulary."""
    c = target_config
    cfg = Eagle3Config(hidden_size=c.hidden_size, num_heads=c.num_heads,
                       num_kv_heads=c.num_kv_heads, intermediate_size=c.intermediate_size,
                       vocab_size=c.vocab_size, draft_vocab_size=len(vocab),
                       target_hidden_size=c.hidden_size,
                       aux_layers=default_aux_layers(c.num_layers), rms_norm_eps=c.rms_norm_eps,
                       rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                       head_dim=c.head_dim)
    drafter = random_drafter(cfg, embed.float(), seed)
    drafter.d2t.copy_(vocab - torch.arange(len(vocab)))
    drafter.t2d[vocab] = True
    return drafter


def train(llm, opts: TrainOptions, prompts: list | None = None, log=None) -> Eagle3Drafter:
    """Every phase, each resumed from `opts.out` where an earlier run stopped. `llm`: an LLM
    (servelm/llm.py) over the target's engine."""
    from tqdm import tqdm

    engine = llm.engine
    os.makedirs(os.path.join(opts.out, "features"), exist_ok=True)
    log = log or (lambda msg: print(msg, file=sys.stderr))
    samples_file = os.path.join(opts.out, "samples.json")
    if os.path.exists(samples_file):
        with open(samples_file) as f:
            samples = json.load(f)
    else:
        prompts = prompts if prompts is not None else read_prompts(opts.prompts,
                                                                    opts.num_prompts)
        log(f"generating answers to {len(prompts)} prompts with the target")
        samples = generate_samples(llm, prompts, opts.max_new_tokens)
        with open(samples_file, "w") as f:
            json.dump(samples, f)
    config, model = engine.model_config, engine.runner.model
    vocab = draft_vocabulary(samples, config.vocab_size, opts.draft_vocab_size)
    drafter = new_drafter(config, model.embed_tokens.weight.data, vocab, opts.seed)
    aux = drafter.cfg.aux_layers
    files = []
    for i, ids in enumerate(tqdm(samples, desc="features", unit="sample", file=sys.stderr)):
        file = os.path.join(opts.out, "features", f"{i}.pt")
        if not os.path.exists(file):
            torch.save(sample_features(engine, ids, aux, vocab), file)
        files.append(file)
    feats = [torch.load(f) for f in files]
    return fit(drafter, feats, opts, log)


def fit(drafter: Eagle3Drafter, feats: list[dict], opts: TrainOptions, log) -> Eagle3Drafter:
    from tqdm import tqdm

    drafter.train().requires_grad_(True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=opts.lr, weight_decay=0.0)
    state_file = os.path.join(opts.out, "trainer_state.pt")
    step, rng = 0, random.Random(opts.seed)
    if os.path.exists(state_file):
        state = torch.load(state_file, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        step, rng = state["step"], state["rng"]
        log(f"resuming at step {step} of {opts.steps}")
    bar = tqdm(total=opts.steps, initial=step, desc="train", unit="step", file=sys.stderr)
    while step < opts.steps:
        loss, accs = ttt_loss(drafter, feats[rng.randrange(len(feats))], opts.ttt_steps)
        opt.zero_grad()
        if torch.is_tensor(loss):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
            opt.step()
        step += 1
        bar.update(1)
        value = loss.item() if torch.is_tensor(loss) else loss
        bar.set_postfix(loss=f"{value:.3f}", acc=",".join(f"{a:.2f}" for a in accs))
        if step % opts.save_every == 0 or step == opts.steps:
            _checkpoint(drafter, opt, step, rng, opts.out, state_file)
    bar.close()
    return drafter.eval().requires_grad_(False)


def _checkpoint(drafter, opt, step: int, rng, out: str, state_file: str) -> None:
    """The head in the loadable layout, then the trainer state (written whole, then moved:
    an interrupted save leaves the previous one)."""
    save_drafter(drafter, out)
    tmp = state_file + ".tmp"
    torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "rng": rng}, tmp)
    os.replace(tmp, state_file)
