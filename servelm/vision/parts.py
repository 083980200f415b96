"""Chat content parts of type image_url: checked and collected while the messages are
rendered for the chat template (servelm/server/schemas.py), each replaced by the text the
model's own template writes for an image.

Owns: ImagePart (which content part, its URL) and image_part(). Never: decodes or fetches
the image (servelm/vision/image_io.py, in a worker thread, later); imports Pillow or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.protocol import InvalidParameterError


@dataclass(frozen=True)
class ImagePart:
    param: str  # "messages[i].content[j]": named by every error about this image
    url: str


def image_part(part: dict, param: str, image_prompt: str | None,
               images: list[ImagePart]) -> str:
    """The text standing for this image_url part in the prompt; the part is appended to
    `images`. image_prompt None: the model takes no images (refused, naming the part)."""
    if image_prompt is None:
        raise InvalidParameterError(f"{param}: this model does not take images (image_url "
                                    "parts need a vision-language model)", param=param,
                                    code="images_not_supported")
    unknown = sorted(set(part) - {"type", "image_url"})
    if unknown:
        raise InvalidParameterError(f"{param}: unknown field {unknown[0]!r} in an image_url "
                                    "part", param=param)
    body = part.get("image_url")
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        raise InvalidParameterError(f"{param}.image_url must be an object with a 'url' string",
                                    param=param)
    unknown = sorted(set(body) - {"url", "detail"})
    if unknown:
        raise InvalidParameterError(f"{param}.image_url: unknown field {unknown[0]!r}",
                                    param=param)
    detail = body.get("detail", "auto")
    if detail != "auto":  # the processor's config fixes the resolution: no low/high modes
        raise InvalidParameterError(f"{param}.image_url.detail {detail!r} is not supported "
                                    "(only 'auto')", param=param)
    images.append(ImagePart(param, body["url"]))
    return image_prompt


__all__ = ["ImagePart", "image_part"]
