"""How glibc hands out and takes back a pass's large temporaries, for the whole process (``mallopt``).

Under glibc's defaults the mmap threshold grows as a pass frees vocabulary-sized temporaries, which then come from a
heap that cannot shrink (a 256-token trace at 1,024 loops peaked at 9.8 GB). :func:`bound_freed_memory` (what
:func:`drc_core.trace` applies unless the process chose otherwise) maps buffers above ``threshold`` and returns them
when freed (0.65 GB); :func:`keep_freed_memory` keeps buffers up to ``max_bytes`` on the heap for reuse (no page
faults, what timing wants; resident size stays at its peak). Both return False and change nothing outside glibc.
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


def _mallopt(policy: str, *settings: tuple[int, int]) -> bool:
    """Apply ``(param, value)`` settings with glibc's ``mallopt``; on success the process's policy is ``policy``."""
    global _policy
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    ok = all(bool(libc.mallopt(param, value)) for param, value in settings)
    _policy = policy if ok else _policy
    return ok


def heap_policy() -> str | None:
    """``"keep"`` or ``"bound"`` once a policy was set through this module, else None (glibc's defaults)."""
    return _policy


def keep_freed_memory(max_bytes: int = KEEP_FREED_BYTES) -> bool:
    """Buffers up to ``max_bytes`` from the heap, its free top returned to the system only beyond twice that."""
    return _mallopt("keep", (_M_MMAP_THRESHOLD, max_bytes), (_M_TRIM_THRESHOLD, 2 * max_bytes))


def bound_freed_memory(threshold: int = BOUND_THRESHOLD) -> bool:
    """glibc's mmap threshold fixed at ``threshold`` bytes: larger buffers are always mapped, returned when freed."""
    return _mallopt("bound", (_M_MMAP_THRESHOLD, threshold))
