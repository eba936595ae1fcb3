"""Training configuration (:class:`TrainConfig`, nesting the model's and the recurrence's), the named presets, and
``--set key=value`` overrides with dotted keys (``model.d_model=256``, ``recurrence.mean=4``, ``lr=1e-3``)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any

from drc_core.errors import (
    MAX_BATCH_TOKENS,
    MAX_LOOPS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_SIGMA,
    DrcError,
    check_fields,
    need_float,
    need_int,
    need_loops,
)
from drc_core.model.config import ModelConfig
from drc_core.model.precision import AUTOCAST_CHOICES, COMPILE_CHOICES
from drc_core.model.recurrence import RecurrenceConfig


@dataclass
class TrainConfig:
    model: ModelConfig
    recurrence: RecurrenceConfig = field(default_factory=RecurrenceConfig)
    seq_len: int = 256
    batch_size: int = 32  # global: split across data-parallel ranks
    max_steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_windows: int = 64
    eval_loops: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    ckpt_every: int = 200
    keep_last: int = 2
    log_every: int = 10
    seed: int = 0
    compile: str = "auto"  # "auto" | "true" | "false" (drc_core.model.precision.choose resolves "auto")
    # "none" | "bf16" | "auto" (bf16 where fast); fp32 by default: see docs/training.md "Numeric path"
    autocast: str = "none"
    answer_weight: float = 1.0  # loss weight of the depth-task answer tokens (the corpus's labels.parquet); 1: plain LM

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "max_steps", "eval_every", "eval_windows", "ckpt_every",
                     "keep_last", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DrcError(f"{name}={v!r} must be a positive integer")
        for name in ("warmup_steps", "seed"):
            need_int(name, getattr(self, name), 0)
        if self.seed > MAX_SEED:
            raise DrcError(f"seed={self.seed} is above the largest seed {MAX_SEED} (2**63 - 1): pass a smaller seed")
        # every number finite and in range before any work starts (AdamW and torch would fail deep inside)
        for name in ("lr", "grad_clip", "answer_weight"):
            need_float(name, getattr(self, name), 0.0, lo_open=True)
        need_float("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        need_float("weight_decay", self.weight_decay, 0.0)
        for name in ("beta1", "beta2"):  # AdamW: 0 <= beta < 1
            need_float(name, getattr(self, name), 0.0, 1.0, hi_open=True)
        if not self.eval_loops:
            raise DrcError(f"eval_loops={self.eval_loops!r} must be a non-empty list of loop counts >= 1")
        for n in self.eval_loops:
            need_loops("eval_loops", n)
        rec = self.recurrence
        if rec.max_loops is not None:
            need_loops("recurrence.max_loops", rec.max_loops)
        need_float("recurrence.mean", rec.mean, 1.0, MAX_LOOPS)
        if rec.scheme == "uniform":
            need_loops("recurrence.high", rec.high)
        need_float("recurrence.sigma", rec.sigma, 0.0, MAX_SIGMA)
        if isinstance(self.compile, bool):  # configs written before "auto" existed stored a bool
            self.compile = "true" if self.compile else "false"
        for name, allowed in (("autocast", AUTOCAST_CHOICES), ("compile", COMPILE_CHOICES)):
            if (value := getattr(self, name)) not in allowed:
                raise DrcError(f"{name}={value!r} is not supported: use one of {', '.join(allowed)}")
        need_int("seq_len", self.seq_len, 1, maximum=MAX_SEQ_LEN)
        need_int("eval_windows", self.eval_windows, 1, maximum=MAX_BATCH_TOKENS)
        if self.batch_size * self.seq_len > MAX_BATCH_TOKENS:
            raise DrcError(f"batch_size * seq_len = {self.batch_size} * {self.seq_len} is above the limit of "
                           f"{MAX_BATCH_TOKENS:,} tokens a step (drc_core.errors.MAX_BATCH_TOKENS): lower batch_size "
                           "or seq_len")
        if self.seq_len > self.model.max_seq_len:
            raise DrcError(f"seq_len={self.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}: "
                           "lower seq_len or raise model.max_seq_len")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "training config") -> TrainConfig:
        """A config from its stored dict: every field present, none unknown, at every level."""
        d = check_fields(cls, d, where)
        model = ModelConfig.from_dict(d.pop("model"), f"{where} (model)")
        rec = RecurrenceConfig(**check_fields(RecurrenceConfig, d.pop("recurrence"), f"{where} (recurrence)"))
        if not isinstance(d["eval_loops"], list | tuple):
            raise DrcError(f"{where}: eval_loops={d['eval_loops']!r} is not a list of loop counts: restore the file")
        return cls(model=model, recurrence=rec, **{**d, "eval_loops": tuple(d["eval_loops"])})


PRESETS: dict[str, typing.Callable[[], TrainConfig]] = {
    # seconds on a CPU, for tests and the smoke run (eager: compiling takes longer than the run)
    "tiny": lambda: TrainConfig(
        model=ModelConfig(vocab_size=512, d_model=32, n_heads=2, n_prelude=1, n_core=1, n_coda=1,
                          max_seq_len=64),
        recurrence=RecurrenceConfig(mean=4.0, backprop_loops=2, max_loops=16),
        seq_len=32, batch_size=8, max_steps=30, lr=3e-3, warmup_steps=5, eval_every=15, eval_windows=8,
        eval_loops=(1, 2, 4, 8), ckpt_every=10, log_every=5, compile="false",
    ),
    # minutes on 2 CPU cores (2.5 M tokens): seed replicates and the training-mean depth experiment
    "small": lambda: TrainConfig(
        model=ModelConfig(vocab_size=4096, d_model=64, n_heads=2, n_prelude=1, n_core=2, n_coda=1,
                          max_seq_len=256),
        recurrence=RecurrenceConfig(mean=8.0, backprop_loops=4, max_loops=32),
        seq_len=128, batch_size=16, max_steps=1200, lr=4e-3, warmup_steps=60, eval_every=300,
        eval_windows=64, ckpt_every=300,
    ),
    # the reference model: 4.34 M parameters, 20.5 M tokens, ~1 hour on 2 CPU cores (scripts/depth_scale.py)
    "cpu": lambda: TrainConfig(
        model=ModelConfig(vocab_size=4096, d_model=256, n_heads=4, n_prelude=1, n_core=2, n_coda=1,
                          max_seq_len=256),
        recurrence=RecurrenceConfig(mean=8.0, backprop_loops=4, max_loops=32),
        seq_len=256, batch_size=16, max_steps=5000, lr=2e-3, warmup_steps=100, eval_every=500,
        eval_windows=64, ckpt_every=250, autocast="auto", compile="auto",
    ),
    # ~124 M parameters for a GPU and FineWeb-Edu (--vocab-size 49152), 4.2 B tokens (docs/gpu.md)
    "paper-135m": lambda: TrainConfig(
        model=ModelConfig(vocab_size=49152, d_model=768, n_heads=12, n_prelude=2, n_core=4, n_coda=2,
                          mlp_hidden=3584, max_seq_len=1024),
        recurrence=RecurrenceConfig(mean=8.0, backprop_loops=8, max_loops=32),
        seq_len=1024, batch_size=256, max_steps=16_000, lr=1e-3, warmup_steps=500, eval_every=500,
        eval_windows=256, ckpt_every=500, keep_last=3, autocast="bf16",
    ),
}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise DrcError(f"unknown preset '{name}': choose from {', '.join(PRESETS)}")
    return PRESETS[name]()


def _coerce(raw: str, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if raw.lower() in ("none", "null"):
            return None
        return _coerce(raw, next(a for a in typing.get_args(hint) if a is not type(None)), key)
    if origin is tuple:
        inner = typing.get_args(hint)[0]
        return tuple(_coerce(p, inner, key) for p in raw.strip("()[] ").split(",") if p.strip())
    try:
        if hint is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
    except ValueError:
        raise DrcError(f"--set {key}={raw}: expected a value of type {hint.__name__}") from None
    return raw


def apply_overrides(cfg: TrainConfig, pairs: list[str]) -> TrainConfig:
    """Return a new config with ``key=value`` overrides applied (validated by the dataclasses)."""
    d = cfg.to_dict()
    for pair in pairs:
        if "=" not in pair:
            raise DrcError(f"--set '{pair}' is not key=value: e.g. --set model.d_model=256")
        key, raw = pair.split("=", 1)
        parts = key.strip().split(".")
        target_cls: type = TrainConfig
        node = d
        for i, part in enumerate(parts):
            hints = typing.get_type_hints(target_cls)
            names = [f.name for f in dataclasses.fields(target_cls)]
            if part not in names:
                prefix = ".".join(parts[:i])
                valid = ", ".join(f"{prefix + '.' if prefix else ''}{n}" for n in names)
                raise DrcError(f"unknown config key '{key}': valid keys here are {valid}")
            if i == len(parts) - 1:
                if dataclasses.is_dataclass(hints[part]):
                    inner = [f.name for f in dataclasses.fields(hints[part])]
                    raise DrcError(f"'{key}' is a section: set one of its fields, e.g. {key}.{inner[0]}=... "
                                   f"(fields: {', '.join(inner)})")
                node[part] = _coerce(raw.strip(), hints[part], key)
            else:
                if not dataclasses.is_dataclass(hints[part]):
                    raise DrcError(f"'{'.'.join(parts[: i + 1])}' has no sub-keys: use --set {part}=VALUE")
                target_cls, node = hints[part], node[part]
    try:
        return TrainConfig.from_dict(d)
    except ValueError as exc:
        raise DrcError(str(exc)) from None


def config_diff(a: TrainConfig, b: TrainConfig) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    def flat(d: dict, prefix: str = "") -> dict[str, str]:
        out: dict[str, str] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": json.dumps(v)})
        return out

    fa, fb = flat(a.to_dict()), flat(b.to_dict())
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))
