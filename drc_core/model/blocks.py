"""The transformer block (pre- or sandwich-norm, RoPE causal attention, SwiGLU, no biases), :class:`FrozenKV`
(the keys/values halted tokens keep offering) and :class:`BlockStack`, the prelude/core/coda pass both models run."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drc_core.errors import DrcError
from drc_core.model.checks import check_token_ids
from drc_core.model.config import ModelConfig

__all__ = ["Attention", "Block", "BlockStack", "FrozenKV", "KVFn", "RMSNorm", "SwiGLU", "apply_rope", "rope_tables"]


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
    """One cached (k, v) per block: ``hook(j, frozen)`` gives attention ``where(frozen, cached_j, fresh)`` and caches
    that, so a frozen token keeps offering its last computed keys and values."""

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
    """Causal multi-head self-attention with RoPE; ``proj`` is the output projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.dropout = cfg.n_heads, cfg.head_dim, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden_dim, bias=False)
        self.down = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """``x + post(attn(norm(x)))`` then ``x + post(mlp(norm(x)))`` (``post``: identity unless sandwich), as
    :meth:`qkv`, attention, :meth:`finish` (the compute-skipping paths swap only the attention)."""

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
        """q, k, v (B, H, T, hd) of ``norm(x)`` (B, T, d), RoPE'd with ``cos``/``sin`` (one row per position of x)."""
        a = self.attn
        B, T, _ = x.shape
        q, k, v = a.qkv(self.attn_norm(x)).view(B, T, 3, a.n_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: Tensor, y: Tensor) -> Tensor:
        """The block after attention: ``y`` (..., H * hd) is the attention output of the tokens ``x`` (..., d)."""
        x = x + self.drop(self.attn_post(self.attn.proj(y)))
        return x + self.drop(self.mlp_post(self.mlp(self.mlp_norm(x))))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_fn: KVFn | None = None) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        if kv_fn is not None:
            k, v = kv_fn(k, v)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.finish(x, y.transpose(1, 2).flatten(2))  # heads merged: (B, T, d)


class BlockStack(nn.Module):
    """The pass of a looped model over its ``prelude``, ``core`` and ``coda`` blocks, ``norm``, ``lm_head`` and RoPE
    tables; a subclass builds them and defines ``token_embedding`` and ``inject``."""

    max_seq_len: int

    def _run(self, blocks: nn.ModuleList, x: Tensor, frozen_kv: FrozenKV | None = None,
             frozen: Tensor | None = None) -> Tensor:
        """``x`` through ``blocks``, block j's keys/values through ``frozen_kv``'s slot j for the ``frozen`` tokens."""
        if (frozen_kv is None) != (frozen is None):
            raise DrcError("frozen_kv and frozen go together; pass both (a FrozenKV and a (B, T) mask) or neither")
        if (seq_len := x.shape[1]) > self.max_seq_len:
            raise DrcError(f"sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}; use shorter inputs "
                           "or a model with a larger max_seq_len")
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        for j, block in enumerate(blocks):
            x = block(x, cos, sin, None if frozen_kv is None else frozen_kv.hook(j, frozen))
        return x

    def head(self, x: Tensor) -> Tensor:
        """Final norm + LM head: states after the coda (..., d) -> logits (..., V)."""
        return self.lm_head(self.norm(x))

    def embed(self, idx: Tensor) -> Tensor:
        """Token ids (B, T), checked here for every public path -> the prelude output e (B, T, d)."""
        check_token_ids(self, idx, "idx (token ids)", targets=False)
        return self._run(self.prelude, self.token_embedding(idx))

    def core_step(self, s: Tensor, e: Tensor, *, frozen_kv: FrozenKV | None = None,
                  frozen: Tensor | None = None) -> Tensor:
        """One loop: s_l = core(inject(s_{l-1}, e)); ``frozen`` tokens offer their ``frozen_kv`` keys/values."""
        return self._run(self.core, self.inject(s, e), frozen_kv, frozen)

    def readout(self, state: Tensor, positions: slice | Tensor | None = None, *, frozen_kv: FrozenKV | None = None,
                frozen: Tensor | None = None) -> Tensor:
        """Coda + head: state (B, T, d) -> logits of the tokens ``positions`` selects (a slice or 1-D index along
        time: (B, T', V); a (B, T) bool mask: (n, V)); ``frozen_kv``/``frozen`` as in :meth:`core_step`."""
        x = self._run(self.coda, state, frozen_kv, frozen)
        if isinstance(positions, Tensor) and positions.dim() == 2:
            x = x[positions]
        elif positions is not None:
            x = x[:, positions]
        return self.head(x)
