"""The engine's command-line flags, shared by `generate`, `chat`, `serve` and `bench`.

Owns: add_engine_cli_args, which builds one flag per EngineArgs field from the field itself
(its name, its type, its default, and the help, names, group, choices and parser in its
metadata: config/option.py), engine_args_from_cli, parse_bytes.
Never: holds a flag, a help text or a default of its own (a new engine option is a new
EngineArgs field with no edit here), or validates beyond parsing (EngineArgs does).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from servelm.config.engine import EngineArgs
from servelm.config.option import FLAG, Flag

# Each field's Flag.group -> its argument group's title, in the order --help shows them.
GROUPS = {"engine": "engine",
          "parallel": "model parallelism (docs/parallel.md)",
          "lora": "LoRA adapters (docs/lora.md)",
          "kv_tiers": "KV tiers below the device pool (docs/kv_tiers.md)",
          "disagg": "prefill/decode disaggregation (docs/disaggregation.md)",
          "spec": "speculative decoding"}
# Fields each command adds itself (the positional MODEL, with the command's own default).
NOT_FLAGS = frozenset({"model"})
_TYPES: dict[str, Callable] = {"int": int, "float": float}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2GB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    s = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(s)


def _cpu_kernels_arg(text: str) -> str:
    from servelm.config.cpu_kernel_choice import CpuKernelChoice

    try:
        CpuKernelChoice.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# Flag.parse names -> the argparse type.
PARSERS: dict[str, Callable] = {"bytes": parse_bytes, "cpu_kernels": _cpu_kernels_arg}


def flag_of(field: dataclasses.Field) -> Flag:
    """The field's Flag; a field without one is an error naming it (every option is a flag)."""
    flag = field.metadata.get(FLAG)
    if flag is None:
        raise TypeError(f"EngineArgs.{field.name} has no flag: declare it with "
                        "option(default, help, ...) (servelm/config/option.py)")
    return flag


def argument(field: dataclasses.Field) -> tuple[tuple[str, ...], dict]:
    """The add_argument call (names, keywords) of an EngineArgs field."""
    flag = flag_of(field)
    names = flag.names or ("--" + field.name.replace("_", "-"),)
    kwargs: dict = {"dest": field.name, "default": field.default, "help": flag.help}
    base = str(field.type).split("|")[0].strip()
    if base == "bool":
        if field.default and not names[0].startswith("--no-"):
            raise TypeError(f"EngineArgs.{field.name}: an option that is on names its "
                            "--no- flag")
        kwargs["action"] = "store_false" if field.default else "store_true"
    elif base.startswith("tuple"):  # repeatable; EngineArgs turns the list into a tuple
        kwargs.update(action="append", default=None)
    elif flag.parse is not None:
        kwargs["type"] = PARSERS[flag.parse]
    elif base != "str":  # argparse keeps a string as it is
        kwargs["type"] = _TYPES[base]
    if flag.choices is not None:
        kwargs["choices"] = list(flag.choices() if callable(flag.choices) else flag.choices)
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    return names, kwargs


def add_engine_cli_args(parser, args_class=EngineArgs) -> None:
    """One flag per field of `args_class` (EngineArgs; a test passes another), in GROUPS'
    order and the fields' own order within a group."""
    fields = [f for f in dataclasses.fields(args_class) if f.name not in NOT_FLAGS]
    for key, title in GROUPS.items():
        group = parser.add_argument_group(title)
        for field in fields:
            if flag_of(field).group == key:
                names, kwargs = argument(field)
                group.add_argument(*names, **kwargs)
    unknown = sorted({flag_of(f).group for f in fields} - set(GROUPS))
    if unknown:
        raise TypeError(f"EngineArgs flag groups {unknown} are not in GROUPS")


def engine_args_from_cli(args) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(args).items() if k in names})
