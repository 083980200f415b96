"""Tiny random-weight vision-language checkpoints written by transformers, and a model
directory around one (weights, preprocessor_config.json, a word-level tokenizer with the
family's special tokens, a chat template) for the server tests. Import as `tiny_vlm`."""

from __future__ import annotations

import base64
import io
import json

import numpy as np

# Qwen2-VL special tokens at the top of a 300-token vocabulary
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END, IM_START, IM_END = range(290, 296)
USER, ASSISTANT = 296, 297
VOCAB = 300
# Small images give few patches: 14-pixel patches, 2x2 merged into one token
PROCESSOR = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16, "patch_size": 14,
             "merge_size": 2, "temporal_patch_size": 2}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def make_qwen2_vl(seed: int = 0):
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=IM_END,
                         bos_token_id=None,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    torch.manual_seed(seed)
    return _spread(Qwen2VLForConditionalGeneration(cfg).eval())


def _spread(model):
    """Redraw the weights (norms of 64 and 32 kept) so logits spread out: greedy picks are
    rarely near-ties; and generate() never stops early."""
    import torch

    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif p.dim() == 1 and p.numel() not in (64, 32):
                p.normal_(0, 0.05)
    return model


def hf_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**PROCESSOR)


def write_model_dir(model, path):
    """save_pretrained + preprocessor_config.json + tokenizer.json/tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    model.save_pretrained(path, safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", **PROCESSOR}))
    vocab = {f"w{i}": i for i in range(IMAGE_PAD)}
    specials = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
                "<|im_start|>", "<|im_end|>"]
    vocab.update({s: IMAGE_PAD + i for i, s in enumerate(specials)})
    vocab.update({"user": USER, "assistant": ASSISTANT, "system": 298, "tool": 299})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    return path


def random_image(width: int, height: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


# LLaVA: 28x28 images in 7x7 patches -> 16 image tokens
LLAVA_PROCESSOR = {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}}


def make_llava(seed: int = 0):
    import torch
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration)

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=28, patch_size=7,
                              projection_dim=32)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=None,
                       eos_token_id=IM_END)
    torch.manual_seed(seed)
    return _spread(LlavaForConditionalGeneration(LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_PAD)).eval())


def llava_hf_processor():
    from transformers import LlavaImageProcessorPil

    return LlavaImageProcessorPil(**LLAVA_PROCESSOR)
