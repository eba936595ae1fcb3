"""A checkpoint's training state as JSON (``train_state.json``) + safetensors (``train_state.safetensors``), never a
pickle; :func:`read_state` checks every part against the optimizer and scheduler it is loaded into (one
:class:`~drc_core.errors.DrcError` line), and reads an older ``train_state.pt`` with ``weights_only=True``.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from drc_core.errors import DrcError, first_line
from drc_core.guard import parse_json, read_regular, write_file

__all__ = ["LEGACY_STATE", "RESUME_FIX", "STATE_JSON", "STATE_TENSORS", "TrainState", "apply_state", "read_state",
           "write_state"]

STATE_JSON = "train_state.json"
STATE_TENSORS = "train_state.safetensors"
LEGACY_STATE = "train_state.pt"  # written before the format above; read with weights_only=True
STATE_FORMAT = 1
RESUME_FIX = "delete that checkpoint directory to resume from the one before it"  # what every refused state says
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's per-parameter tensors, each the parameter's shape
_TENSOR_KEY = re.compile(r"^optimizer\.(\d+)\.(\w+)$|^rng\.torch$|^rng\.cuda\.(\d+)$")


@dataclass
class TrainState:
    """A checkpoint's training state, checked (see :func:`read_state`)."""

    step: int
    optimizer: dict[str, Any]  # torch's Optimizer.state_dict() form
    scheduler: dict[str, Any]
    sampler: dict[str, Any]
    rng_torch: torch.Tensor
    rng_cuda: list[torch.Tensor] | None
    train_config: dict[str, Any]


class _Damaged(Exception):
    """Why a training state is refused (the DrcError of :func:`read_state` says it)."""


