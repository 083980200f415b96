"""KV transports: how a transfer's messages and block bytes move between two workers.

Owns: the `KVTransport` interface (listen / connect), the `KVChannel` a connection is (send
never blocks the caller; what arrives goes to the channel's `KVEndpoint` from an I/O thread),
framing, and the transports by name:

    tcp     any two hosts. Frame = 12-byte head (header length, payload length, slot -1)
            | msgpack header (servelm/disagg/messages.py) | payload bytes.
    shm     the same host. Headers go over a unix socket; payloads never cross the kernel:
            the sender copies a block into a slot of its ring (a file under /dev/shm that
            both processes map), the head names the slot, the receiver copies it out and
            returns the slot (ShmFree). Flow control is the ring: a sender with no free slot
            waits on its writer thread, never on the engine's.
    inproc  two roles in one process (tests, an `LLM` with both roles): messages are handed
            to the peer's endpoint directly.

A GPU transport (NIXL / UCX: the decode worker reads the prefill worker's KV blocks from
device memory directly) plugs in through the same interface; the contract it must keep is
`GPUTransportSlot` below and docs/disaggregation.md.

Every transport checks what it reads before it allocates or trusts it (lengths, slot
indices, header types). Integrity of the block bytes is the transfer's job (KVFrame.crc32,
checked by the decode role on every transport), so a transport that moves bytes through
memory the peer could scribble on is still checked end to end.
Never: interprets a transfer (the roles in servelm/disagg/roles.py do), or pickles.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import queue
import socket
import struct
import tempfile
import threading
from typing import Protocol

from servelm.core.codec import CodecError, MAX_FRAME_BYTES, encode
from servelm.disagg.messages import ShmAttach, ShmFree, kv_decoder

logger = logging.getLogger(__name__)

_HEAD = struct.Struct(">IIi")  # header bytes, payload bytes, shm slot (-1: inline payload)
MAX_HEADER_BYTES = 1 << 20  # a Pull lists one hash per block: 1 MiB is ~100k blocks


class KVEndpoint(Protocol):
    """Who a channel delivers to (a role). Called from the channel's I/O thread: it must
    only enqueue."""

    def on_message(self, channel: "KVChannel", msg, payload) -> None: ...

    def on_closed(self, channel: "KVChannel", reason: str) -> None: ...


class KVChannel(Protocol):
    peer: str

    def send(self, msg, payload: bytes | None = None) -> None:
        """Queue a message (and a block's bytes) for the peer; never blocks."""
        ...

    def close(self) -> None: ...


class KVListener(Protocol):
    address: str  # what a peer connects to (the port chosen when 0 was asked)

    def close(self) -> None: ...


class KVTransport(Protocol):
    name: str

    def listen(self, address: str, endpoint: KVEndpoint) -> KVListener: ...

    def connect(self, address: str, endpoint: KVEndpoint) -> KVChannel:
        """A channel at once; connecting happens on its writer thread (a dead peer shows up
        as endpoint.on_closed, never as a stalled caller)."""
        ...


class GPUTransportSlot(Protocol):
    """The interface a GPU transport (NIXL, UCX) implements to replace block copies through
    host memory with reads of the peer's device memory. Not built in this version; written
    down so the roles need no change when it is:

        register_pool(base_ptrs, block_nbytes) -> bytes   this worker's KV pool as memory
            regions, and the descriptor a peer needs to read them (sent in KVHello)
        read_blocks(peer_descriptor, remote_ids, local_ids) -> handle   decode side: start
            one-sided reads of the prefill worker's blocks into reserved local blocks
        poll(handle) -> "pending" | "done" | "failed"     checked between engine steps

    The lease carries over unchanged and matters more: the prefill worker frees a pinned
    block only after the decode worker's Ack (or the lease's expiry, which the decode side
    observes first: its deadline is earlier), because here the decode worker reads memory
    the prefill worker owns. The crc32 check stays: computed on the prefill side after the
    block is written, verified by a kernel on the decode side before the blocks are cached.
    """

    def register_pool(self, base_ptrs: list[int], block_nbytes: int) -> bytes: ...

    def read_blocks(self, peer_descriptor: bytes, remote_ids: list[int],
                    local_ids: list[int]): ...

    def poll(self, handle) -> str: ...


class TransportError(ValueError):
    """A bad transport name or address (names the parameter)."""

    def __init__(self, message: str, param: str = "kv_transport"):
        super().__init__(message)
        self.param = param


def _recv_exactly(sock: socket.socket, n: int, buf: bytearray | None = None) -> bytearray:
    buf = bytearray(n) if buf is None else buf
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError(f"connection closed inside a frame ({got}/{n} bytes)")
        got += k
    return buf


class SocketChannel:
    """A channel over a stream socket: a writer thread (connects first when asked to) and a
    reader thread. The shm transport extends it with a payload ring."""

    def __init__(self, endpoint: KVEndpoint, peer: str, sock: socket.socket | None = None,
                 connect=None):
        self.endpoint = endpoint
        self.peer = peer
        self._sock = sock
        self._connect = connect  # () -> socket, run on the writer thread
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # the reader thread sends small replies too (shm)
        self._closed = False
        self.num_sent_bytes = 0
        threading.Thread(target=self._write_loop, name=f"servelm-kv-writer-{peer}",
                         daemon=True).start()

    # -- any thread ------------------------------------------------------------------------

    def send(self, msg, payload=None) -> None:
        if not self._closed:
            self._out.put((msg, payload))

    def close(self) -> None:
        self._out.put(None)  # the writer flushes what is queued, then shuts the socket

    # -- the channel's threads -------------------------------------------------------------

    def _write_loop(self) -> None:
        try:
            if self._sock is None:
                self._sock = self._connect()
            threading.Thread(target=self._read_loop, name=f"servelm-kv-reader-{self.peer}",
                             daemon=True).start()
            while True:
                item = self._out.get()
                if item is None:
                    break
                self._write(*item)
        except (OSError, CodecError) as exc:
            self._fail(f"send failed: {exc}")
            return
        self._fail("closed")

    def _write(self, msg, payload) -> None:
        header = encode(msg)
        n = 0 if payload is None else len(payload)
        with self._send_lock:
            self._sock.sendall(_HEAD.pack(len(header), n, -1) + header)
            if n:
                self._sock.sendall(payload)
        self.num_sent_bytes += n

    def _read_loop(self) -> None:
        head = bytearray(_HEAD.size)
        try:
            while True:
                hlen, plen, slot = _HEAD.unpack(_recv_exactly(self._sock, _HEAD.size, head))
                if hlen > MAX_HEADER_BYTES or plen > MAX_FRAME_BYTES:
                    raise CodecError(f"frame of {hlen} + {plen} bytes exceeds the limits")
                msg = kv_decoder.decode(bytes(_recv_exactly(self._sock, hlen)))
                payload = self._read_payload(plen, slot)
                if not self._internal(msg):
                    self.endpoint.on_message(self, msg, payload)
        except (OSError, CodecError, ValueError) as exc:
            self._fail(f"receive failed: {exc}")

    def _read_payload(self, plen: int, slot: int):
        if slot != -1:
            raise CodecError(f"slot {slot} on a channel without a ring")
        return _recv_exactly(self._sock, plen) if plen else None

    def _internal(self, msg) -> bool:
        return False

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        self._release()
        self.endpoint.on_closed(self, reason)

    def _release(self) -> None:
        pass


class _SocketListener:
    def __init__(self, sock: socket.socket, address: str, make_channel):
        self._sock = sock
        self.address = address
        self._make = make_channel
        self._channels: list = []
        threading.Thread(target=self._accept_loop, name="servelm-kv-listener",
                         daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            if conn.family != socket.AF_UNIX:  # small control frames go out at once
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._channels.append(self._make(conn, str(addr)))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
        for ch in self._channels:
            ch.close()


def _split(address: str, scheme: str) -> str:
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise TransportError(f"a {scheme} KV address looks like {prefix}..., got {address!r}",
                             param="kv_address")
    return address[len(prefix):]


class TcpTransport:
    name = "tcp"

    def __init__(self, connect_timeout_s: float = 2.0):
        self.connect_timeout_s = connect_timeout_s

    @staticmethod
    def _host_port(address: str) -> tuple[str, int]:
        rest = _split(address, "tcp")
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise TransportError(f"a tcp KV address is tcp://HOST:PORT, got {address!r}",
                                 param="kv_address")
        return host.strip("[]"), int(port)

    def listen(self, address: str, endpoint: KVEndpoint) -> KVListener:
        host, port = self._host_port(address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        return _SocketListener(sock, f"tcp://{shown}:{bound}",
                               lambda conn, peer: SocketChannel(endpoint, peer, conn))

    def connect(self, address: str, endpoint: KVEndpoint) -> KVChannel:
        host, port = self._host_port(address)

        def dial() -> socket.socket:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock

        return SocketChannel(endpoint, address, connect=dial)


_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _Ring:
    """num_slots payload slots of slot_bytes each in one mapped file."""

    def __init__(self, path: str, slot_bytes: int, num_slots: int, create: bool):
        self.path, self.slot_bytes, self.num_slots = path, slot_bytes, num_slots
        size = slot_bytes * num_slots
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise CodecError(f"shm ring {path} is smaller than announced")
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def close(self, unlink: bool) -> None:
        try:
            self.map.close()
        except BufferError:  # a view still alive: the mapping goes with the process
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ShmChannel(SocketChannel):
    """Headers over a unix socket, payloads through a ring this side owns (sending) and the
    peer's ring (receiving)."""

    NUM_SLOTS = 32
    SLOT_WAIT_S = 30.0  # a peer that never frees a slot is a dead peer
    _names = itertools.count()

    def __init__(self, *args, **kwargs):
        self._ring: _Ring | None = None  # ours, created with the first payload
        self._peer_ring: _Ring | None = None
        self._free_slots: queue.Queue = queue.Queue()
        super().__init__(*args, **kwargs)

    def _write(self, msg, payload) -> None:
        if payload is None or not len(payload):
            return super()._write(msg, payload)
        n = len(payload)
        if self._ring is None:
            path = os.path.join(_SHM_DIR, f"servelm-kv-{os.getpid()}-{next(self._names)}")
            self._ring = _Ring(path, n, self.NUM_SLOTS, create=True)
            for i in range(self.NUM_SLOTS):
                self._free_slots.put(i)
            super()._write(ShmAttach(path, n, self.NUM_SLOTS), None)
        if n > self._ring.slot_bytes:
            raise CodecError(f"payload of {n} bytes exceeds the ring's {self._ring.slot_bytes}")
        try:
            slot = self._free_slots.get(timeout=self.SLOT_WAIT_S)
        except queue.Empty:
            raise CodecError("the peer returned no shm slot in time") from None
        off = slot * self._ring.slot_bytes
        self._ring.map[off:off + n] = payload  # the one copy: user space to the shared page
        header = encode(msg)
        with self._send_lock:
            self._sock.sendall(_HEAD.pack(len(header), n, slot) + header)
        self.num_sent_bytes += n

    def _read_payload(self, plen: int, slot: int):
        if slot == -1:
            return super()._read_payload(plen, slot)
        ring = self._peer_ring
        if ring is None or not 0 <= slot < ring.num_slots or plen > ring.slot_bytes:
            raise CodecError(f"shm slot {slot} ({plen} bytes) outside the peer's ring")
        off = slot * ring.slot_bytes
        data = ring.map[off:off + plen]  # copied out: the slot is free for the sender again
        super()._write(ShmFree(slot), None)  # on the reader thread: a small header only
        return data

    def _internal(self, msg) -> bool:
        if isinstance(msg, ShmAttach):
            if not os.path.realpath(msg.path).startswith(os.path.realpath(_SHM_DIR) + os.sep):
                raise CodecError(f"shm ring {msg.path!r} outside {_SHM_DIR}")
            if self._peer_ring is not None:
                self._peer_ring.close(unlink=False)
            self._peer_ring = _Ring(msg.path, msg.slot_bytes, msg.num_slots, create=False)
            return True
        if isinstance(msg, ShmFree):
            if self._ring is None or not 0 <= msg.slot < self._ring.num_slots:
                raise CodecError(f"ShmFree of slot {msg.slot} outside this side's ring")
            self._free_slots.put(msg.slot)
            return True
        return False

    def _release(self) -> None:
        if self._ring is not None:
            self._ring.close(unlink=True)
        if self._peer_ring is not None:
            self._peer_ring.close(unlink=False)


class ShmTransport:
    name = "shm"

    def listen(self, address: str, endpoint: KVEndpoint) -> KVListener:
        path = _split(address, "shm")
        if os.path.exists(path):
            os.unlink(path)  # a stale socket of a worker that died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(64)
        return _SocketListener(sock, address,
                               lambda conn, peer: ShmChannel(endpoint, "shm-peer", conn))

    def connect(self, address: str, endpoint: KVEndpoint) -> KVChannel:
        path = _split(address, "shm")

        def dial() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            return sock

        return ShmChannel(endpoint, address, connect=dial)


# -- inproc ----------------------------------------------------------------------------------

_INPROC: dict[str, KVEndpoint] = {}
_inproc_lock = threading.Lock()


class InProcChannel:
    """One end of an in-process pair: send hands the message to the peer's endpoint."""

    def __init__(self, endpoint: KVEndpoint, peer: str):
        self.endpoint = endpoint
        self.peer = peer
        self.other: InProcChannel | None = None
        self.is_closed = False

    def send(self, msg, payload=None) -> None:
        other = self.other
        if not self.is_closed and other is not None and not other.is_closed:
            other.endpoint.on_message(other, msg, payload)

    def close(self, reason: str = "closed") -> None:
        """Both ends see the channel closed (a worker dying, in a test)."""
        for ch in (self, self.other):
            if ch is not None and not ch.is_closed:
                ch.is_closed = True
                ch.endpoint.on_closed(ch, reason)


class _InProcListener:
    def __init__(self, address: str):
        self.address = address

    def close(self) -> None:
        with _inproc_lock:
            _INPROC.pop(self.address, None)


class InProcTransport:
    name = "inproc"

    def listen(self, address: str, endpoint: KVEndpoint) -> KVListener:
        _split(address, "inproc")
        with _inproc_lock:
            _INPROC[address] = endpoint
        return _InProcListener(address)

    def connect(self, address: str, endpoint: KVEndpoint) -> KVChannel:
        with _inproc_lock:
            server = _INPROC.get(address)
        mine = InProcChannel(endpoint, address)
        if server is None:
            mine.is_closed = True
            endpoint.on_closed(mine, f"nothing listens at {address}")
            return mine
        theirs = InProcChannel(server, "inproc-peer")
        mine.other, theirs.other = theirs, mine
        return mine


TRANSPORTS = {"tcp": TcpTransport, "shm": ShmTransport, "inproc": InProcTransport}


def transport_names() -> list[str]:
    return sorted(TRANSPORTS)


def make_transport(name: str) -> KVTransport:
    cls = TRANSPORTS.get(name)
    if cls is None:
        raise TransportError(f"unknown KV transport {name!r}; choose one of "
                             f"{', '.join(transport_names())} (a GPU transport plugs in "
                             "through KVTransport: docs/disaggregation.md)")
    return cls()


def default_address(name: str, host: str, port: int) -> str:
    """Where a prefill worker serving HTTP on host:port listens for KV pulls by default."""
    if name == "tcp":
        return f"tcp://{host}:{port + 1000}"
    if name == "shm":
        return f"shm://{os.path.join(tempfile.gettempdir(), f'servelm-kv-{port}.sock')}"
    return f"inproc://kv-{port}"


__all__ = ["GPUTransportSlot", "InProcTransport", "KVChannel", "KVEndpoint", "KVListener",
           "KVTransport", "ShmTransport", "TRANSPORTS", "TcpTransport", "TransportError",
           "default_address", "make_transport", "transport_names"]
