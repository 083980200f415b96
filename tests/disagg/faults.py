"""Deterministic fault injection between a KV channel and the role it delivers to.

FaultyTransport wraps a transport: every endpoint it hands out (a connecting role's or a
listening role's) goes through a FaultyEndpoint that applies a plan by message kind and
ordinal: drop, duplicate, corrupt (one payload byte flipped), or hold (delay: released by
`release()`, in order, after whatever came meanwhile).
"""

from __future__ import annotations


class Plan:
    def __init__(self, kind: str, action: str, which=(0,)):
        self.kind, self.action, self.which = kind, action, set(which)


class FaultyEndpoint:
    def __init__(self, inner, plans: list[Plan]):
        self.inner = inner
        self.plans = plans
        self.counts: dict[str, int] = {}
        self.held: list = []
        self.num_faults = 0

    def on_message(self, channel, msg, payload) -> None:
        kind = type(msg).__name__
        n = self.counts[kind] = self.counts.get(kind, 0) + 1
        for plan in self.plans:
            if plan.kind == kind and (n - 1) in plan.which:
                self.num_faults += 1
                if plan.action == "drop":
                    return
                if plan.action == "hold":
                    self.held.append((channel, msg, payload))
                    return
                if plan.action == "duplicate":
                    self.inner.on_message(channel, msg, payload)
                elif plan.action == "corrupt":
                    data = bytearray(payload)
                    data[len(data) // 2] ^= 0x40
                    payload = bytes(data)
        self.inner.on_message(channel, msg, payload)

    def on_closed(self, channel, reason: str) -> None:
        self.inner.on_closed(channel, reason)

    def release(self) -> None:
        held, self.held = self.held, []
        for item in held:
            self.inner.on_message(*item)


class FaultyTransport:
    def __init__(self, inner, plans: list[Plan]):
        self.inner = inner
        self.name = inner.name
        self.plans = plans
        self.endpoints: list[FaultyEndpoint] = []

    def _wrap(self, endpoint) -> FaultyEndpoint:
        ep = FaultyEndpoint(endpoint, self.plans)
        self.endpoints.append(ep)
        return ep

    def listen(self, address, endpoint):
        return self.inner.listen(address, self._wrap(endpoint))

    def connect(self, address, endpoint):
        return self.inner.connect(address, self._wrap(endpoint))

    @property
    def num_faults(self) -> int:
        return sum(e.num_faults for e in self.endpoints)

    def release(self) -> None:
        for e in self.endpoints:
            e.release()
