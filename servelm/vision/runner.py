"""VisionRunner: the model runner's image side. Per step it encodes the images the step's
prefill chunks reach (one encoder run for all of them, cached by content hash), and gives
the model the rows of the flat batch that take image embeddings instead of token
embeddings, plus M-RoPE positions for families that use them.

    chunk of seq 7: positions 10..25, image at 12..27 (16 tokens)
    flat rows:      [ d0 d1 | p10 p11 p12 ... p25 ]
    mm.rows    ->            rows of p12..p25;  mm.embeds -> image rows 0..13

Owns: each sequence's images (from NewSequence), its embeddings until its prefill has
passed them, the EncoderCache, the step's encoder counters.
Never: scheduling (the scheduler's encoder budget decides what a step may start), or
reading engine state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from servelm.vision.encoder_cache import EncoderCache
from servelm.vision.prompt import mrope_positions


@dataclass
class MultimodalBatch:
    rows: torch.Tensor  # [R] flat batch rows whose input embedding is an image's
    embeds: torch.Tensor  # [R, hidden]
    positions: torch.Tensor | None = None  # [3, T] M-RoPE positions; None: the 1-D ones


class _SeqImages:
    def __init__(self, images: list, mrope: tuple | None):
        self.images = images
        self.embeds: dict[int, torch.Tensor] = {}  # image index -> its embeddings (pinned)
        self.mrope = mrope  # (rows [3, P] tensor, delta) or None


class VisionRunner:
    def __init__(self, model, vision, device, cache_tokens: int):
        self.model = model
        self.vision = vision
        self.device = device
        self.cache = EncoderCache(cache_tokens)
        self._seqs: dict[int, _SeqImages] = {}
        self.merge = int(vision.encoder.get("spatial_merge_size", 2))
        self.last = (0, 0, 0.0)  # the last step's (encoded, cache hits, seconds)

    def register(self, seq_id: int, images: list, num_prompt_tokens: int) -> None:
        mrope = None
        if self.vision.mrope_section:
            rows, delta = mrope_positions(num_prompt_tokens, images, self.merge)
            mrope = (torch.tensor(rows, dtype=torch.long, device=self.device), delta)
        self._seqs[seq_id] = _SeqImages(list(images), mrope)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def has_images(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def prepare(self, works: list, fb) -> None:
        """Set fb.mm for this step's works (each: .seq, .start, .tokens, in fb's order)."""
        self.last = (0, 0, 0.0)
        if not any(w.seq.seq_id in self._seqs for w in works):
            return
        self._encode_needed(works)
        rows, embeds = [], []
        for i, w in enumerate(works):
            entry = self._seqs.get(w.seq.seq_id)
            if entry is None:
                continue
            start, end = w.start, w.start + len(w.tokens)
            for k, img in enumerate(entry.images):
                lo, hi = max(start, img.offset), min(end, img.offset + img.num_tokens)
                if lo < hi:
                    base = fb.query_start_loc[i] - start
                    rows.append(torch.arange(base + lo, base + hi, device=self.device))
                    embeds.append(entry.embeds[k][lo - img.offset:hi - img.offset])
                if img.offset + img.num_tokens <= end:
                    entry.embeds.pop(k, None)  # its prefill is past it: the cache keeps it
        positions = self._mrope(works, fb) if self.vision.mrope_section else None
        if rows:
            fb.mm = MultimodalBatch(torch.cat(rows), torch.cat(embeds), positions)
        elif positions is not None:
            fb.mm = MultimodalBatch(torch.empty(0, dtype=torch.long, device=self.device),
                                    torch.empty(0), positions)
        # else (LLaVA past its images): fb.mm stays None, so the step may replay a graph

    def _encode_needed(self, works: list) -> None:
        """Embeddings for every image a chunk reaches: the sequence's own, the cache's, or
        one encoder run over all the rest."""
        todo: dict[str, list] = {}  # hash -> [(entry, k)], one encode per distinct image
        hits = 0
        for w in works:
            entry = self._seqs.get(w.seq.seq_id)
            if entry is None:
                continue
            start, end = w.start, w.start + len(w.tokens)
            for k, img in enumerate(entry.images):
                if k in entry.embeds or img.offset >= end or img.offset + img.num_tokens <= start:
                    continue
                if img.hash in todo:
                    todo[img.hash].append((entry, k))
                    continue
                cached = self.cache.get(img.hash)
                if cached is not None:
                    entry.embeds[k] = cached
                    hits += 1
                else:
                    todo[img.hash] = [(entry, k)]
        seconds = 0.0
        if todo:
            t0 = time.perf_counter()
            firsts = [entry.images[k] for entry, k in (v[0] for v in todo.values())]
            outs = self.model.encode_images(firsts)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the encoder's time, not its launch
            seconds = time.perf_counter() - t0
            for img, out, users in zip(firsts, outs, todo.values()):
                self.cache.put(img.hash, out, img.num_tokens)
                for entry, k in users:
                    entry.embeds[k] = out
        self.last = (len(todo), hits, seconds)

    def _mrope(self, works: list, fb) -> torch.Tensor:
        """[3, T]: a sequence with images takes its prompt rows, and p + delta past the
        prompt; any other row's three positions are its 1-D position."""
        parts = []
        for w in works:
            start, end = w.start, w.start + len(w.tokens)
            entry = self._seqs.get(w.seq.seq_id)
            if entry is None or entry.mrope is None:
                parts.append(torch.arange(start, end, device=self.device).expand(3, -1))
                continue
            rows, delta = entry.mrope
            num_prompt = rows.shape[1]
            parts.append(rows[:, start:min(end, num_prompt)])
            if end > num_prompt:
                tail = torch.arange(max(start, num_prompt), end, device=self.device) + delta
                parts.append(tail.expand(3, -1))
        return torch.cat(parts, dim=1)


__all__ = ["MultimodalBatch", "VisionRunner"]
