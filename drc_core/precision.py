"""Which numeric path a run takes: bf16 autocast and compiled blocks where the hardware does bf16 well.

``TrainConfig.autocast`` is ``"auto" | "none" | "bf16"`` and ``TrainConfig.compile`` is
``"auto" | "true" | "false"``. :func:`choose` resolves the two ``"auto"`` values for a device:

* a CUDA device that supports bf16 (``torch.cuda.is_bf16_supported()``), or a CPU whose flags include
  ``amx_bf16`` or ``avx512_bf16`` (Linux ``/proc/cpuinfo``): bf16 autocast and compiled blocks;
* anything else: fp32 and eager (bf16 there is emulated and slower than fp32).

Compiling needs a C++ compiler on a CPU (inductor's code generation); without one, ``"auto"`` stays eager and
says so. An explicit ``"bf16"`` / ``"true"`` is always honoured. The returned :class:`NumericPath` carries one line
saying what was chosen and why, which the trainer prints.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

AUTOCAST_CHOICES = ("auto", "none", "bf16")
COMPILE_CHOICES = ("auto", "true", "false")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class NumericPath:
    """The resolved numeric path: ``autocast`` is "none" or "bf16", ``compile`` a bool, ``why`` one line."""

    autocast: str
    compile: bool
    why: str

    def autocast_context(self, device: torch.device):
        """``torch.autocast(device.type, bfloat16)`` for bf16, else a no-op context."""
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast == "bf16")


@cache
def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The bf16 matmul flags (``amx_bf16``, ``avx512_bf16``) this CPU reports; () where unknown."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return ()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return tuple(f for f in BF16_CPU_FLAGS if f in flags)


def bf16_support(device: torch.device) -> str | None:
    """Why ``device`` runs bf16 matmuls fast (e.g. "CPU with amx_bf16"), or None when it does not."""
    if device.type == "cuda":
        return f"CUDA device {torch.cuda.get_device_name(device)} with bf16" if torch.cuda.is_bf16_supported() \
            else None
    if device.type == "cpu":
        flags = cpu_bf16_flags()
        return f"CPU with {'+'.join(flags)}" if flags else None
    return None


def choose(autocast: str, compile: str, device: torch.device) -> NumericPath:
    """Resolve ``"auto"`` settings for ``device`` (see the module docstring)."""
    if autocast not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast={autocast!r} is not supported: use one of {', '.join(AUTOCAST_CHOICES)}")
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"compile={compile!r} is not supported: use one of {', '.join(COMPILE_CHOICES)}")
    fast = bf16_support(device)
    reasons = []
    if autocast == "auto":
        autocast = "bf16" if fast else "none"
        reasons.append(f"bf16 autocast ({fast})" if fast else "fp32 (no fast bf16 on this device)")
    else:
        reasons.append(f"autocast={autocast} as set")
    if compile == "auto":
        compiler = device.type != "cpu" or shutil.which("g++") or shutil.which("c++")
        compiled = bool(fast and compiler)
        if compiled:
            reasons.append("compiled blocks")
        elif fast:
            reasons.append("eager (no C++ compiler for torch.compile: install g++)")
        else:
            reasons.append("eager")
    else:
        compiled = compile == "true"
        reasons.append(f"compile={compile} as set")
    what = ("bf16" if autocast == "bf16" else "fp32") + (" + compile" if compiled else " eager")
    why = f"numeric path: {what}: " + ", ".join(reasons) + \
        " (force the plain path with --set autocast=none --set compile=false)"
    return NumericPath(autocast=autocast, compile=compiled, why=why)
