"""LoraSlots: the engine's plain-data view of adapters and the runner's adapter slots.

Owns: the registered adapters (name -> LoraEntry with an engine-wide id), which adapter sits
in which of the `max_loras` slots, the pins (running sequences per adapter: a pinned adapter
is never evicted), LRU eviction of unpinned ones, deferred removal (an unloaded adapter that
live sequences still use stays until the last one finishes), and the deltas the runner is
told each step (servelm/core/contract.py LoraDeltas). The scheduler asks `can_acquire`
before it admits a sequence with an adapter and `acquire`s it then, so residency is decided
here, in plain Python, and the runner only copies weights where it is told.
Never: imports torch, or touches weights.

    slots:   [ 7 | 3 | None | 12 ]      slot -> lora_id (None: free)
    pins:    {7: 2, 12: 1}              running sequences per adapter (3 is evictable)
    lru:     3, 12, 7                   least recently acquired first
    acquire(5): no free slot? the first unpinned in lru order (3) gives its slot up:
             slots[1] = 5, delta slots={1: 5}, num_evictions += 1
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from servelm.core.contract import LoraAdapterRef, LoraDeltas
from servelm.lora.adapter import AdapterSpec, LoraAdapterError, read_adapter
from servelm.protocol import InvalidParameterError


class LoraNotFoundError(InvalidParameterError):
    def __init__(self, message: str, param: str = "model"):
        super().__init__(message, param=param, code="model_not_found")


@dataclass
class LoraEntry:
    lora_id: int
    name: str
    spec: AdapterSpec
    num_live: int = 0  # sequences admitted and not finished
    is_removing: bool = False  # unloaded: no new requests; gone once num_live is 0


class LoraSlots:
    def __init__(self, max_loras: int, max_rank: int, model_config):
        if max_loras < 1:
            raise InvalidParameterError(f"max_loras must be >= 1, got {max_loras}",
                                        param="max_loras")
        if max_rank < 1:
            raise InvalidParameterError(f"max_lora_rank must be >= 1, got {max_rank}",
                                        param="max_lora_rank")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.model_config = model_config
        self.slots: list[int | None] = [None] * max_loras
        self._slot_of: dict[int, int] = {}
        self._pins: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident ids, oldest use first
        self.by_name: dict[str, LoraEntry] = {}
        self.by_id: dict[int, LoraEntry] = {}
        self._ids = itertools.count(1)
        self._added: list[LoraAdapterRef] = []
        self._removed: list[int] = []
        self._loads: dict[int, int] = {}
        self.num_loads = 0  # adapters copied into a slot
        self.num_evictions = 0  # of which displaced another adapter

    # -- registry --------------------------------------------------------------------------

    def register(self, name: str, path: str) -> LoraEntry:
        if not isinstance(name, str) or not name or name.strip() != name:
            raise InvalidParameterError(f"lora_name must be a non-empty name, got {name!r}",
                                        param="lora_name")
        if name in self.by_name:
            raise InvalidParameterError(f"an adapter named {name!r} is already loaded; "
                                        "unload it first", param="lora_name",
                                        code="lora_already_loaded")
        if not isinstance(path, str) or not path:
            raise LoraAdapterError(f"lora_path must be a directory path, got {path!r}")
        spec = read_adapter(path, self.model_config, self.max_rank)
        entry = LoraEntry(next(self._ids), name, spec)
        self.by_name[name] = self.by_id[entry.lora_id] = entry
        self._added.append(LoraAdapterRef(entry.lora_id, name, spec.path))
        return entry

    def unregister(self, name: str) -> bool:
        """Unload by name. Returns True when it is gone now, False when live sequences still
        use it (it goes when the last finishes; new requests are refused at once)."""
        entry = self.by_name.pop(name, None)
        if entry is None:
            raise LoraNotFoundError(f"no adapter named {name!r} is loaded", "lora_name")
        entry.is_removing = True
        if entry.num_live == 0:
            self._remove(entry)
            return True
        return False

    def lookup(self, name: str) -> LoraEntry:
        entry = self.by_name.get(name)
        if entry is None:
            raise LoraNotFoundError(f"the model `{name}` does not exist (neither the base "
                                    "model nor a loaded adapter)")
        return entry

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def _remove(self, entry: LoraEntry) -> None:
        del self.by_id[entry.lora_id]
        slot = self._slot_of.pop(entry.lora_id, None)
        if slot is not None:
            self.slots[slot] = None
            self._loads.pop(slot, None)
        self._lru.pop(entry.lora_id, None)
        unsent = [a for a in self._added if a.lora_id == entry.lora_id]
        if unsent:  # the runner never heard of it
            self._added.remove(unsent[0])
        else:
            self._removed.append(entry.lora_id)

    # -- sequences -------------------------------------------------------------------------

    def add_live(self, lora_id: int, n: int = 1) -> None:
        self.by_id[lora_id].num_live += n

    def finish_live(self, lora_id: int) -> None:
        entry = self.by_id[lora_id]
        entry.num_live -= 1
        if entry.num_live == 0 and entry.is_removing:
            self._remove(entry)

    # -- residency (the scheduler) ---------------------------------------------------------

    def is_resident(self, lora_id: int) -> bool:
        return lora_id in self._slot_of

    def can_acquire(self, lora_id: int) -> bool:
        if lora_id in self._slot_of or None in self.slots:
            return True
        return any(not self._pins.get(i) for i in self._lru)

    def acquire(self, lora_id: int) -> int:
        """Pin the adapter for one running sequence, loading it into a slot if needed (a free
        one, else the least recently used unpinned one). Returns its slot."""
        slot = self._slot_of.get(lora_id)
        if slot is None:
            slot = self._free_slot()
            self.slots[slot] = lora_id
            self._slot_of[lora_id] = slot
            self._loads[slot] = lora_id
            self.num_loads += 1
        self._pins[lora_id] = self._pins.get(lora_id, 0) + 1
        self._lru.pop(lora_id, None)
        self._lru[lora_id] = None
        return slot

    def release(self, lora_id: int) -> None:
        n = self._pins.get(lora_id, 0) - 1
        if n < 0:
            raise RuntimeError(f"adapter {lora_id} released more often than acquired")
        if n:
            self._pins[lora_id] = n
        else:
            self._pins.pop(lora_id, None)

    def _free_slot(self) -> int:
        if None in self.slots:
            return self.slots.index(None)
        victim = next((i for i in self._lru if not self._pins.get(i)), None)
        if victim is None:
            raise RuntimeError("acquire without can_acquire: every slot is pinned")
        slot = self._slot_of.pop(victim)
        del self._lru[victim]
        self.num_evictions += 1
        return slot

    @property
    def num_resident(self) -> int:
        return len(self._slot_of)

    def pinned(self) -> dict[int, int]:
        return dict(self._pins)

    # -- the step contract -----------------------------------------------------------------

    def drain(self) -> LoraDeltas | None:
        """What the runner has not been told yet (None: nothing)."""
        if not (self._added or self._removed or self._loads):
            return None
        deltas = LoraDeltas(self._added, self._removed, self._loads)
        self._added, self._removed, self._loads = [], [], {}
        return deltas

    def check_invariants(self, running_lora_ids: list[int]) -> None:
        """Every running sequence's adapter is resident and pinned once per sequence."""
        want: dict[int, int] = {}
        for i in running_lora_ids:
            want[i] = want.get(i, 0) + 1
        assert want == self._pins, (want, self._pins)
        assert all(i in self._slot_of for i in want)
        assert {i: s for s, i in enumerate(self.slots) if i is not None} == self._slot_of


__all__ = ["LoraEntry", "LoraNotFoundError", "LoraSlots"]
