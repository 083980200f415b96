"""Loading a Hugging Face model directory: config.json, *.safetensors, tokenizer.json.

Owns: reading an HF checkpoint folder into a ModelConfig, a stream of float32 weights under HF
names, and a Tokenizer; and the list of weight names a Llama-family ModelConfig implies
(`hf_weight_names`), which the GGUF loader maps onto too. Other families (models/decoder.py)
get every tensor of the checkpoint: their load_weights places each by its name, refuses one
it has no place for and names what is missing.

Never: downloads (the folder must be local), imports model code, or reads pickled
`pytorch_model.bin` files (unsafe to unpickle, and safetensors can be memory-mapped).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers
import torch

from servelm.config import ModelConfig
from servelm.loader import fp8_blocks
from servelm.loader.tokenizer import Tokenizer, end_of_generation_ids

__all__ = ["hf_weight_names", "iter_hf_weights", "load_hf_config", "load_hf_tokenizer"]


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_hf_config(model_dir: Path, name: str) -> ModelConfig:
    """ModelConfig from config.json, with generation_config.json's extra EOS ids folded in."""
    config = ModelConfig.from_hf_config(_read_json(model_dir / "config.json"))
    eos_ids = list(config.eos_token_ids)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        # Instruct models often list their end-of-turn token only here (Llama 3: 128009).
        gen_eos = _read_json(gen_path).get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
    eos = tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None))
    config = config.replace(name=name, eos_token_ids=eos)
    processor_path = model_dir / "preprocessor_config.json"
    if config.vision is not None and processor_path.is_file():  # the image processor's own
        config = config.replace(vision=config.vision.with_processor(_read_json(processor_path)))
    return config


def hf_weight_names(config: ModelConfig) -> list[str]:
    """Every tensor a model of this config needs, under HF Llama names."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [f"{p}self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
        if config.attention_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in ("q", "k", "v")]
        if config.qk_norm:
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def iter_hf_weights(model_dir: Path, config: ModelConfig, select=None,
                    dtype: torch.dtype | None = None,
                    skip=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor in `dtype`) for every weight `config` needs, read memory-mapped.
    select: `(name, safetensors slice) -> (name, tensor) | None`, a model-parallel rank's
    part of each tensor (only those bytes are read). dtype: the model's (None: float32), so
    a bfloat16 model's weights (and fp8 blocks' dequantized values) never pass through
    float32. skip: `name -> bool`, tensors not read at all (nor their fp8 scales)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}; only safetensors checkpoints are supported "
            "(re-save a pytorch_model.bin checkpoint with transformers' save_pretrained)"
        )
    read = _Reader(files, fp8_blocks.fp8_block_size(model_dir), select,
                   torch.float32 if dtype is None else dtype)
    if config.architecture not in _LLAMA_NAMED:
        yield from _iter_all(files, read, skip)
        return
    wanted = set(hf_weight_names(config))
    seen: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            # Extra tensors (a tied lm_head saved anyway, rotary inv_freq buffers) are skipped.
            for name in f.keys():
                if name in wanted and name not in seen:
                    seen.add(name)
                    if (picked := read(f, name)) is not None:
                        yield picked
    missing = wanted - seen
    if missing:
        raise ValueError(
            f"{model_dir} lacks {len(missing)} weights the config needs, e.g. {sorted(missing)[:3]}"
        )


_LLAMA_NAMED = ("llama", "qwen2", "qwen3")  # the families hf_weight_names describes


def _iter_all(files: list[Path], read, skip=None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    seen: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if skip is not None and skip(name):
                    continue
                if name not in seen and not read.is_scale(name):
                    seen.add(name)
                    if (picked := read(f, name)) is not None:
                        yield picked


class _Reader:
    """One tensor as (name, tensor in dtype), through a model-parallel `select` when given;
    in a block-quantized fp8 checkpoint (loader/fp8_blocks.py) a weight with a scale tensor
    is read whole with it and dequantized first (select then narrows the float tensor)."""

    def __init__(self, files: list[Path], fp8_block: tuple[int, int] | None, select=None,
                 dtype: torch.dtype = torch.float32):
        from safetensors import safe_open

        self.select = select
        self.dtype = dtype
        self.fp8_block = fp8_block
        self.scale_files: dict[str, Path] = {}  # weight name -> file holding its scales
        if fp8_block is not None:
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        if fp8_blocks.is_scale(name):
                            self.scale_files[name[:-len(fp8_blocks.SCALE_SUFFIX)]] = file

    def is_scale(self, name: str) -> bool:
        return self.fp8_block is not None and fp8_blocks.is_scale(name)

    def __call__(self, f, name: str) -> tuple[str, torch.Tensor] | None:
        scale_file = self.scale_files.get(name)
        if scale_file is not None:
            from safetensors import safe_open

            with safe_open(str(scale_file), framework="pt", device="cpu") as g:
                scale = g.get_tensor(name + fp8_blocks.SCALE_SUFFIX)
            dense = fp8_blocks.dequantize(f.get_tensor(name), scale, self.fp8_block, name,
                                          self.dtype)
            return (name, dense) if self.select is None else self._narrowed(name, dense)
        if self.select is None:
            return name, f.get_tensor(name).to(self.dtype)
        return self._narrowed(name, f.get_slice(name))

    def _narrowed(self, name, view) -> tuple[str, torch.Tensor] | None:
        picked = self.select(name, view)
        return None if picked is None else (picked[0], picked[1].to(self.dtype))


def load_hf_tokenizer(model_dir: Path) -> Tokenizer:
    """Tokenizer from tokenizer.json, with special tokens and template from tokenizer_config.json.

    BOS: tokenizer.json's post-processor is what the HF fast tokenizer runs, so encode() adds a
    BOS exactly when the original does; `add_bos_token` in tokenizer_config.json is not re-read.
    """
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no tokenizer.json; save the tokenizer with transformers "
            "(tokenizer.save_pretrained) to produce one"
        )
    backend = tokenizers.Tokenizer.from_file(str(path))
    tok_cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    model_cfg = (
        _read_json(model_dir / "config.json") if (model_dir / "config.json").is_file() else {}
    )

    bos_id = _token_id(backend, tok_cfg.get("bos_token"), model_cfg.get("bos_token_id"))
    declared_eos = [_token_id(backend, tok_cfg.get("eos_token"), None)]
    for cfg_name in ("generation_config.json", "config.json"):
        cfg_path = model_dir / cfg_name
        if cfg_path.is_file():
            eos = _read_json(cfg_path).get("eos_token_id")
            declared_eos += eos if isinstance(eos, list) else [eos]
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=end_of_generation_ids(declared_eos, backend.token_to_id),
        chat_template=_chat_template(model_dir, tok_cfg),
    )


def _token_id(backend: tokenizers.Tokenizer, token: Any, fallback: int | None) -> int | None:
    """Id of a special token given as a string or an AddedToken dict, else `fallback`."""
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return token_id
    return fallback


def _chat_template(model_dir: Path, tok_cfg: dict[str, Any]) -> str | None:
    # Newer transformers save the template as its own file; older ones inline it, sometimes as
    # a list of named templates of which "default" is the chat one.
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
