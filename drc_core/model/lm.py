"""A depth-recurrent transformer language model: ``e = prelude(embed(idx))``, ``s_l = core(inject(s_{l-1}, e))`` for
l = 1..r from a random (or zero) s_0, ``out = head(norm(coda(s_r)))``; ``inject`` is ``adapter(cat([s, e]))``
("concat") or ``s + e`` ("add").
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from drc_core.errors import DrcError, need_int, need_loops
from drc_core.model.blocks import Block, BlockStack, FrozenKV, RMSNorm, rope_tables
from drc_core.model.checks import check_initial_state
from drc_core.model.config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
READOUTS = ("logits", "log_probs", None)
# Config fields that may differ between a checkpoint and the model loading it: they change no weights.
_LOAD_COMPATIBLE_FIELDS = frozenset({"dropout", "max_seq_len"})


@dataclass
class LoopOutput:
    """What :func:`iterate` yields after loop ``loop``: the state, its readout (or None), the tokens halted so far
    and their exit loop (0 while active)."""

    loop: int
    state: Tensor
    out: Tensor | None
    halted: Tensor
    exit_loop: Tensor


HaltFn = Callable[[LoopOutput], Tensor | None]


@runtime_checkable
class RecurrentModel(Protocol):
    """What the analysis, halting and sweep code needs from a depth-recurrent ``nn.Module`` (bring your own); for
    per-token halting every attention layer j passes its keys/values through ``frozen_kv.hook(j, frozen)``."""

    vocab_size: int
    max_seq_len: int
    training: bool

    def eval(self) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def embed(self, idx: Tensor) -> Tensor: ...

    def initial_state(self, e: Tensor, generator: torch.Generator | None = None) -> Tensor: ...

    def core_step(self, s: Tensor, e: Tensor, *, frozen_kv: FrozenKV | None = None,
                  frozen: Tensor | None = None) -> Tensor: ...

    def readout(self, state: Tensor, positions: slice | Tensor | None = None, *, frozen_kv: FrozenKV | None = None,
                frozen: Tensor | None = None) -> Tensor: ...


class DepthRecurrentLM(BlockStack):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size, self.max_seq_len = cfg.vocab_size, cfg.max_seq_len
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.prelude = nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude))
        self.adapter = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False) if cfg.injection == "concat" else None
        self.core = nn.ModuleList(Block(cfg) for _ in range(cfg.n_core))  # one set, reused at every loop
        self.coda = nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # N(0, 0.02); output projections N(0, 0.02/sqrt(2L)), L = P + R + C blocks on one pass (the concat adapter
        # re-projects the state every loop, so the residual sum does not grow with the loops)
        out_std = 0.02 / math.sqrt(2 * (cfg.n_prelude + cfg.n_core + cfg.n_coda))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                small = name.endswith(".attn.proj") or name.endswith(".mlp.down")
                nn.init.normal_(module.weight, mean=0.0, std=out_std if small else 0.02)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def token_embedding(self, idx: Tensor) -> Tensor:
        """Token ids (any shape) -> their embeddings (..., d), before the prelude (with dropout)."""
        return self.drop(self.tok_emb(idx.long()))

    def initial_state(self, e: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """s_0 shaped like ``e``: N(0, init_state_scale^2) from ``generator`` (else the global RNG), or zeros."""
        if self.cfg.init_state == "zeros":
            return torch.zeros_like(e)
        return torch.randn(e.shape, generator=generator, device=e.device, dtype=e.dtype) * self.cfg.init_state_scale

    def inject(self, s: Tensor, e: Tensor) -> Tensor:
        if self.adapter is None:
            return s + e
        # keep the residual stream in e's dtype (fp32) when autocast makes the adapter's output bf16
        return self.adapter(torch.cat([s, e], dim=-1)).to(e.dtype)

    def forward(self, idx: Tensor, n_loops: int, *, n_grad_loops: int | None = None,
                generator: torch.Generator | None = None, state: Tensor | None = None,
                targets: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Logits (B, T, V) after ``n_loops`` loops; with ``targets`` (B, T), ``(logits, mean cross-entropy)``.
        ``n_grad_loops=k``: only the last k loops build a graph; ``state``: s_0, else drawn from ``generator``."""
        need_loops("n_loops", n_loops)
        if n_grad_loops is not None:
            need_int("n_grad_loops", n_grad_loops, 1)
        e = self.embed(idx)
        s = self.initial_state(e, generator) if state is None else check_initial_state(state, e)
        n_free = 0 if n_grad_loops is None else max(n_loops - n_grad_loops, 0)
        if n_free:
            with torch.no_grad():
                for _ in range(n_free):
                    s = self.core_step(s, e)
            s = s.detach()
        for _ in range(n_loops - n_free):
            s = self.core_step(s, e)
        logits = self.readout(s)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters (tied weights count once); ``exclude_embedding`` drops the vocabulary tables."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.tok_emb.weight.numel() + (0 if self.cfg.tie_embeddings else self.lm_head.weight.numel())
        return n

    def flops_per_token(self, n_loops: int, seq_len: int) -> int:
        """Forward matmul FLOPs per token (multiply-add = 2; attention over the full T x T, as nanoGPT counts)."""
        c = self.cfg
        d, h, T = c.d_model, c.hidden_dim, seq_len
        block = 2 * (4 * d * d + 3 * d * h) + 4 * T * d
        adapter = 2 * 2 * d * d if c.injection == "concat" else 0
        return (c.n_prelude + c.n_coda) * block + n_loops * (c.n_core * block + adapter) + 2 * d * c.vocab_size

    def checkpoint_state(self) -> dict[str, Tensor]:
        """The state dict as saved: a tied lm_head is stored once, as ``tok_emb.weight``."""
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.cfg.tie_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def save(self, path_dir: str | Path) -> Path:
        """Write ``model.safetensors`` and ``config.json`` into ``path_dir`` (created if needed)."""
        path = Path(path_dir)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.cpu() for k, v in self.checkpoint_state().items()}, str(path / WEIGHTS_FILE))
        (path / CONFIG_FILE).write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path_dir: str | Path, map_location: str | torch.device = "cpu") -> DepthRecurrentLM:
        """Build the model from ``path_dir/config.json`` and load ``path_dir/model.safetensors``."""
        config_path = Path(path_dir) / CONFIG_FILE
        if not config_path.is_file():
            raise DrcError(f"{config_path} not found; pass a directory written by DepthRecurrentLM.save")
        model = cls(ModelConfig.from_dict(json.loads(config_path.read_text()), str(config_path)))
        load_state(model, path_dir, map_location=map_location)
        return model.to(map_location)


