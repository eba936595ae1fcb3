"""Which numeric path a run takes: the precision (``autocast``) and whether the blocks are compiled (``compile``).

``TrainConfig.autocast`` is ``"none" | "bf16" | "auto"`` and ``TrainConfig.compile`` is ``"auto" | "true" |
"false"``. :func:`choose` resolves the ``"auto"`` values for a device:

* ``compile="auto"`` (the default): compiled blocks (``torch.compile``, one graph per block, none per loop count)
  on a CUDA device, or on a CPU where a C++ compiler exists for inductor; eager otherwise. Compiling keeps the
  precision: it only fuses.
* ``autocast="auto"``: bf16 autocast on a CUDA device that supports bf16 (``torch.cuda.is_bf16_supported()``) or a
  CPU whose flags include ``amx_bf16`` or ``avx512_bf16`` (Linux ``/proc/cpuinfo``); fp32 elsewhere (bf16 there is
  emulated and slower). It is opt-in: the default is ``"none"`` (fp32), because the loss-parity runs (docs/training.md,
  "Why bf16 is not the default") found bf16 training worse at one loop by 0.02 nats, outside the fp32 seeds' spread.

An explicit ``"bf16"`` / ``"true"`` is always honoured. The returned :class:`NumericPath` carries one line saying
what was chosen and why, which the trainer prints.
"""

from __future__ import annotations

import os
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


def machine_kind(cpuinfo: str = "/proc/cpuinfo") -> dict[str, object]:
    """What a timing was measured on: the CPU's model name, its bf16 matmul flags ("none" without) and its core
    count, for stating the kind beside a timing (Intel with AMX-bf16 and AMD EPYC without differ by 2x)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    return {"cpu": name, "bf16": "+".join(cpu_bf16_flags(cpuinfo)) or "none", "cores": os.cpu_count()}


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
        compiled = bool(device.type == "cuda" or (device.type == "cpu" and (shutil.which("g++") or
                                                                             shutil.which("c++"))))
        reasons.append("compiled blocks" if compiled else "eager (no C++ compiler for torch.compile: install g++)")
    else:
        compiled = compile == "true"
        reasons.append(f"compile={compile} as set")
    what = ("bf16" if autocast == "bf16" else "fp32") + (" + compile" if compiled else " eager")
    why = f"numeric path: {what}: " + ", ".join(reasons) + \
        " (force the plain path with --set autocast=none --set compile=false)"
    return NumericPath(autocast=autocast, compile=compiled, why=why)
