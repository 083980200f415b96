"""EncoderBudget: how much vision-encoder work one step may start, in image tokens.

A prefill chunk that reaches an image makes the runner encode the whole image in that step
(its embeddings are then reused by the chunks after it), so a burst of image requests could
fill a step with encoder work and stall every decoding stream beside it. The scheduler asks
`fit` for each prefill chunk: the chunk is cut just before the first image that would take the
step past the budget (that image starts in a later step). A step that has started no image
yet always takes one, however large, so every request makes progress.

Owns: the per-step count. Never: tensors, or the runner's encoder cache (an image found there
is still counted: conservative, and the engine stays free of runner state).
"""

from __future__ import annotations

from servelm.protocol import InvalidParameterError


class EncoderBudget:
    def __init__(self, max_tokens_per_step: int):
        """max_tokens_per_step: image tokens whose encoding may start in one step; 0: off."""
        self.max_tokens = max_tokens_per_step
        self.used = 0
        self.num_started = 0

    def reset(self) -> None:
        self.used = 0
        self.num_started = 0

    def fit(self, seq, start: int, num_new: int, resumed: bool) -> int:
        """The chunk's new length (<= num_new; 0: not this step) for positions start ..
        start + num_new - 1 of `seq`. An image is encoded in the chunk holding its first
        position, or in the first chunk of an admission that starts inside it (`resumed`:
        after a prefix-cache hit or a preemption the runner may not hold it)."""
        images = getattr(seq, "images", None)
        if not images or start >= seq.num_prompt_tokens:
            return num_new
        end = start + num_new
        for img in images:
            if img.offset + img.num_tokens <= start:
                continue
            if img.offset >= end:
                break
            if img.offset < start and not resumed:
                continue  # encoded with an earlier chunk of this run
            if self.max_tokens and self.num_started and \
                    self.used + img.num_tokens > self.max_tokens:
                return max(0, img.offset - start)
            self.used += img.num_tokens
            self.num_started += 1
        return num_new


def check_images(request, image_token_id: int | None) -> None:
    """An engine request's images: refused when the model takes none, else their spans must
    lie in the prompt, in order, each over placeholder tokens only."""
    if image_token_id is None:
        raise InvalidParameterError("this model does not take images (a text-only model)",
                                    param="messages", code="images_not_supported")
    ids, end = request.prompt_token_ids, 0
    for k, img in enumerate(request.images):
        span = ids[img.offset:img.offset + img.num_tokens]
        if img.offset < end or img.num_tokens < 1 or len(span) != img.num_tokens \
                or any(t != image_token_id for t in span):
            raise InvalidParameterError(
                f"images[{k}]: positions {img.offset}..{img.offset + img.num_tokens - 1} are "
                f"not a span of image placeholder tokens ({image_token_id}) after the "
                "previous image", param="images")
        end = img.offset + img.num_tokens


__all__ = ["EncoderBudget", "check_images"]