def load_state(model: DepthRecurrentLM, path: str | Path, map_location: str | torch.device = "cpu") -> None:
    """Load a checkpoint (a directory from :meth:`DepthRecurrentLM.save`, or its weights file) after checking it:
    a missing, unexpected or misshapen tensor or a differing config field is a one-line ``DrcError``."""
    path = Path(path)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    if not weights.is_file():
        raise DrcError(f"checkpoint {weights} not found; pass a directory written by DepthRecurrentLM.save")
    config_path = weights.parent / CONFIG_FILE
    diffs: list[str] = []
    if config_path.is_file():
        saved, mine = json.loads(config_path.read_text()), model.cfg.to_dict()
        diffs = [f"{k}={saved[k]!r} (the model has {k}={mine[k]!r})" for k in mine
                 if k in saved and saved[k] != mine[k] and k not in _LOAD_COMPATIBLE_FIELDS]
    hint = (f": the checkpoint was made with {diffs[0]}; load it with its own config.json" if diffs
            else "; the checkpoint was made with a different architecture")
    ckpt = load_file(str(weights), device=str(map_location))
    expected = model.checkpoint_state()
    if missing := [k for k in expected if k not in ckpt]:
        raise DrcError(f"checkpoint is missing tensor {missing[0]} that the model expects{hint}")
    if extra := [k for k in ckpt if k not in expected]:
        raise DrcError(f"checkpoint has unexpected tensor {extra[0]} that the model does not have{hint}")
    for key, want in expected.items():
        if ckpt[key].shape != want.shape:
            shape = ",".join(map(str, ckpt[key].shape)), ",".join(map(str, want.shape))
            raise DrcError(f"checkpoint tensor {key} has shape ({shape[0]}) but the model expects ({shape[1]}){hint}")
    if diffs:
        raise DrcError(f"checkpoint config.json has {diffs[0]}; build the model from the checkpoint's config.json "
                       "(DepthRecurrentLM.load) or fix that field")
    if model.cfg.tie_embeddings:
        ckpt["lm_head.weight"] = ckpt["tok_emb.weight"]
    model.load_state_dict(ckpt, strict=True)


