"""Frozen configuration dataclasses, normalised once at start-up, by job:

    model.py    ModelConfig, the one description of a model's shape (HF config.json or GGUF)
    engine.py   EngineArgs and the parts it hands out: CacheConfig, KVTiersConfig,
                SchedulerConfig, SpeculativeConfig, ParallelConfig
    flags.py    CLI flags built from a config dataclass's fields (option.py: the Flag each
                field carries): the engine's from EngineArgs, `servelm serve`'s own from
                ServerConfig and TopologyConfig
    cpu_kernel_choice.py  the --cpu-kernels value parsed
    quant_choices.py  the --quantization methods' and --quant-activations' names

`from servelm.config import X` keeps working for each of them.
Never: mutated after start-up (values found at run time, such as the number of KV blocks, are
passed explicitly, not written back here); imports torch.
"""

from servelm.config.model import ModelConfig, _gguf_sliding_window
from servelm.config.engine import (CacheConfig, EngineArgs, KVTiersConfig, KV_CACHE_DTYPES,
                                   KV_RELOAD_POLICIES, PARALLEL_LAUNCHERS, ParallelConfig,
                                   RAY_PLACEMENTS, SCHEDULING_POLICIES, SPEC_METHODS,
                                   SchedulerConfig, SpeculativeConfig)
from servelm.config.flags import add_engine_cli_args, engine_args_from_cli, parse_bytes

__all__ = ["CacheConfig", "EngineArgs", "KVTiersConfig", "KV_CACHE_DTYPES", "KV_RELOAD_POLICIES",
           "ModelConfig", "PARALLEL_LAUNCHERS", "ParallelConfig", "RAY_PLACEMENTS",
           "SCHEDULING_POLICIES", "SPEC_METHODS", "SchedulerConfig", "SpeculativeConfig",
           "add_engine_cli_args", "engine_args_from_cli", "parse_bytes"]
