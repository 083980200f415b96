"""Model families, registered by name (ModelConfig.architecture): a family registers itself
by its module in this package defining a class with a `family` name of its own (a new
family is one new file here, plus its tests; nothing to edit in this file).

Owns: finding a family's class by name. The family modules are imported on the first look-up
(all of them, once: a registry name lives in its class), never at `import servelm.models`.
"""

from __future__ import annotations

import importlib
import pkgutil

_registry: dict[str, type] | None = None


def families() -> dict[str, type]:
    """Registry name -> model class, over every module of this package."""
    global _registry
    if _registry is None:
        found: dict[str, type] = {}
        for info in pkgutil.iter_modules(__path__):
            module = importlib.import_module(f"{__name__}.{info.name}")
            for cls in vars(module).values():
                name = vars(cls).get("family") if isinstance(cls, type) else None
                if not name or cls.__module__ != module.__name__:
                    continue  # imported from elsewhere, or inherits its base's name
                if name in found:
                    raise ValueError(f"model family {name!r} is defined twice: "
                                     f"{found[name].__qualname__} and {cls.__qualname__}")
                found[name] = cls
        _registry = found
    return _registry


def get_model_class(architecture: str):
    try:
        return families()[architecture]
    except KeyError:
        # ModelConfig reads MoE/MLA and other families too (the planner and the cost model
        # use their shapes); the engine refuses them here, before any weight is read.
        raise ValueError(f"architecture {architecture!r} is not supported by the engine; "
                         f"supported: {sorted(families())} (`servelm plan` still plans it)"
                         ) from None
