"""Image tokens in a prompt: each image's one placeholder token in the tokenized chat prompt
becomes as many copies as the image has tokens, and the image records where they are.

Owns: expand_image_tokens (token ids + Processed images -> ids and ImageInputs),
cache_key_tokens (the ids as the prefix cache keys them: placeholders carry their image's
hash) and mrope_positions (Qwen2-VL's three position rows).
Never: imports torch or numpy; decodes images.
"""

from __future__ import annotations

from servelm.protocol import ImageInput, InvalidParameterError


def expand_image_tokens(ids: list[int], image_token_id: int, images: list,
                        params: list[str]) -> tuple[list[int], list[ImageInput]]:
    """ids with the k-th placeholder repeated images[k].num_tokens times, and each image's
    ImageInput. images: servelm.vision.processors.Processed, one per image part in order;
    params: the content part each came from (named in errors)."""
    where = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(where) != len(images):
        raise InvalidParameterError(
            f"the rendered prompt has {len(where)} image placeholders for {len(images)} image "
            "parts (a text part may not contain the model's image placeholder text)",
            param=params[0] if params else "messages")
    out: list[int] = []
    inputs = []
    prev = 0
    for pos, img in zip(where, images):
        out += ids[prev:pos]
        inputs.append(ImageInput(img.hash, len(out), img.num_tokens, img.pixel_bytes,
                                 list(img.pixels.shape), list(img.grid_thw)))
        out += [image_token_id] * img.num_tokens
        prev = pos + 1
    out += ids[prev:]
    return out, inputs


def image_key(image: ImageInput) -> int:
    """A negative id (never a vocabulary token) from the image's hash: the prefix cache's
    key of each of its placeholder positions."""
    return -1 - int(image.hash[:15], 16)


def cache_key_tokens(token_ids: list[int], images) -> list[int]:
    """token_ids with each image's placeholder positions keyed by its hash, so two prompts
    whose text is equal but whose images differ share no block past the first image."""
    keys = list(token_ids)
    for img in images:
        keys[img.offset:img.offset + img.num_tokens] = [image_key(img)] * img.num_tokens
    return keys


def mrope_positions(num_prompt_tokens: int, images, merge: int) -> tuple[list[list[int]], int]:
    """Qwen2-VL's M-RoPE positions of a prompt: ([t, h, w] rows of num_prompt_tokens each,
    delta). Text positions count on from the previous span's largest position + 1; an image's
    tokens take (t, row, column) of its merged grid from there; a position p past the prompt
    is p + delta in all three rows."""
    rows: list[list[int]] = [[], [], []]
    cur = 0  # the next text position
    at = 0
    for img in sorted(images, key=lambda i: i.offset):
        n_text = img.offset - at
        for r in rows:
            r.extend(range(cur, cur + n_text))
        cur += n_text
        t, h, w = img.grid_thw[0], img.grid_thw[1] // merge, img.grid_thw[2] // merge
        for ti in range(t):
            for hi in range(h):
                rows[0].extend([cur + ti] * w)
                rows[1].extend([cur + hi] * w)
                rows[2].extend(range(cur, cur + w))
        cur += max(h, w)
        at = img.offset + img.num_tokens
    n_text = num_prompt_tokens - at
    for r in rows:
        r.extend(range(cur, cur + n_text))
    cur += n_text
    return rows, cur - num_prompt_tokens


__all__ = ["cache_key_tokens", "expand_image_tokens", "image_key", "mrope_positions"]
