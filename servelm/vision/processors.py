"""Image preprocessing per vision family, as the checkpoint's preprocessor_config.json says:
resize, rescale, normalise, patch. Pillow and numpy; the front end runs it in a worker thread.

Owns: ImageProcessor (one per family, by name), Processed (the encoder's input: float32
pixel values, their grid, how many prompt tokens the image becomes) and the content hash
that keys the encoder cache and the prefix cache.
Never: imports torch, or runs on the asyncio event loop's thread (servelm/server/prompts.py
hands it to a worker).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from servelm.vision.config import VisionConfig

# CLIP's statistics: the default of both families' processors
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3


@dataclass
class Processed:
    pixels: np.ndarray  # float32; Qwen2-VL [patches, C*T*p*p], LLaVA [C, H, W]
    num_tokens: int  # prompt tokens the image fills
    grid_thw: list[int] = field(default_factory=list)

    @cached_property
    def hash(self) -> str:
        """Content hash of what the encoder sees: equal for the same picture however it was
        sent (PNG or WebP of the same pixels), different for any pixel or grid change."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self.pixels.shape, self.grid_thw)).encode())
        h.update(self.pixel_bytes)
        return h.hexdigest()

    @cached_property
    def pixel_bytes(self) -> bytes:
        return np.ascontiguousarray(self.pixels, dtype=np.float32).tobytes()


class ImageProcessor:
    def __init__(self, vision: VisionConfig):
        self.vision = vision
        p = vision.processor
        self.mean = np.array(p.get("image_mean", CLIP_MEAN), dtype=np.float32)
        self.std = np.array(p.get("image_std", CLIP_STD), dtype=np.float32)
        self.rescale = float(p.get("rescale_factor", 1 / 255))
        self.resample = int(p.get("resample", _BICUBIC))

    def __call__(self, image) -> Processed:
        raise NotImplementedError

    def _normalise(self, image) -> np.ndarray:
        """RGB PIL image -> float32 [C, H, W], rescaled then normalised (the HF order)."""
        x = np.asarray(image, dtype=np.float32) * np.float32(self.rescale)
        x = (x - self.mean) / self.std
        return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f}"
                         " is above 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class Qwen2VLProcessor(ImageProcessor):
    """Dynamic resolution: the image keeps (about) its own size, cut into 14x14 patches; each
    2x2 group of patches becomes one prompt token (the encoder's merger)."""

    def __init__(self, vision: VisionConfig):
        super().__init__(vision)
        p, enc = vision.processor, vision.encoder
        size = p.get("size") or {}
        self.patch = int(p.get("patch_size", enc.get("patch_size", 14)))
        self.temporal = int(p.get("temporal_patch_size", enc.get("temporal_patch_size", 2)))
        self.merge = int(p.get("merge_size", enc.get("spatial_merge_size", 2)))
        self.min_pixels = int(p.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(p.get("max_pixels") or size.get("longest_edge")
                              or 28 * 28 * 1280)

    def __call__(self, image) -> Processed:
        f = self.patch * self.merge
        h, w = smart_resize(image.height, image.width, f, self.min_pixels, self.max_pixels)
        x = self._normalise(image.resize((w, h), resample=self.resample))
        c, m, p, t = x.shape[0], self.merge, self.patch, self.temporal
        gh, gw = h // p, w // p
        # [C, gh/m, m, p, gw/m, m, p] -> patches in merge-group order, each (C, T, p, p)
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        pixels = np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p), dtype=np.float32)
        return Processed(pixels, gh * gw // (m * m), [1, gh, gw])


class LlavaProcessor(ImageProcessor):
    """CLIP preprocessing: shortest edge resized, centre crop, one fixed-size image; every
    patch of the encoder's grid becomes a prompt token."""

    def __init__(self, vision: VisionConfig):
        super().__init__(vision)
        p, enc = vision.processor, vision.encoder
        image_size = int(enc.get("image_size", 336))
        size = p.get("size") or {"shortest_edge": image_size}
        crop = p.get("crop_size") or {"height": image_size, "width": image_size}
        self.shortest = int(size.get("shortest_edge") or size.get("height") or image_size)
        self.crop = (int(crop.get("height", image_size)), int(crop.get("width", image_size)))
        patch = int(enc.get("patch_size", 14))
        self.num_tokens = (self.crop[0] // patch) * (self.crop[1] // patch)
        if vision.encoder.get("_vision_feature_select_strategy", "default") == "full":
            self.num_tokens += 1  # the CLS position too

    def __call__(self, image) -> Processed:
        w, h = image.size
        short, long_ = (w, h) if w <= h else (h, w)
        new_long = int(self.shortest * long_ / short)
        nw, nh = (self.shortest, new_long) if w <= h else (new_long, self.shortest)
        image = image.resize((nw, nh), resample=self.resample)
        ch, cw = self.crop
        top, left = (nh - ch) // 2, (nw - cw) // 2
        image = image.crop((left, top, left + cw, top + ch))
        return Processed(self._normalise(image), self.num_tokens)


PROCESSORS = {"qwen2_vl": Qwen2VLProcessor, "llava": LlavaProcessor}


def image_processor(vision: VisionConfig) -> ImageProcessor:
    return PROCESSORS[vision.family](vision)


__all__ = ["LlavaProcessor", "PROCESSORS", "Processed", "Qwen2VLProcessor", "image_processor",
           "smart_resize"]
