"""ImagePipeline: the front end's image work for one chat request, off the event loop.

    image_url parts -> [worker threads] decode (limits) -> preprocess -> Processed
                    -> placeholders expanded in the prompt ids -> ImageInputs

Owns: the worker pool (bounded, so a burst of large images queues here rather than
starving the event loop or taking every core), the per-request image limit, and reading the
served model's VisionConfig from the engine client (in-process or core process alike).
Never: runs decoding or resizing on the event loop's thread; touches the engine.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from servelm.protocol import InvalidParameterError
from servelm.vision.config import VisionConfig
from servelm.vision.image_io import ImageError, ImageLimits, load_image
from servelm.vision.parts import ImagePart
from servelm.vision.processors import image_processor
from servelm.vision.prompt import expand_image_tokens

IMAGE_WORKERS = 2  # threads decoding and resizing images (Pillow releases the GIL inside)


def image_limits(server_config) -> ImageLimits:
    c = server_config
    return ImageLimits(max_image_bytes=c.max_image_bytes, max_image_pixels=c.max_image_pixels,
                       max_images_per_request=c.max_images_per_request,
                       allowed_remote_hosts=tuple(c.allowed_image_hosts))


def vision_of(engine_client) -> VisionConfig | None:
    """The served model's VisionConfig: from the core's Ready info, or the in-process
    engine's model config; None for a text-only model (or a model-free test engine)."""
    info = getattr(engine_client, "info", None)
    config = getattr(info, "model_config", None)
    if config is None:
        config = getattr(getattr(engine_client, "engine", None), "model_config", None)
    return getattr(config, "vision", None)


class ImagePipeline:
    def __init__(self, vision: VisionConfig, limits: ImageLimits,
                 num_workers: int = IMAGE_WORKERS):
        self.vision = vision
        self.limits = limits
        self.processor = image_processor(vision)
        self.pool = ThreadPoolExecutor(num_workers, thread_name_prefix="servelm-images")

    async def prepare(self, ids: list[int], parts: list[ImagePart]):
        """(ids with every image's placeholder expanded, the ImageInputs), or an
        InvalidParameterError naming the first bad content part."""
        if len(parts) > self.limits.max_images_per_request:
            extra = parts[self.limits.max_images_per_request]
            raise InvalidParameterError(
                f"{extra.param}: more than {self.limits.max_images_per_request} images in one "
                "request", param=extra.param, code="too_many_images")
        loop = asyncio.get_running_loop()
        processed = await asyncio.gather(*(loop.run_in_executor(self.pool, self._one, p)
                                           for p in parts))
        return expand_image_tokens(ids, self.vision.image_token_id, processed,
                                   [p.param for p in parts])

    def _one(self, part: ImagePart):
        image = load_image(part.url, self.limits, part.param)
        try:
            processed = self.processor(image)
        except ValueError as exc:  # e.g. an aspect ratio the processor refuses
            raise ImageError(str(exc), part.param) from None
        processed.hash  # noqa: B018  hashing megabytes of pixels: here, not on the event loop
        return processed


__all__ = ["IMAGE_WORKERS", "ImagePipeline", "image_limits", "vision_of"]
