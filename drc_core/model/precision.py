"""The numeric path of a run, resolved per device by :func:`choose`: ``compile="auto"`` compiles each block on CUDA
or a CPU with a C++ compiler; ``autocast="auto"`` takes bf16 on CUDA with bf16 or a CPU with ``amx_bf16`` /
``avx512_bf16``, fp32 elsewhere (default "none": docs/training.md, "Why bf16 is not the default").
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
    """The resolved path: ``autocast`` "none" or "bf16", ``compile`` a bool, ``why`` one line the trainer prints."""

    autocast: str
    compile: bool
    why: str

    def autocast_context(self, device: torch.device):
        """``torch.autocast(device.type, bfloat16)`` for bf16, else a no-op context."""
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast == "bf16")


def _cpuinfo(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


@cache
def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The bf16 matmul flags (``amx_bf16``, ``avx512_bf16``) this CPU reports; () where unknown."""
    flags = {f for line in _cpuinfo(cpuinfo) if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return tuple(f for f in BF16_CPU_FLAGS if f in flags)


def machine_kind(cpuinfo: str = "/proc/cpuinfo") -> dict[str, object]:
    """What a timing was measured on: the CPU's model name, its bf16 matmul flags ("none" without) and core count."""
    names = (ln.split(":", 1)[1].strip() for ln in _cpuinfo(cpuinfo) if ln.startswith("model name"))
    return {"cpu": next(names, "unknown"), "bf16": "+".join(cpu_bf16_flags(cpuinfo)) or "none",
            "cores": os.cpu_count()}


def bf16_support(device: torch.device) -> str | None:
    """Why ``device`` runs bf16 matmuls fast (e.g. "CPU with amx_bf16"), or None when it does not."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return f"CUDA device {torch.cuda.get_device_name(device)} with bf16"
    flags = cpu_bf16_flags() if device.type == "cpu" else ()
    return f"CPU with {'+'.join(flags)}" if flags else None


def choose(autocast: str, compile: str, device: torch.device) -> NumericPath:
    """Resolve ``"auto"`` settings for ``device`` (see the module docstring)."""
    for name, value, allowed in (("autocast", autocast, AUTOCAST_CHOICES), ("compile", compile, COMPILE_CHOICES)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported: use one of {', '.join(allowed)}")
    reasons = [f"autocast={autocast} as set"]
    if autocast == "auto":
        fast = bf16_support(device)
        autocast = "bf16" if fast else "none"
        reasons = [f"bf16 autocast ({fast})" if fast else "fp32 (no fast bf16 on this device)"]
    if compile == "auto":
        compiled = device.type == "cuda" or (device.type == "cpu" and bool(shutil.which("g++") or shutil.which("c++")))
        reasons.append("compiled blocks" if compiled else "eager (no C++ compiler for torch.compile: install g++)")
    else:
        compiled = compile == "true"
        reasons.append(f"compile={compile} as set")
    what = ("bf16" if autocast == "bf16" else "fp32") + (" + compile" if compiled else " eager")
    return NumericPath(autocast, compiled, f"numeric path: {what}: " + ", ".join(reasons)
                       + " (force the plain path with --set autocast=none --set compile=false)")
