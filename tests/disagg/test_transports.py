"""The KV transports by name: frames and payloads arrive whole and in order (the shm ring
reused many times over), a malformed frame closes the channel, bad names and headers are
refused by name."""

from __future__ import annotations

import os
import queue
import socket
import time

import pytest

from servelm.disagg.http import kv_transfer_from_headers
from servelm.disagg.messages import KVFrame, Sent, checksum
from servelm.disagg.transport import TransportError, make_transport
from servelm.protocol import InvalidParameterError


class Collect:
    def __init__(self):
        self.messages: queue.Queue = queue.Queue()
        self.closed: queue.Queue = queue.Queue()

    def on_message(self, channel, msg, payload):
        self.messages.put((channel, msg, None if payload is None else bytes(payload)))

    def on_closed(self, channel, reason):
        self.closed.put(reason)


def _address(name, tmp_path):
    return "tcp://127.0.0.1:0" if name == "tcp" else f"shm://{tmp_path}/kv.sock"


@pytest.mark.parametrize("name", ["tcp", "shm"])
def test_frames_arrive_whole_and_in_order(name, tmp_path):
    transport = make_transport(name)
    server, client = Collect(), Collect()
    listener = transport.listen(_address(name, tmp_path), server)
    channel = transport.connect(listener.address, client)
    channel.send(Sent("hello", 0))  # the prefill side answers on the channel it accepted
    peer = server.messages.get(timeout=10)[0]
    blocks = [os.urandom(40_000) for _ in range(100)]  # 100 > the ring's 32 slots
    for i, data in enumerate(blocks):
        peer.send(KVFrame("t", i, i, checksum(data)), data)
    peer.send(Sent("t", 100))
    for i, data in enumerate(blocks):
        _, msg, payload = client.messages.get(timeout=10)
        assert isinstance(msg, KVFrame) and msg.index == i
        assert payload == data and checksum(payload) == msg.crc32
    assert isinstance(client.messages.get(timeout=10)[1], Sent)
    channel.close()
    assert client.closed.get(timeout=10)
    assert server.closed.get(timeout=10)  # the peer sees the connection go
    listener.close()
    if name == "shm":  # the sender's ring is unlinked with its channel
        time.sleep(0.2)
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(
            f"servelm-kv-{os.getpid()}-")]


def test_a_malformed_frame_closes_the_channel():
    server = Collect()
    listener = make_transport("tcp").listen("tcp://127.0.0.1:0", server)
    host, port = listener.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"\xff" * 12)  # a header claiming 4 GiB
        reason = server.closed.get(timeout=10)
    assert "exceeds" in reason
    listener.close()


def test_an_unknown_peer_address_is_a_closed_channel():
    client = Collect()
    channel = make_transport("tcp").connect("tcp://127.0.0.1:1", client)
    assert "failed" in client.closed.get(timeout=10)
    channel.send(Sent("x", 0))  # a send on a dead channel is dropped, never raises


def test_bad_names_and_headers():
    with pytest.raises(TransportError, match="nixl") as e:
        make_transport("nixl")
    assert e.value.param == "kv_transport"
    with pytest.raises(TransportError) as e:
        make_transport("tcp").connect("10.0.0.1:80", Collect())
    assert e.value.param == "kv_address"
    assert kv_transfer_from_headers({}) is None
    for bad in ("not json", '{"role": "decode"}', '{"transfer_id": "t", "role": "x"}',
                '{"transfer_id": "t", "role": "decode"}'):
        with pytest.raises(InvalidParameterError) as e:
            kv_transfer_from_headers({"x-servelm-kv-transfer": bad})
        assert e.value.param == "x-servelm-kv-transfer"
