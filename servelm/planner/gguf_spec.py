"""ModelSpec from a GGUF file's metadata (llama.cpp key names).

Owns: mapping `{arch}.*` metadata keys to ModelSpec fields.
Never: reads tensor data; imports `gguf` only when called, so the planner needs it only
for .gguf inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelm.planner.errors import PlanInputError
from servelm.planner.models import ModelSpec


def _metadata(path: Path) -> tuple[dict[str, Any], set[str]]:
    try:
        from gguf import GGUFReader  # lazy: optional dependency
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise PlanInputError("--model", "reading GGUF needs the `gguf` package") from e
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise PlanInputError("--model", f"cannot read GGUF {path}: {e}") from e
    meta = {name: field.contents() for name, field in reader.fields.items()}
    return meta, {t.name for t in reader.tensors}


def _scalar(v: Any) -> int:
    # Some models store per-layer head counts as arrays; the cache is sized by the largest.
    return int(max(v)) if isinstance(v, list) else int(v)


def load_gguf(path: str | Path) -> ModelSpec:
    p = Path(path)
    meta, tensors = _metadata(p)
    arch = meta.get("general.architecture")
    if not arch:
        raise PlanInputError("--model", f"{p} has no general.architecture")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    try:
        hidden = _scalar(get("embedding_length"))
        heads = _scalar(get("attention.head_count"))
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        rope_dim = _scalar(get("rope.dimension_count", 0))
        kv_lora = _scalar(get("attention.kv_lora_rank", 0))
        key_len = _scalar(get("attention.key_length", hidden // heads))
        num_experts = _scalar(get("expert_count", 0))
        expert_ff = _scalar(get("expert_feed_forward_length", 0))
        return ModelSpec(
            name=str(meta.get("general.name") or p.stem),
            num_layers=_scalar(get("block_count")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=_scalar(get("attention.head_count_kv", heads)),
            head_dim=key_len,
            vocab_size=int(vocab),
            intermediate_size=_scalar(get("feed_forward_length", 4 * hidden)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            num_experts=num_experts,
            experts_per_token=_scalar(get("expert_used_count", 0)),
            moe_intermediate_size=expert_ff or (_scalar(get("feed_forward_length", 0))
                                                if num_experts else 0),
            shared_expert_intermediate_size=_scalar(get("expert_shared_count", 0)) * expert_ff,
            first_k_dense=_scalar(get("leading_dense_block_count", 0)),
            kv_lora_rank=kv_lora,
            q_lora_rank=_scalar(get("attention.q_lora_rank", 0)),
            qk_rope_head_dim=rope_dim if kv_lora else 0,
            qk_nope_head_dim=key_len - rope_dim if kv_lora else 0,
            v_head_dim=_scalar(get("attention.value_length", key_len)) if kv_lora else 0,
            max_position_embeddings=_scalar(get("context_length", 0)),
            source=str(p),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, PlanInputError):
            raise
        raise PlanInputError("--model", f"GGUF {p}: missing or bad metadata: {e}") from e
