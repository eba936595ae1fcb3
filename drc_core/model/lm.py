"""A depth-recurrent transformer language model (prelude -> weight-tied core looped r times -> coda).

The model has three parts::

    e   = prelude(embed(idx))                       # P blocks, run once
    s_0 = N(0, init_state_scale^2)  (or zeros)      # the latent state
    s_l = core(inject(s_{l-1}, e))   l = 1..r       # R blocks, ONE shared set of weights, looped r times
    out = head(norm(coda(s_r)))                      # C blocks, run once

``inject`` is either ``adapter(cat([s, e]))`` with ``adapter = Linear(2d -> d)`` ("concat", the default) or
``s + e`` ("add"). Every block is a pre-norm (or sandwich-norm) transformer block with RoPE causal
self-attention and a SwiGLU MLP, without biases (:mod:`~drc_core.model.blocks`); the hyper-parameters are a
:class:`~drc_core.model.config.ModelConfig`.
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

from drc_core.errors import DrcError, need_loops
from drc_core.model.blocks import Block, FrozenKV, RMSNorm, rope_tables, run_blocks, select_positions
from drc_core.model.checks import check_initial_state, check_token_ids
from drc_core.model.config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

_READOUTS = ("logits", "log_probs", None)
# Config fields that may differ between a checkpoint and the model loading it: they change no weights.
_LOAD_COMPATIBLE_FIELDS = frozenset({"dropout", "max_seq_len"})


# ----------------------------------------------------------------------------------------------------------
# Model


@dataclass
class LoopOutput:
    """What :func:`iterate` yields after loop ``loop`` (1-based).

    ``state`` is s_loop (B, T, d); ``out`` the readout at the selected positions (or None); ``halted`` (B, T)
    the tokens halted so far (including at this loop); ``exit_loop`` (B, T) the loop at which each token
    halted, 0 while it is active.
    """

    loop: int
    state: Tensor
    out: Tensor | None
    halted: Tensor
    exit_loop: Tensor


HaltFn = Callable[[LoopOutput], Tensor | None]


@runtime_checkable
class RecurrentModel(Protocol):
    """What the analysis, halting and sweep code needs from a depth-recurrent model (bring your own).

    A ``torch.nn.Module`` (``eval``/``train``/``parameters`` are used for the evaluation context) with:

    - ``vocab_size`` and ``max_seq_len``: the valid token ids are 0..vocab_size-1, sequences at most
      ``max_seq_len`` long;
    - ``embed(idx)``: token ids (B, T) -> the input injected at every loop, e (B, T, d) (e.g. a prelude's
      output, or the embeddings);
    - ``initial_state(e, generator)``: s_0 shaped like ``e`` (random from ``generator``, or zeros);
    - ``core_step(s, e, frozen_kv=None, frozen=None)``: one loop, s_l from s_{l-1} and e;
    - ``readout(state, positions=None, frozen_kv=None, frozen=None)``: state (B, T, d) -> logits (B, T', V), the
      time ``positions`` (slice or index) selected after any sequence-mixing layers; a (B, T) bool ``positions``
      selects tokens, logits (n, V) (needed only by ``measure_windows(positions=...)``).

    The frozen-KV hooks are needed only for per-token halting in :func:`iterate` (``halt=``, what
    :func:`drc_core.halting.reference.masked_forward` runs): given a :class:`FrozenKV` and a (B, T) bool ``frozen``,
    every attention layer j of the step passes its fresh keys/values through ``frozen_kv.hook(j, frozen)``
    (see :class:`Attention`), so that halted tokens keep offering the keys/values of their exit loop. A model
    without them may raise when ``frozen_kv`` is given; measurement, sweeps and routers never pass it.
    The compute-skipping paths (:mod:`drc_core.halting.skipping`, :mod:`drc_core.halting.generate`) reach into
    :class:`DepthRecurrentLM`'s blocks and are specific to it.
    """

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


class DepthRecurrentLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.prelude = nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude))
        self.adapter = (
            nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False) if cfg.injection == "concat" else None
        )
        self.core = nn.ModuleList(Block(cfg) for _ in range(cfg.n_core))  # one set, reused at every loop
        self.coda = nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def _init_weights(self) -> None:
        """N(0, 0.02) everywhere; output projections N(0, 0.02/sqrt(2L)) with L = P + R + C.

        L counts the blocks between the embedding and the head on one pass: the concat adapter re-projects
        the state at every loop, so the residual sum does not keep growing with the number of loops.
        """
        n_eff = self.cfg.n_prelude + self.cfg.n_core + self.cfg.n_coda
        out_std = 0.02 / math.sqrt(2 * n_eff)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                small = name.endswith(".attn.proj") or name.endswith(".mlp.down")
                nn.init.normal_(module.weight, mean=0.0, std=out_std if small else 0.02)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    # --- the pieces ------------------------------------------------------------------------------------

    def _rope(self, seq_len: int) -> tuple[Tensor, Tensor]:
        if seq_len > self.cfg.max_seq_len:
            raise DrcError(
                f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}; "
                "use shorter inputs or a config with a larger max_seq_len"
            )
        return self.rope_cos[:seq_len], self.rope_sin[:seq_len]

    def token_embedding(self, idx: Tensor) -> Tensor:
        """Token ids (any shape) -> their embeddings (..., d), before the prelude (with dropout)."""
        return self.drop(self.tok_emb(idx.long()))  # any integer dtype check_token_ids let through

    def head(self, x: Tensor) -> Tensor:
        """Final norm + LM head: states after the coda (..., d) -> logits (..., V)."""
        return self.lm_head(self.norm(x))

    def embed(self, idx: Tensor) -> Tensor:
        """Token ids (B, T) -> the prelude output e (B, T, d). Every public path (forward, iterate, masked_forward,
        skip_forward, anderson) starts here, so the ids are checked here once (:func:`check_token_ids`)."""
        check_token_ids(self, idx, "idx (token ids)", targets=False)
        return run_blocks(self.prelude, self.token_embedding(idx), *self._rope(idx.shape[1]))

    def initial_state(self, e: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """s_0 shaped like ``e``: N(0, init_state_scale^2) drawn with ``generator`` (else the global RNG),
        or zeros."""
        if self.cfg.init_state == "zeros":
            return torch.zeros_like(e)
        s = torch.randn(e.shape, generator=generator, device=e.device, dtype=e.dtype)
        return s * self.cfg.init_state_scale

    def inject(self, s: Tensor, e: Tensor) -> Tensor:
        if self.adapter is None:
            return s + e
        # keep the residual stream in e's dtype (fp32) when autocast makes the adapter's output bf16
        return self.adapter(torch.cat([s, e], dim=-1)).to(e.dtype)

    def core_step(self, s: Tensor, e: Tensor, *, frozen_kv: FrozenKV | None = None,
                  frozen: Tensor | None = None) -> Tensor:
        """One loop: s_l = core(inject(s_{l-1}, e)), with the shared core weights.

        With ``frozen_kv`` (a :class:`FrozenKV` with one slot per core block, kept across loops) and
        ``frozen`` (B, T) bool, the frozen tokens offer their cached keys/values in every core block instead
        of fresh ones, and the cache is updated for the others (what :meth:`iterate` does for halted tokens).
        """
        return run_blocks(self.core, self.inject(s, e), *self._rope(s.shape[1]), frozen_kv, frozen)

    def readout(self, state: Tensor, positions: slice | Tensor | None = None, *, frozen_kv: FrozenKV | None = None,
                frozen: Tensor | None = None) -> Tensor:
        """Coda + final norm + head: state (B, T, d) -> logits (B, T', V).

        The coda attends over the whole sequence, so it always runs on all T positions; ``positions`` (a
        slice or 1-D index/bool tensor along time) then selects the tokens that get the norm and the
        (vocabulary-sized, memory-heavy) head; a (B, T) bool tensor selects single tokens, and the logits are
        then (n, V) for its n true entries in row-major order. ``frozen_kv``/``frozen``: as in
        :meth:`core_step`, for the coda blocks.
        """
        x = run_blocks(self.coda, state, *self._rope(state.shape[1]), frozen_kv, frozen)
        return self.head(select_positions(x, positions))

    # --- forward / iterate -------------------------------------------------------------------------------

    def forward(
        self,
        idx: Tensor,
        n_loops: int,
        *,
        n_grad_loops: int | None = None,
        generator: torch.Generator | None = None,
        state: Tensor | None = None,
        targets: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Logits (B, T, V) after ``n_loops`` core loops; with ``targets`` (B, T), ``(logits, loss)``.

        ``n_grad_loops=k`` is truncated backprop: the first ``n_loops - k`` loops run under
        ``torch.no_grad()`` and only the last ``k`` build a graph (so the prelude gets gradient only through
        the injection at those k loops). ``None`` (or k >= n_loops) is full backprop. The loss is the mean
        cross-entropy over targets != -100. ``state`` (B, T, d), when given, is the initial latent state s_0
        (the trainer draws it for the global batch so that data-parallel ranks match one process).
        """
        need_loops("n_loops", n_loops)
        if n_grad_loops is not None and (
            isinstance(n_grad_loops, bool) or not isinstance(n_grad_loops, int) or n_grad_loops < 1
        ):
            raise DrcError(f"n_grad_loops={n_grad_loops!r} is invalid; use an integer >= 1 or None")
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
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


    # --- accounting ------------------------------------------------------------------------------------

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters (tied weights count once); ``exclude_embedding`` drops the vocabulary tables
        (token embedding, and the lm_head when it is not tied)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.tok_emb.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, n_loops: int, seq_len: int) -> int:
        """Forward-pass matmul FLOPs per token (multiply-add = 2 FLOPs).

        ``block = 2*(4 d^2 + 3 d h) + 4 T d`` per block application: qkv + output projection + SwiGLU
        (gate, up, down) weights, plus attention scores (QK^T) and weighted values (AV), counted over the
        full T x T matrix (the usual nanoGPT/Chinchilla convention; causal masking would halve it).
        ``total = (P + C) * block + n_loops * (R * block + adapter) + 2 d V`` with ``adapter = 2 * 2d * d``
        for concat injection (0 for add) and ``2 d V`` the lm_head. Norms, RoPE and softmax are ignored.
        """
        c = self.cfg
        d, h, T = c.d_model, c.hidden_dim, seq_len
        block = 2 * (4 * d * d + 3 * d * h) + 4 * T * d
        adapter = 2 * 2 * d * d if c.injection == "concat" else 0
        return (
            (c.n_prelude + c.n_coda) * block + n_loops * (c.n_core * block + adapter) + 2 * d * c.vocab_size
        )

    # --- checkpoints -----------------------------------------------------------------------------------

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
        path = Path(path_dir)
        config_path = path / CONFIG_FILE
        if not config_path.is_file():
            raise DrcError(f"{config_path} not found; pass a directory written by DepthRecurrentLM.save")
        model = cls(ModelConfig.from_dict(json.loads(config_path.read_text()), str(config_path)))
        load_state(model, path, map_location=map_location)
        return model.to(map_location)


def _shape(t: Tensor | torch.Size) -> str:
    return "(" + ",".join(str(n) for n in t) + ")"


def load_state(model: DepthRecurrentLM, path: str | Path, map_location: str | torch.device = "cpu") -> None:
    """Load a checkpoint (a directory from :meth:`DepthRecurrentLM.save`, or its ``model.safetensors``).

    Everything is checked before anything is copied; the first problem raises a one-line ``DrcError``:
    a missing/unexpected tensor or a shape mismatch names the tensor (and, when the checkpoint's config.json
    is there, the config fields that differ); a config field that differs without changing any shape
    (e.g. rope_base, injection scale) is named too. ``dropout`` and ``max_seq_len`` may differ.
    """
    path = Path(path)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    if not weights.is_file():
        raise DrcError(f"checkpoint {weights} not found; pass a directory written by DepthRecurrentLM.save")
    config_path = weights.parent / CONFIG_FILE
    diffs: list[str] = []
    if config_path.is_file():
        saved = json.loads(config_path.read_text())
        mine = model.cfg.to_dict()
        diffs = [
            f"{k}={saved[k]!r} (the model has {k}={mine[k]!r})"
            for k in mine
            if k in saved and saved[k] != mine[k] and k not in _LOAD_COMPATIBLE_FIELDS
        ]
    hint = (
        f": the checkpoint was made with {diffs[0]}; load it with its own config.json"
        if diffs
        else "; the checkpoint was made with a different architecture"
    )
    ckpt = load_file(str(weights), device=str(map_location))
    expected = model.checkpoint_state()
    for key in expected:
        if key not in ckpt:
            raise DrcError(f"checkpoint is missing tensor {key} that the model expects{hint}")
    for key in ckpt:
        if key not in expected:
            raise DrcError(f"checkpoint has unexpected tensor {key} that the model does not have{hint}")
    for key, want in expected.items():
        if ckpt[key].shape != want.shape:
            raise DrcError(
                f"checkpoint tensor {key} has shape {_shape(ckpt[key].shape)} but the model expects "
                f"{_shape(want.shape)}{hint}"
            )
    if diffs:
        raise DrcError(
            f"checkpoint config.json has {diffs[0]}; build the model from the checkpoint's config.json "
            "(DepthRecurrentLM.load) or fix that field"
        )
    if model.cfg.tie_embeddings:
        ckpt["lm_head.weight"] = ckpt["tok_emb.weight"]
    model.load_state_dict(ckpt, strict=True)


def iterate(
    model: RecurrentModel,
    idx: Tensor,
    max_loops: int,
    *,
    generator: torch.Generator | None = None,
    positions: slice | Tensor | None = None,
    readout: str | None = "logits",
    halt: HaltFn | None = None,
    state: Tensor | None = None,
) -> Iterator[LoopOutput]:
    """Yield a :class:`LoopOutput` after each loop 1..max_loops of ``model`` (prelude once, each loop once):
    the one loop every measurement, halting rule and sweep runs, for any :class:`RecurrentModel`.

    ``readout``: "logits", "log_probs" (float32 log-softmax) or None (``out`` is None). ``positions``
    selects the time positions, or with a (B, T) bool mask the tokens, that are read out (see :meth:`readout`).
    Runs under the caller's grad mode. With the same ``generator`` state (or the same ``state`` s_0), loop l's
    logits equal ``forward(idx, l)`` (for :class:`DepthRecurrentLM`).

    ``halt(loop_output)`` may return a (B, T) bool tensor of tokens that halt now (or None). It is called
    after loop l's readout, with ``halted``/``exit_loop`` as they were before loop l; the yielded output
    then includes its decisions. This is the reference (masked) semantics of per-token halting, which
    :func:`drc_core.halting.skipping.skip_forward` reproduces while skipping the halted tokens' compute:

    - a token that halts at loop e (its exit loop) keeps its state: ``s = where(halted, s_e, s_new)``;
    - at every later loop it offers, in every core block, the keys/values it computed at loop e (its last
      computed ones), not ones recomputed from its frozen state, and in every coda block the coda
      keys/values of its loop-e readout; active tokens offer their fresh ones (:class:`FrozenKV`);
    - so an active token at loop l attends to each earlier token's loop-min(l, e) keys/values.

    The core and coda still run on every token (the halted tokens' results are discarded), so this costs
    as much as no halting. ``out`` at a halted position is still recomputed at later loops (its query
    sees the later keys/values of earlier active tokens) and is not that token's result: a token's
    result is its readout at its exit loop (:func:`drc_core.halting.reference.masked_forward` keeps it). Without
    ``halt`` nothing is cached and every loop is exactly ``forward``'s.
    """
    need_loops("max_loops", max_loops)
    if readout not in _READOUTS:
        raise DrcError(f"readout={readout!r} is not supported; use one of {_READOUTS}")
    e = model.embed(idx)
    s = model.initial_state(e, generator) if state is None else check_initial_state(state, e)
    halted = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
    exit_loop = torch.zeros(idx.shape, dtype=torch.long, device=idx.device)
    core_kv = FrozenKV() if halt is not None else None
    coda_kv = FrozenKV() if halt is not None else None
    for loop in range(1, max_loops + 1):
        frozen = halted if halt is not None else None
        s_new = model.core_step(s, e, frozen_kv=core_kv, frozen=frozen)
        s = torch.where(halted[..., None], s, s_new) if halt is not None else s_new
        out = None
        if readout is not None:
            out = model.readout(s, positions, frozen_kv=coda_kv, frozen=frozen)
            if readout == "log_probs":
                out = F.log_softmax(out.float(), dim=-1)
        result = LoopOutput(loop=loop, state=s, out=out, halted=halted, exit_loop=exit_loop)
        if halt is not None:
            now = halt(result)
            if now is not None:
                now = now.to(device=halted.device, dtype=torch.bool) & ~halted
                exit_loop = torch.where(now, loop, exit_loop)
                halted = halted | now
                result = LoopOutput(loop=loop, state=s, out=out, halted=halted, exit_loop=exit_loop)
        yield result


def logits_at(model: RecurrentModel, idx: Tensor, n_loops: int, *, generator: torch.Generator | None = None,
              state: Tensor | None = None, positions: slice | Tensor | None = None) -> Tensor:
    """The logits (B, T, V) after ``n_loops`` loops read out once: :meth:`DepthRecurrentLM.forward` for any
    :class:`RecurrentModel` (the same operations, so the same numbers), e.g. a deepest reference output;
    ``positions``: only those tokens' logits (:meth:`DepthRecurrentLM.readout`)."""
    (last,) = deque(iterate(model, idx, n_loops, generator=generator, readout=None, state=state), maxlen=1)
    return model.readout(last.state, positions)
