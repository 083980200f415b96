"""The messages of a KV transfer between a decode worker and a prefill worker.

Owns: the msgspec Structs both sides exchange over a KV channel (servelm/disagg/transport.py)
and their one typed decoder (servelm/core/codec.py's Decoder: a malformed header is a
CodecError, never an object of the wrong shape). Never: pickle, or block contents inside a
header (a KVFrame's bytes travel beside it as the frame's payload).

    decode -> prefill   KVHello, Pull, Ack, Cancel
    prefill -> decode   KVHello, KVFrame (+ payload: one block), Sent, Cancel
    either (shm only)   ShmAttach, ShmFree (the transport's own, never seen by the roles)
"""

from __future__ import annotations

import zlib
from typing import Union

import msgspec

from servelm.core.codec import Decoder

# Bumped when a message changes shape; both ends send it first (KVHello).
KV_PROTOCOL_VERSION = 1


class KVHello(msgspec.Struct, tag=True, array_like=True):
    version: int
    role: str  # "prefill" | "decode"
    block_nbytes: int  # bytes of one KV block in this worker's pool (0: not known yet)


class Pull(msgspec.Struct, tag=True, array_like=True):
    """Decode asks for blocks first_block .. first_block + len(hashes) - 1 of a prompt: the
    blocks it does not hold already (its prefix cache has the ones below first_block).
    `hashes`: their chain hashes, so the prefill side checks it computes the same prompt;
    lease_ms: how long decode keeps the blocks it reserved for them."""

    transfer_id: str
    first_block: int
    hashes: list[int]
    block_nbytes: int
    lease_ms: int


class KVFrame(msgspec.Struct, tag=True, array_like=True):
    """One block's KV; the payload (block_nbytes bytes) follows. crc32 covers the payload,
    `hash` names the block (chain hash), `index` is its position in the prompt."""

    transfer_id: str
    index: int
    hash: int
    crc32: int


class Sent(msgspec.Struct, tag=True, array_like=True):
    """Prefill has sent every frame it will send: blocks first_block .. end - 1."""

    transfer_id: str
    end: int


class Ack(msgspec.Struct, tag=True, array_like=True):
    """Decode holds its own verified copy of blocks first_block .. end - 1 (end may be
    first_block: it kept none): prefill may free its copies now."""

    transfer_id: str
    end: int


class Cancel(msgspec.Struct, tag=True, array_like=True):
    """The transfer is over without an ack; `cause` names why (a fallback cause)."""

    transfer_id: str
    cause: str


class ShmAttach(msgspec.Struct, tag=True, array_like=True):
    """shm transport: the sender's ring of payload slots, a file under /dev/shm."""

    path: str
    slot_bytes: int
    num_slots: int


class ShmFree(msgspec.Struct, tag=True, array_like=True):
    """shm transport: the receiver has copied the payload out of this slot."""

    slot: int


KVMessage = Union[KVHello, Pull, KVFrame, Sent, Ack, Cancel, ShmAttach, ShmFree]
kv_decoder = Decoder(KVMessage)


def checksum(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


__all__ = ["Ack", "Cancel", "KVFrame", "KVHello", "KVMessage", "KV_PROTOCOL_VERSION", "Pull",
           "Sent", "ShmAttach", "ShmFree", "checksum", "kv_decoder"]
