"""The one wire format for everything that crosses a process or network boundary.

Owns: the messages between a front end and an engine core, the typed msgpack encoders and
decoders for them (msgspec: the schema is the type annotations, so a malformed frame is an
error, not an object of the wrong shape), length-prefixed framing, and the version check.
Never: pickle, or any decoding into types not named here.

    frame = 4-byte big-endian length | msgpack body
    first frame each way: Hello(version); a mismatch ends the connection with a clear error.

    front end -> core:  Hello, Start(EngineArgs), AddRequest, Abort, LoadLora, UnloadLora,
                        Shutdown
    core -> front end:  Hello, Ready(CoreInfo), Admitted, Rejected, Outputs(deltas, report),
                        LoraResult, Fatal
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

from servelm.config import EngineArgs, ModelConfig
from servelm.core.contract import (CONTRACT_VERSION, KVEvent, StepDescription, StepReport,
                                   StepResult)
from servelm.protocol import EngineRequest, TokenDelta

MAX_FRAME_BYTES = 256 * 2**20  # a frame larger than this is refused, not allocated
_HEADER = struct.Struct(">I")


class CodecError(RuntimeError):
    """A frame that is malformed, too large, or from a process of another contract version."""


class Hello(msgspec.Struct, tag=True):
    version: int
    role: str  # "frontend" | "core"
    pid: int = 0


class CoreInfo(msgspec.Struct):
    """What the front end needs to know about the core it talks to."""

    model_name: str
    model_config: ModelConfig
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    device_type: str
    speculative: bool
    lora_names: list[str] = []  # LoRA adapters loaded at start-up (--lora)
    # servelm/startup.py: the core's start-up stages (seconds) and their notes
    startup_stages: dict[str, float] = msgspec.field(default_factory=dict)
    startup_notes: dict[str, str] = msgspec.field(default_factory=dict)


class Ready(msgspec.Struct, tag=True):
    info: CoreInfo


class Start(msgspec.Struct, tag=True):
    """Build this engine (the front end's second frame)."""

    engine_args: EngineArgs


class AddRequest(msgspec.Struct, tag=True):
    request: EngineRequest


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class LoadLora(msgspec.Struct, tag=True):
    """Register the PEFT adapter at lora_path as lora_name (answered by a LoraResult)."""

    call_id: int
    lora_name: str
    lora_path: str


class UnloadLora(msgspec.Struct, tag=True):
    call_id: int
    lora_name: str


class LoraResult(msgspec.Struct, tag=True):
    """The answer to LoadLora / UnloadLora: message None = done; else refused (param and code
    as an InvalidParameterError names them). lora_names: the adapters loaded now."""

    call_id: int
    lora_names: list[str]
    message: str | None = None
    param: str | None = None
    code: str | None = None


class Admitted(msgspec.Struct, tag=True):
    request_id: str
    num_waiting_requests: int = 0  # the engine's queue with it (front end queue limits)


class Rejected(msgspec.Struct, tag=True):
    request_id: str
    message: str
    param: str | None = None
    code: str | None = None


class Outputs(msgspec.Struct, tag=True):
    deltas: list[TokenDelta]
    report: StepReport | None = None
    kv_events: list[KVEvent] = []


class Fatal(msgspec.Struct, tag=True):
    """The core is going down; in-flight requests fail with this message."""

    message: str


class WorkerStart(msgspec.Struct, tag=True):
    """What a model-parallel worker process is started with (on its stdin, one frame):
    the replica's EngineArgs and this worker's place in the group (servelm/parallel/)."""

    engine_args: EngineArgs
    rank: int
    master_addr: str
    master_port: int
    parent_pid: int
    cpus: list[int] = []  # the cores it may run on ([]: any)
    timeout_s: float = 300.0  # bound on joining and on every collective


FrontendMessage = Union[Hello, Start, AddRequest, Abort, LoadLora, UnloadLora, Shutdown]
CoreMessage = Union[Hello, Ready, Admitted, Rejected, Outputs, LoraResult, Fatal]

_encoder = msgspec.msgpack.Encoder()


def encode(msg) -> bytes:
    return _encoder.encode(msg)


def frame(msg) -> bytes:
    """The bytes to write for one message: length prefix + body."""
    body = _encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


class Decoder:
    """Typed decoding of one side's messages (frontend or core)."""

    def __init__(self, message_type):
        self._dec = msgspec.msgpack.Decoder(message_type)

    def decode(self, body: bytes):
        try:
            return self._dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            raise CodecError(f"malformed frame: {exc}") from exc


def frame_length(header: bytes) -> int:
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise CodecError(f"frame of {n} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return n


HEADER_BYTES = _HEADER.size


def check_hello(msg, expected_role: str) -> Hello:
    """The peer's first frame: a Hello of our version from the role we expect."""
    if not isinstance(msg, Hello):
        raise CodecError(f"expected a Hello frame first, got {type(msg).__name__}")
    if msg.version != CONTRACT_VERSION:
        raise CodecError(f"contract version mismatch: this process speaks version "
                         f"{CONTRACT_VERSION}, the {msg.role} (pid {msg.pid}) speaks "
                         f"{msg.version}; run the same servelm on both sides")
    if msg.role != expected_role:
        raise CodecError(f"expected a {expected_role}, the peer says it is a {msg.role}")
    return msg


# Step descriptions and results travel the same way when a runner lives in another process
# (model-parallel workers); their decoders are here so that there is one codec.
step_decoder = Decoder(StepDescription)
result_decoder = Decoder(StepResult)
frontend_decoder = Decoder(FrontendMessage)
core_decoder = Decoder(CoreMessage)
worker_start_decoder = Decoder(WorkerStart)

__all__ = ["Abort", "AddRequest", "Admitted", "CodecError", "CoreInfo", "Decoder", "Fatal",
           "HEADER_BYTES", "Hello", "LoadLora", "LoraResult", "MAX_FRAME_BYTES", "Outputs",
           "Ready", "Rejected", "UnloadLora",
           "Shutdown", "Start", "check_hello", "core_decoder", "encode", "frame", "frame_length",
           "frontend_decoder", "result_decoder", "step_decoder"]