def read_out(model: RecurrentModel, state: Tensor, readout: str | None,
             positions: slice | Tensor | None = None, **frozen: Any) -> Tensor | None:
    """``model.readout`` of ``state`` as ``readout`` asks: "logits", "log_probs" (float32) or None (nothing)."""
    if readout is None:
        return None
    out = model.readout(state, positions, **frozen)
    return F.log_softmax(out.float(), dim=-1) if readout == "log_probs" else out


def iterate(model: RecurrentModel, idx: Tensor, max_loops: int, *, generator: torch.Generator | None = None,
            positions: slice | Tensor | None = None, readout: str | None = "logits", halt: HaltFn | None = None,
            state: Tensor | None = None) -> Iterator[LoopOutput]:
    """Yield a :class:`LoopOutput` after each loop 1..max_loops: the one loop every measurement, halting rule and
    sweep runs (loop l's logits equal ``forward(idx, l)`` from the same s_0). ``halt(loop_output)`` may return the
    (B, T) tokens that halt now: the reference semantics of per-token halting, where a token halted at loop e keeps
    s_e and offers the keys/values of loop e in every later loop (:class:`FrozenKV`)."""
    need_loops("max_loops", max_loops)
    if readout not in READOUTS:
        raise DrcError(f"readout={readout!r} is not supported; use one of {READOUTS}")
    e = model.embed(idx)
    s = model.initial_state(e, generator) if state is None else check_initial_state(state, e)
    halted = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
    exit_loop = torch.zeros(idx.shape, dtype=torch.long, device=idx.device)
    core_kv, coda_kv = (FrozenKV(), FrozenKV()) if halt is not None else (None, None)
    for loop in range(1, max_loops + 1):
        frozen = halted if halt is not None else None
        s_new = model.core_step(s, e, frozen_kv=core_kv, frozen=frozen)
        s = torch.where(halted[..., None], s, s_new) if halt is not None else s_new
        out = read_out(model, s, readout, positions, frozen_kv=coda_kv, frozen=frozen)
        now = halt(LoopOutput(loop, s, out, halted, exit_loop)) if halt is not None else None
        if now is not None:
            now = now.to(device=halted.device, dtype=torch.bool) & ~halted
            exit_loop = torch.where(now, loop, exit_loop)
            halted = halted | now
        yield LoopOutput(loop=loop, state=s, out=out, halted=halted, exit_loop=exit_loop)


def logits_at(model: RecurrentModel, idx: Tensor, n_loops: int, *, generator: torch.Generator | None = None,
              state: Tensor | None = None, positions: slice | Tensor | None = None) -> Tensor:
    """The logits after ``n_loops`` loops read out once: ``forward`` for any :class:`RecurrentModel`."""
    (last,) = deque(iterate(model, idx, n_loops, generator=generator, readout=None, state=state), maxlen=1)
    return model.readout(last.state, positions)
