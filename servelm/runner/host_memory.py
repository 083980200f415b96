"""Host allocator settings for the CPU path.

A decode step allocates and frees tens of MB of temporaries per layer (gathered K/V,
activations). glibc serves blocks that large with fresh mmap()s and returns freed heap
tops to the kernel, so every step page-faults its memory in again, zero-filled: on the
2-core machine most of a step went to the kernel (100% system time). Raising glibc's mmap
and trim thresholds keeps that memory in the process for reuse, which is what the tcmalloc
preload in vLLM's CPU guide achieves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
    """Ask glibc to serve allocations below `threshold_bytes` from its heap and not give
    freed memory back. False where libc is not glibc (nothing changed)."""
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes) == 1
    logger.debug("glibc mallopt thresholds set: %s", ok)
    return bool(ok)
