"""A depth-recurrent transformer language model (prelude -> weight-tied core looped r times -> coda).

The model has three parts::

    e   = prelude(embed(idx))                       # P blocks, run once
    s_0 = N(0, init_state_scale^2)  (or zeros)      # the latent state
    s_l = core(inject(s_{l-1}, e))   l = 1..r       # R blocks, ONE shared set of weights, looped r times
    out = head(norm(coda(s_r)))                      # C blocks, run once

``inject`` is either ``adapter(cat([s, e]))`` with ``adapter = Linear(2d -> d)`` ("concat", the default) or
``s + e`` ("add"). Every block is a pre-norm (or sandwich-norm) transformer block with RoPE causal
self-attention and a SwiGLU MLP, without biases.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from drc_core.errors import DrcError, check_fields, need_float, need_int, need_loops
from drc_core.model.checks import check_initial_state, check_token_ids

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

_NORMS = ("pre", "sandwich")
_INJECTIONS = ("concat", "add")
_INIT_STATES = ("random", "zeros")
_READOUTS = ("logits", "log_probs", None)
# Config fields that may differ between a checkpoint and the model loading it: they change no weights.
_LOAD_COMPATIBLE_FIELDS = frozenset({"dropout", "max_seq_len"})


# ----------------------------------------------------------------------------------------------------------
# Config


def _valid_heads(d_model: int) -> str:
    """The head counts that divide ``d_model`` into even head sizes, for error messages."""
    ok = [h for h in range(1, d_model + 1) if d_model % h == 0 and (d_model // h) % 2 == 0]
    shown = ", ".join(str(h) for h in ok[:8])
    return "{" + shown + (", ..." if len(ok) > 8 else "") + "}"


@dataclass
class ModelConfig:
    """Hyper-parameters of :class:`DepthRecurrentLM`.

    ``mlp_hidden=None`` means the SwiGLU hidden size ``8/3 * d_model`` rounded up to a multiple of 8 (see
    :attr:`hidden_dim`). ``norm="sandwich"`` also RMS-normalises each sublayer's output before it is added to
    the residual stream. ``init_state="random"`` draws the initial latent state from
    ``N(0, init_state_scale**2)``.
    """

    vocab_size: int
    d_model: int = 256
    n_heads: int = 4
    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    mlp_hidden: int | None = None
    max_seq_len: int = 512
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    norm: str = "pre"
    injection: str = "concat"
    init_state: str = "random"
    init_state_scale: float = 1.0
    tie_embeddings: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        def need(name: str, minimum: int) -> None:
            need_int(name, getattr(self, name), minimum)

        for name in ("vocab_size", "d_model", "n_heads", "n_core", "max_seq_len"):
            need(name, 1)
        for name in ("n_prelude", "n_coda"):
            need(name, 0)
        if self.mlp_hidden is not None:
            need("mlp_hidden", 1)
        if self.d_model % self.n_heads != 0:
            raise DrcError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                f"choose n_heads in {_valid_heads(self.d_model)}"
            )
        if (self.d_model // self.n_heads) % 2 != 0:
            raise DrcError(
                f"head_dim = d_model/n_heads = {self.d_model // self.n_heads} is odd but RoPE needs an even "
                f"head_dim; choose n_heads in {_valid_heads(self.d_model)}"
            )
        for name, allowed in (("norm", _NORMS), ("injection", _INJECTIONS), ("init_state", _INIT_STATES)):
            if getattr(self, name) not in allowed:
                raise DrcError(f"{name}={getattr(self, name)!r} is not supported; use one of {allowed}")

        need_float("rope_base", self.rope_base, 0.0, lo_open=True)
        need_float("norm_eps", self.norm_eps, 0.0, lo_open=True)
        need_float("init_state_scale", self.init_state_scale, 0.0)
        need_float("dropout", self.dropout, 0.0, 1.0, hi_open=True)
        if not isinstance(self.tie_embeddings, bool):
            raise DrcError(f"tie_embeddings={self.tie_embeddings!r} is invalid; use true or false")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden size actually used."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 8 * math.ceil(8 * self.d_model / 3 / 8)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object], where: str = "model config") -> ModelConfig:
        """A config from its stored dict: every field present, none unknown (:func:`~drc_core.errors.check_fields`)."""
        data = check_fields(cls, data, where)
        return cls(**data)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------
# Blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # under bf16 autocast a sublayer output arrives in bf16: normalise in the weight's dtype (fp32)
        return F.rms_norm(x.to(self.weight.dtype), (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_seq_len: int, base: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim/2) for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, T, hd) by position; ``cos``/``sin`` are (T, hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


KVFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # (k, v) -> the (k, v) that attention uses


class FrozenKV:
    """The keys/values that frozen (halted) tokens offer to attention: one cached (k, v) pair per block.

    ``hook(j, frozen)`` is a ``kv_fn`` for block j (any index; a slot appears on first use; see
    :meth:`Block.forward`): given the freshly computed k, v (B, H, T, hd) it returns
    ``where(frozen, cached_j, fresh)`` and stores that as the new ``cached_j``.
    So after each pass the cache holds, for every token, the keys/values it offered last: its fresh ones while
    it is not frozen, and from then on those of the last pass before it froze (its *last computed* ones).
    The first pass through block j only stores (nothing can be frozen before anything was computed), and a
    pass with no frozen token passes the fresh tensors through unchanged.
    """

    def __init__(self) -> None:
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}

    def hook(self, j: int, frozen: Tensor) -> KVFn:
        def kv_fn(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            cached = self.kv.get(j)
            if cached is not None and bool(frozen.any()):
                mask = frozen[:, None, :, None]
                k, v = torch.where(mask, cached[0], k), torch.where(mask, cached[1], v)
            self.kv[j] = (k, v)
            return k, v

        return kv_fn


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE, in two steps that :class:`Block` composes:
    :meth:`project_qkv` (fused projection + split heads + RoPE) and :meth:`attend` (attention + merge heads);
    ``proj`` is the output projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.dropout = cfg.n_heads, cfg.head_dim, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def project_qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, d) -> q, k, v each (B, H, T, hd), with RoPE applied to q and k."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of q over k/v, heads merged: -> (B, T, d) (before the output projection)."""
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        B, _, T, _ = y.shape
        return y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden_dim, bias=False)
        self.down = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """``x + post(attn(norm(x)))`` then ``x + post(mlp(norm(x)))``; ``post`` is identity unless sandwich.

    :meth:`forward` is :meth:`qkv`, the causal attention over those keys/values, then :meth:`finish`; the
    compute-skipping paths (:func:`drc_core.halting.kvlayout.block_step`) run the same :meth:`qkv` and
    :meth:`finish` on a flat list of tokens and swap only the attention, which reads a key/value cache. A
    ``kv_fn`` (see :class:`FrozenKV`) may replace the keys/values attention sees: ``k, v = kv_fn(k, v)``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        sandwich = cfg.norm == "sandwich"
        self.attn_post = RMSNorm(cfg.d_model, cfg.norm_eps) if sandwich else nn.Identity()
        self.mlp_post = RMSNorm(cfg.d_model, cfg.norm_eps) if sandwich else nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (B, H, T, hd) of ``norm(x)`` (B, T, d), RoPE'd with ``cos``/``sin`` (T, hd/2) -- one row per
        position of x, so a flat list of tokens passes its own positions' rows."""
        return self.attn.project_qkv(self.attn_norm(x), cos, sin)

    def finish(self, x: Tensor, y: Tensor) -> Tensor:
        """The block after attention: ``y`` (..., H * hd) is the attention output of the tokens ``x`` (..., d)."""
        x = x + self.drop(self.attn_post(self.attn.proj(y)))
        return x + self.drop(self.mlp_post(self.mlp(self.mlp_norm(x))))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_fn: KVFn | None = None) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        if kv_fn is not None:
            k, v = kv_fn(k, v)
        return self.finish(x, self.attn.attend(q, k, v))


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
        return self.drop(self.tok_emb(idx))

    def head(self, x: Tensor) -> Tensor:
        """Final norm + LM head: states after the coda (..., d) -> logits (..., V)."""
        return self.lm_head(self.norm(x))

    def embed(self, idx: Tensor) -> Tensor:
        """Token ids (B, T) -> the prelude output e (B, T, d). Every public path (forward, iterate, masked_forward,
        skip_forward, anderson) starts here, so the ids are checked here once (:func:`check_token_ids`)."""
        check_token_ids(self, idx, "idx (token ids)", targets=False)
        cos, sin = self._rope(idx.shape[1])
        x = self.token_embedding(idx)
        for block in self.prelude:
            x = block(x, cos, sin)
        return x

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
        cos, sin = self._rope(s.shape[1])
        x = self.inject(s, e)
        for j, block in enumerate(self.core):
            x = block(x, cos, sin, _kv_hook(frozen_kv, j, frozen))
        return x

    def readout(self, state: Tensor, positions: slice | Tensor | None = None, *, frozen_kv: FrozenKV | None = None,
                frozen: Tensor | None = None) -> Tensor:
        """Coda + final norm + head: state (B, T, d) -> logits (B, T', V).

        The coda attends over the whole sequence, so it always runs on all T positions; ``positions`` (a
        slice or 1-D index/bool tensor along time) then selects the tokens that get the norm and the
        (vocabulary-sized, memory-heavy) head; a (B, T) bool tensor selects single tokens, and the logits are
        then (n, V) for its n true entries in row-major order. ``frozen_kv``/``frozen``: as in
        :meth:`core_step`, for the coda blocks.
        """
        cos, sin = self._rope(state.shape[1])
        x = state
        for j, block in enumerate(self.coda):
            x = block(x, cos, sin, _kv_hook(frozen_kv, j, frozen))
        if isinstance(positions, Tensor) and positions.dim() == 2:
            x = x[positions]
        elif positions is not None:
            x = x[:, positions]
        return self.head(x)

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


def _kv_hook(frozen_kv: FrozenKV | None, j: int, frozen: Tensor | None) -> KVFn | None:
    if (frozen_kv is None) != (frozen is None):
        raise DrcError("frozen_kv and frozen go together; pass both (a FrozenKV and a (B, T) mask) or neither")
    return None if frozen_kv is None or frozen is None else frozen_kv.hook(j, frozen)


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
