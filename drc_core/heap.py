"""How glibc hands out and takes back the large temporaries of a pass, for the whole process: one policy at a time.

A pass over L loops allocates and frees vocabulary-sized temporaries (tokens x vocabulary floats) at every loop.
With glibc's defaults the threshold above which an allocation is a fresh ``mmap`` grows each time such a buffer is
freed, after which the temporaries come from the heap, interleaved with the small per-loop results that stay
alive: the heap cannot shrink, and a 256-token trace at 1,024 loops on the reference model peaked at 9.8 GB. Two
policies, each a ``mallopt`` call, for the whole process from the call on:

- :func:`bound_freed_memory` (what :func:`drc_core.trace` applies unless the process chose otherwise): the
  threshold fixed at ``threshold`` bytes, so every large temporary is mapped and returned when freed; memory stays
  proportional to loops x tokens (the same trace: 0.65 GB, and no slower);
- :func:`keep_freed_memory`: buffers up to ``max_bytes`` from the heap, kept for reuse; no page faults on fresh
  buffers, what timing wants (the book's notebooks call it), at the cost of a resident size that stays at its peak.

Both return False and change nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["KEEP_FREED_BYTES", "bound_freed_memory", "heap_policy", "keep_freed_memory"]

KEEP_FREED_BYTES = 256 << 20  # keep_freed_memory: buffers up to this size come from (and go back to) the heap
BOUND_THRESHOLD = 1 << 20  # bound_freed_memory: larger buffers are always mapped, and unmapped when freed
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
_policy: str | None = None  # the policy this process chose through this module, None: glibc's own


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return None
    return libc


def heap_policy() -> str | None:
    """``"keep"`` or ``"bound"`` once a policy was set through this module, else None (glibc's defaults)."""
    return _policy


def keep_freed_memory(max_bytes: int = KEEP_FREED_BYTES) -> bool:
    """Make glibc keep freed memory for reuse: buffers up to ``max_bytes`` come from the heap (``M_MMAP_THRESHOLD``)
    and the heap's free top is returned to the system only beyond twice that (``M_TRIM_THRESHOLD``)."""
    global _policy
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, max_bytes)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * max_bytes))
    _policy = "keep" if ok else _policy
    return ok


def bound_freed_memory(threshold: int = BOUND_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (which also stops it from growing): larger buffers are
    always mapped, and returned to the system when freed."""
    global _policy
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    _policy = "bound" if ok else _policy
    return ok
