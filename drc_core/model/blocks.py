"""The transformer blocks the prelude, the core and the coda are made of: pre-norm (or sandwich-norm) blocks with
RoPE causal self-attention and a SwiGLU MLP, without biases (:class:`Block`), and :class:`FrozenKV`, the keys and
values halted tokens keep offering to attention."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drc_core.errors import DrcError
from drc_core.model.config import ModelConfig

__all__ = ["Attention", "Block", "FrozenKV", "KVFn", "RMSNorm", "SwiGLU", "apply_rope", "rope_tables"]


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


def kv_hook(frozen_kv: FrozenKV | None, j: int, frozen: Tensor | None) -> KVFn | None:
    """Block j's frozen-KV hook for a step over blocks (see :func:`drc_core.model.lm.iterate`), or None without
    halting."""
    if (frozen_kv is None) != (frozen is None):
        raise DrcError("frozen_kv and frozen go together; pass both (a FrozenKV and a (B, T) mask) or neither")
    return None if frozen_kv is None or frozen is None else frozen_kv.hook(j, frozen)


def run_blocks(blocks: nn.ModuleList, x: Tensor, cos: Tensor, sin: Tensor, frozen_kv: FrozenKV | None = None,
               frozen: Tensor | None = None) -> Tensor:
    """``x`` through ``blocks`` in order, block j's keys/values through ``frozen_kv``'s slot j for the tokens
    ``frozen`` marks (the core step and the coda of every model that implements the protocol)."""
    for j, block in enumerate(blocks):
        x = block(x, cos, sin, kv_hook(frozen_kv, j, frozen))
    return x


def select_positions(x: Tensor, positions: slice | Tensor | None) -> Tensor:
    """The readout's tokens of ``x`` (B, T, d): all (None), a slice or 1-D index along time, or single tokens by a
    (B, T) bool mask (-> (n, d), row-major)."""
    if isinstance(positions, Tensor) and positions.dim() == 2:
        return x[positions]
    return x if positions is None else x[:, positions]