def write_state(directory: Path, opt: torch.optim.Optimizer, sched: Any, sampler_state: dict, train_config: dict,
                step: int) -> None:
    """Write the training state into ``directory`` (a fresh checkpoint directory)."""
    full = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    for i, t in enumerate(cuda or []):
        tensors[f"rng.cuda.{i}"] = t
    plain: dict[str, dict[str, Any]] = {}
    for idx, per_param in full["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                plain.setdefault(str(idx), {})[key] = value
    record = {"format": STATE_FORMAT, "step": step, "scheduler": sched.state_dict(), "sampler": sampler_state,
              "optimizer": {"param_groups": full["param_groups"], "state": plain},
              "cuda_devices": None if cuda is None else len(cuda), "train_config": train_config}
    save_file(tensors, str(directory / STATE_TENSORS))
    write_file(directory / STATE_JSON, json.dumps(record, allow_nan=False) + "\n")


def read_state(ckpt: Path, opt: torch.optim.Optimizer, sched: Any) -> TrainState:
    """The training state of ``ckpt``, checked against a fresh ``opt`` and ``sched`` (else a one-line DrcError)."""
    name = STATE_JSON if (ckpt / STATE_JSON).exists() or not (ckpt / LEGACY_STATE).exists() else LEGACY_STATE
    try:
        state = _read_legacy(ckpt / LEGACY_STATE) if name == LEGACY_STATE else _read_new(ckpt, opt)
        _check(state, opt, sched)
    except _Damaged as exc:
        raise DrcError(f"cannot resume from {ckpt}: its training state ({name}) is damaged ({exc}); {RESUME_FIX}"
                       ) from None
    return state


def apply_state(state: TrainState, opt: torch.optim.Optimizer, sched: Any, sampler: Any) -> None:
    """Load a checked state into the optimizer, scheduler, sampler and the RNGs."""
    opt.load_state_dict(state.optimizer)
    sched.load_state_dict(state.scheduler)
    sampler.load_state_dict(state.sampler)
    torch.set_rng_state(state.rng_torch)
    if state.rng_cuda is not None and torch.cuda.is_available():
        for i, t in enumerate(state.rng_cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(t, i)


def _read_new(ckpt: Path, opt: torch.optim.Optimizer) -> TrainState:
    try:
        record = parse_json(read_regular(ckpt / STATE_JSON, STATE_JSON))
    except FileNotFoundError:
        raise _Damaged(f"{STATE_JSON} is missing") from None
    except (OSError, ValueError) as exc:  # not JSON, not UTF-8, too deep, too large, not a file (a DrcError)
        raise _Damaged(first_line(exc, 120)) from None
    if not isinstance(record, dict):
        raise _Damaged(f"{STATE_JSON} is not a JSON object")
    keys = {"format", "step", "scheduler", "sampler", "optimizer", "cuda_devices", "train_config"}
    if set(record) != keys:
        raise _Damaged(f"{STATE_JSON} has keys {sorted(record)}, not {sorted(keys)}")
    if record["format"] != STATE_FORMAT:
        raise _Damaged(f"format {record['format']!r} is not {STATE_FORMAT}")
    optimizer = record["optimizer"]
    if not isinstance(optimizer, dict) or set(optimizer) != {"param_groups", "state"} or not isinstance(
            optimizer["state"], dict):
        raise _Damaged("its optimizer record is not {param_groups, state}")
    devices = record["cuda_devices"]
    if devices is not None and (not _is_int(devices) or not 0 <= devices <= 1024):
        raise _Damaged(f"cuda_devices={devices!r} is not a device count")
    tensors = _read_tensors(ckpt / STATE_TENSORS, opt)
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        m = _TENSOR_KEY.match(key)
        if m and m.group(1) is not None:
            state.setdefault(int(m.group(1)), {})[m.group(2)] = t
    for idx, plain in optimizer["state"].items():
        if not (isinstance(idx, str) and idx.isdigit() and isinstance(plain, dict)):
            raise _Damaged(f"optimizer state entry {idx!r} is not a parameter's")
        for key, value in plain.items():
            if key in state.get(int(idx), {}):
                raise _Damaged(f"optimizer.{idx}.{key} is given twice")
            state.setdefault(int(idx), {})[key] = value
    if "rng.torch" not in tensors:
        raise _Damaged(f"{STATE_TENSORS} lacks rng.torch")
    cuda = [tensors.get(f"rng.cuda.{i}") for i in range(devices or 0)]
    if any(t is None for t in cuda) or sum(k.startswith("rng.cuda.") for k in tensors) != len(cuda):
        raise _Damaged(f"{STATE_TENSORS} does not hold the {devices or 0} CUDA RNG states it records")
    return TrainState(step=record["step"], optimizer={"state": state, "param_groups": optimizer["param_groups"]},
                      scheduler=record["scheduler"], sampler=record["sampler"], rng_torch=tensors["rng.torch"],
                      rng_cuda=None if devices is None else cuda, train_config=record["train_config"])


def _read_tensors(path: Path, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The tensors of ``train_state.safetensors``, each checked from the header alone against this optimizer."""
    shapes = _param_shapes(opt)
    rng_size = torch.get_rng_state().numel()
    if path.exists() and not path.is_file():  # a FIFO would block the reader, a device never end
        raise _Damaged(f"{STATE_TENSORS} is not a regular file")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    except FileNotFoundError:
        raise _Damaged(f"{STATE_TENSORS} is missing") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _Damaged(f"{STATE_TENSORS} is not a readable safetensors file: {first_line(exc, 80)}") from None
    for key, (shape, dtype) in header.items():
        m = _TENSOR_KEY.match(key)
        if m is None:
            raise _Damaged(f"{STATE_TENSORS} holds an unexpected tensor {key}")
        if key.startswith("rng."):
            limit = (rng_size, rng_size) if key == "rng.torch" else (1, 1 << 20)
            ok = dtype == "U8" and len(shape) == 1 and limit[0] <= shape[0] <= limit[1]
        else:
            idx, name = int(m.group(1)), m.group(2)
            if idx not in shapes:
                raise _Damaged(f"{key}: the optimizer has no parameter {idx}")
            want = () if name == "step" else shapes[idx] if name in _MOMENTS else None
            ok = want is not None and shape == want and dtype in ("F32", "F64", "F16", "BF16")
        if not ok:
            raise _Damaged(f"tensor {key} has shape {list(shape)} and dtype {dtype}, which this run cannot hold")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _Damaged(f"{STATE_TENSORS} is not readable: {first_line(exc, 80)}") from None


def _read_legacy(path: Path) -> TrainState:
    """A ``train_state.pt`` of the format before this one, read with ``weights_only=True``."""
    if not path.is_file():  # a FIFO or a device would hang or never end
        raise _Damaged(f"{LEGACY_STATE} is not a regular file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise DrcError(f"cannot resume from {path.parent}: its {LEGACY_STATE} asks to run code or build objects "
                       f"that a training state does not hold ({first_line(exc, 100)}), so it was not loaded; "
                       f"{RESUME_FIX}") from None
    except (OSError, RuntimeError, EOFError, ValueError, TypeError, KeyError, AttributeError, IndexError,
            MemoryError) as exc:
        raise _Damaged(f"{LEGACY_STATE} is not readable: {first_line(exc, 80)}") from None
    keys = {"step", "optimizer", "scheduler", "rng", "sampler", "train_config"}
    if not isinstance(state, dict) or set(state) != keys:
        raise _Damaged(f"{LEGACY_STATE} is not a training state (keys {sorted(keys)})")
    rng, optimizer = state["rng"], state["optimizer"]
    if not isinstance(rng, dict) or set(rng) != {"torch", "cuda"}:
        raise _Damaged("its rng entry is not {torch, cuda}")
    if not isinstance(optimizer, dict) or set(optimizer) != {"state", "param_groups"} or not isinstance(
            optimizer["state"], dict):
        raise _Damaged("its optimizer entry is not {state, param_groups}")
    cuda = rng["cuda"]
    if cuda is not None and not (isinstance(cuda, list | tuple) and all(isinstance(t, torch.Tensor) for t in cuda)):
        raise _Damaged("its CUDA RNG states are not tensors")
    if not isinstance(rng["torch"], torch.Tensor):
        raise _Damaged("its RNG state is not a tensor")
    return TrainState(step=state["step"], optimizer=optimizer, scheduler=state["scheduler"], sampler=state["sampler"],
                      rng_torch=rng["torch"], rng_cuda=None if cuda is None else list(cuda),
                      train_config=state["train_config"])


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _param_shapes(opt: torch.optim.Optimizer) -> dict[int, tuple[int, ...]]:
    return {i: tuple(p.shape) for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}


def _like(value: Any, fresh: Any, where: str) -> Any:
    """``value`` with the structure of ``fresh`` (keys, lengths, scalar types; a list for a tuple), else
    :class:`_Damaged`."""
    if isinstance(fresh, bool) or fresh is None:
        if value is not fresh and not (isinstance(fresh, bool) and isinstance(value, bool)):
            raise _Damaged(f"{where}={value!r} is not {'a bool' if fresh is not None else 'null'}")
        return value
    if isinstance(fresh, int | float) and not isinstance(value, bool) and isinstance(value, int | float):
        if isinstance(fresh, int) and not isinstance(value, int):
            raise _Damaged(f"{where}={value!r} is not an integer")
        if not math.isfinite(value):
            raise _Damaged(f"{where}={value!r} is not finite")
        return value if isinstance(fresh, int) else float(value)
    if isinstance(fresh, str) and isinstance(value, str):
        return value
    if isinstance(fresh, list | tuple) and isinstance(value, list | tuple):
        if len(value) != len(fresh):
            raise _Damaged(f"{where} has {len(value)} entries, not {len(fresh)}")
        return type(fresh)(_like(v, f, f"{where}[{i}]") for i, (v, f) in enumerate(zip(value, fresh, strict=True)))
    if isinstance(fresh, dict) and isinstance(value, dict):
        if extra := sorted(map(str, set(value) - set(fresh))):
            raise _Damaged(f"{where} has unknown key {extra[0]!r}")
        return {k: _like(value[k], f, f"{where}.{k}") for k, f in fresh.items() if k in value}
    raise _Damaged(f"{where} is {type(value).__name__}, not {type(fresh).__name__}")


def _check(state: TrainState, opt: torch.optim.Optimizer, sched: Any) -> None:
    """Every part of ``state`` against a fresh optimizer and scheduler; normalises it in place."""
    if not _is_int(state.step) or state.step < 0:
        raise _Damaged(f"step={state.step!r} is not a step count")
    if not isinstance(state.train_config, dict):
        raise _Damaged("its train_config is not an object")
    fresh_sched = sched.state_dict()
    if not isinstance(state.scheduler, dict) or "lr_lambdas" not in state.scheduler:
        raise _Damaged("its scheduler state is not the scheduler's")
    state.scheduler = _like(state.scheduler, fresh_sched, "scheduler")
    if state.scheduler.get("last_epoch") != state.step:
        raise _Damaged(f"the scheduler is at step {state.scheduler.get('last_epoch')!r}, the checkpoint at "
                       f"{state.step}")
    sampler = state.sampler
    if not (isinstance(sampler, dict) and set(sampler) == {"step", "seed"} and _is_int(sampler["step"])
            and _is_int(sampler["seed"]) and sampler["step"] == state.step):
        raise _Damaged("its sampler state is not {step, seed} at the checkpoint's step")
    fresh_opt = opt.state_dict()
    groups = state.optimizer["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(fresh_opt["param_groups"]):
        raise _Damaged("its optimizer has other parameter groups than this model's")
    checked = []
    for i, (group, fresh) in enumerate(zip(groups, fresh_opt["param_groups"], strict=True)):
        if not isinstance(group, dict) or group.get("params") != fresh["params"]:
            raise _Damaged(f"optimizer group {i} holds other parameters than this model's")
        checked.append(_like(group, fresh, f"optimizer group {i}"))
        for k in ("weight_decay", "betas", "eps"):  # the config's (which the resume checked), not the file's
            if k in checked[-1] and checked[-1][k] != fresh.get(k):
                raise _Damaged(f"optimizer group {i}.{k}={checked[-1][k]!r} is not the config's {fresh.get(k)!r}")
    state.optimizer["param_groups"] = checked
    shapes = _param_shapes(opt)
    per_param = state.optimizer["state"]
    for idx, entries in per_param.items():
        if not _is_int(idx) or idx not in shapes or not isinstance(entries, dict):
            raise _Damaged(f"optimizer state for parameter {idx!r}, which the model does not have")
        for key, value in entries.items():
            want = () if key == "step" else shapes[idx] if key in _MOMENTS else None
            if want is None:
                raise _Damaged(f"optimizer state {key!r} of parameter {idx} is not AdamW's")
            if not (isinstance(value, torch.Tensor) and value.is_floating_point() and tuple(value.shape) == want):
                raise _Damaged(f"optimizer state {key} of parameter {idx} is not a float tensor of shape {list(want)}")
        if not {"step", "exp_avg", "exp_avg_sq"} <= set(entries):
            raise _Damaged(f"optimizer state of parameter {idx} lacks step, exp_avg or exp_avg_sq")
    rng = state.rng_torch
    if rng.dtype != torch.uint8 or tuple(rng.shape) != tuple(torch.get_rng_state().shape):
        raise _Damaged("its RNG state is not a generator state of this torch")
    for t in state.rng_cuda or []:
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise _Damaged("a CUDA RNG state is not a generator state")
