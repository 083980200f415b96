"""KV cache tiers below the device pool: host memory and disk (docs/kv_tiers.md).

Engine side (torch-free): tiers.py KVTiers (the engine's KVConnector: moves down on
eviction, reload-or-recompute, checked reloads), reload_policy.py (the decision and
CacheExplain), connector.py (the TierStore interface a store implements), host_tier.py,
disk_tier.py, entry.py (the stored block and its checks), io_queue.py (blocking work off the
step), build.py.
"""

from servelm.kv_tiers.connector import TierStats, TierStore
from servelm.kv_tiers.entry import BlockEntry
from servelm.kv_tiers.reload_policy import CacheExplain, PrefillEstimate
from servelm.kv_tiers.tiers import KVTiers, LoadPlan

__all__ = ["BlockEntry", "CacheExplain", "KVTiers", "LoadPlan", "PrefillEstimate",
           "TierStats", "TierStore"]
