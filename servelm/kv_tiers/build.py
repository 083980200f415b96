"""build_kv_tiers: KVTiersConfig -> the KVTiers an engine puts below its device pool.

Owns: the fingerprint a disk tier files its blocks under (what makes a block readable by a
later run: the same model and weights, KV layout and servelm version), and assembling the
tiers in order (host memory, then disk). Never: imports torch at module level (the weights
digest for in-memory checkpoints imports it when asked).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from servelm import __version__
from servelm.config import KVTiersConfig, ModelConfig
from servelm.kv_tiers.disk_tier import DiskTier
from servelm.kv_tiers.host_tier import HostTier
from servelm.kv_tiers.io_queue import IOQueue
from servelm.kv_tiers.reload_policy import PrefillEstimate
from servelm.kv_tiers.tiers import KVTiers

_PROBE_BLOCKS = 64  # the bandwidth probes move this many blocks (at least 1 MiB)


def model_fingerprint(name: str, config: ModelConfig, weights_id: str, block_size: int,
                      block_nbytes: int, kv_dtype: str, quantization: str | None) -> dict:
    """Everything a stored block's meaning depends on. weights_id: the checkpoint files
    (weights_id_of_files) or a digest of in-memory weights (weights_digest)."""
    shapes = {k: v for k, v in dataclasses.asdict(config).items() if k != "source"}
    config_id = hashlib.blake2b(json.dumps(shapes, sort_keys=True, default=str).encode(),
                                digest_size=16).hexdigest()
    return {"servelm_version": __version__, "model": name, "weights": weights_id,
            "model_config": config_id, "block_size": block_size, "block_nbytes": block_nbytes,
            "kv_dtype": kv_dtype, "quantization": quantization}


def weights_id_of_files(files: list[Path]) -> str:
    """The checkpoint as files: resolved path, size and modification time of each."""
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(Path(p).resolve() for p in files):
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns};".encode())
    return h.hexdigest()


def weights_digest(model) -> str:
    """In-memory weights (tests' random checkpoints): a digest of every parameter's bytes."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        t = p.detach()
        if t.is_mkldnn:  # a linear packed for oneDNN
            t = t.to_dense()
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build_kv_tiers(config: KVTiersConfig, block_size: int, block_nbytes: int,
                   fingerprint: dict, threaded_io: bool = True) -> KVTiers:
    io = IOQueue(threaded=threaded_io)
    probe = max(block_nbytes * _PROBE_BLOCKS, 2**20)
    tiers = []
    if config.host_memory_bytes > 0:
        tiers.append(HostTier(config.host_memory_bytes, probe_nbytes=probe))
    if config.disk_dir is not None:
        tiers.append(DiskTier(config.disk_dir, config.disk_bytes, fingerprint, io,
                              probe_nbytes=probe))
    estimate = PrefillEstimate()
    if config.cost_model is not None:
        from servelm.engine.step_cost_model import StepCostModel

        estimate = PrefillEstimate(StepCostModel.load(config.cost_model))
    return KVTiers(tiers, block_size, block_nbytes, config.reload_policy, estimate, io)


def kv_tiers_from_args(args, config: ModelConfig, block_nbytes: int, kv_dtype: str,
                       name: str, weights_id: str) -> KVTiers:
    """The engine builder's: --kv-* flags -> the tiers it builds its engine with."""
    if args.kv_disk_dir is not None and args.is_lora_enabled:
        # An adapter's blocks are namespaced by its name and this run's id, not its weights:
        # a later run could give another adapter the same name and id.
        raise ValueError("kv_disk_dir: the disk tier does not serve LoRA adapters yet (their "
                         "blocks would be read back by a later run's adapter of the same "
                         "name); use --kv-host-memory-gb alone with --lora")
    block_size = args.block_size
    fingerprint = model_fingerprint(name, config, weights_id, block_size, block_nbytes,
                                    kv_dtype, args.quantization)
    return build_kv_tiers(args.kv_tiers_config(), block_size, block_nbytes, fingerprint)
