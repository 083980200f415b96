"""Images from chat content parts: `data:` URLs decoded, remote URLs refused (or fetched from
an operator's allow-list), size and pixel limits, one error naming the content part.

Owns: ImageLimits and load_image(url, limits, param) -> an RGB PIL image.
Never: runs on the asyncio event loop's thread (base64, decompression and fetches are
blocking: servelm/server/prompts.py calls it in a worker thread); fetches a host that is not
in the allow-list, follows a redirect, or decodes an image before its header's size is
checked against the pixel limit (a small file can expand to gigabytes).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from servelm.protocol import InvalidParameterError

# MIME type -> the Pillow format that must be found inside (a PNG sent as image/jpeg is
# refused: the declared type is checked against the bytes).
IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG",
               "image/webp": "WEBP"}
_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[\w.+-]+)*)(;base64)?,",
                       re.ASCII)


class ImageError(InvalidParameterError):
    """A content part's image cannot be used; `param` names the part."""

    def __init__(self, message: str, param: str, code: str = "invalid_image"):
        super().__init__(f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int = 20 * 2**20  # encoded (file) size of one image
    max_image_pixels: int = 4096 * 4096  # width x height, from the header, before decoding
    max_images_per_request: int = 8
    # Hosts whose https:// images the server may fetch; () refuses every remote URL.
    allowed_remote_hosts: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0


def load_image(url: str, limits: ImageLimits, param: str):
    """The RGB image at `url` (a data: URL, or an allowed remote one); ImageError else."""
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string", param)
    if url[:5].lower() == "data:":
        mime, data = _decode_data_url(url, limits, param)
    else:
        mime, data = _fetch(url, limits, param)
    return _open(data, mime, limits, param)


def _decode_data_url(url: str, limits: ImageLimits, param: str) -> tuple[str, bytes]:
    m = _DATA_URL.match(url)
    if m is None or m.group(3) is None:
        raise ImageError("expected a data URL of the form data:image/png;base64,<data>", param)
    mime = (m.group(1) or "").lower()
    if mime not in IMAGE_TYPES:
        raise ImageError(f"image type {mime or 'none'!r} is not supported (supported: "
                         f"{', '.join(sorted(set(IMAGE_TYPES) - {'image/jpg'}))})", param,
                         code="unsupported_image_type")
    payload = url[m.end():]
    if len(payload) > (limits.max_image_bytes * 4) // 3 + 4:  # base64's 4/3, before decoding
        raise _too_large(limits, param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL's base64 payload is malformed", param) from None
    if len(data) > limits.max_image_bytes:
        raise _too_large(limits, param)
    return mime, data


def _too_large(limits: ImageLimits, param: str) -> ImageError:
    return ImageError(f"the image is larger than the limit of {limits.max_image_bytes} bytes",
                      param, code="image_too_large")


def _fetch(url: str, limits: ImageLimits, param: str) -> tuple[str, bytes]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ImageError(f"URL scheme {parts.scheme!r} is not supported; send the image as a "
                         "data: URL", param)
    host = (parts.hostname or "").lower()
    if parts.scheme != "https" or host not in limits.allowed_remote_hosts:
        raise ImageError("remote image URLs are not fetched by this server (send the image "
                         "as a data: URL; an operator may allow hosts with "
                         "--allowed-image-hosts)", param, code="remote_image_refused")
    import httpx

    try:
        with httpx.stream("GET", url, timeout=limits.fetch_timeout_s,
                          follow_redirects=False) as r:
            if r.status_code != 200:
                raise ImageError(f"fetching the image gave HTTP {r.status_code}", param)
            mime = r.headers.get("content-type", "").split(";")[0].strip().lower()
            if mime not in IMAGE_TYPES:
                raise ImageError(f"the fetched image's type {mime!r} is not supported", param,
                                 code="unsupported_image_type")
            chunks, size = [], 0
            for chunk in r.iter_bytes():
                size += len(chunk)
                if size > limits.max_image_bytes:
                    raise _too_large(limits, param)
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise ImageError(f"fetching the image failed: {type(exc).__name__}", param) from None
    return mime, b"".join(chunks)


def _open(data: bytes, mime: str, limits: ImageLimits, param: str):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data), formats=[IMAGE_TYPES[mime]])
    except UnidentifiedImageError:
        raise ImageError(f"the bytes are not a {IMAGE_TYPES[mime]} image", param,
                         code="invalid_image") from None
    except Exception as exc:  # Pillow raises many types for corrupt headers
        raise ImageError(f"cannot read the image: {exc}", param) from None
    width, height = img.size
    if width < 1 or height < 1:
        raise ImageError("the image is empty", param)
    if width * height > limits.max_image_pixels:
        raise ImageError(f"the image is {width}x{height} pixels; the limit is "
                         f"{limits.max_image_pixels} pixels", param, code="image_too_large")
    try:
        img.load()  # a truncated file fails here, not later in a worker
    except Exception as exc:
        raise ImageError(f"the image is truncated or corrupt: {exc}", param) from None
    return img.convert("RGB")


__all__ = ["IMAGE_TYPES", "ImageError", "ImageLimits", "load_image"]
