"""Huginn-0125 ("raven", ``model_type: huginn_raven``) as a :class:`~drc_core.model.lm.RecurrentModel`.

Written from a description of the format (the ``huginn-tiny`` fixture's README; see ``docs/huginn.md``)::

    e   = prelude(wte[idx] * embed_scale)              # sandwich blocks, run once
    s_0 = trunc_normal(+-3 std) * embed_scale           # "like-init"; zeros when std * init_scale == 0
    s_l = core(adapter(cat([s_{l-1}, e])))              # l = 1..r, no skip around the core
    out = lm_head(ln_f(coda(ln_f(s_r))))                # ln_f used twice, lm_head tied to wte

A sandwich block is ``x = n2(x + attn(n1(x))); x = n4(x + mlp(n3(x)))``, RoPE on adjacent pairs; the first
``ln_f`` is folded into the first coda block (:attr:`HuginnBlock.entry`) so the KV-cached paths compute Huginn's
numbers too. Checkpoints are read by :mod:`drc_core.model.huginn_checkpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drc_core.model.blocks import BlockStack, KVFn
from drc_core.model.lm import logits_at

__all__ = ["HuginnBlock", "HuginnConfig", "HuginnLM", "apply_rope", "rope_tables"]


@dataclass(frozen=True)
class HuginnConfig:
    """A Huginn checkpoint's sizes in this project's names; ``vocab_size`` is upstream ``padded_vocab_size`` (the
    embedding's rows), ``tokenizer_vocab_size`` upstream ``vocab_size``."""

    d_model: int
    n_heads: int
    hidden_dim: int
    vocab_size: int
    tokenizer_vocab_size: int
    max_seq_len: int
    n_prelude: int
    n_core: int
    n_coda: int
    mean_recurrence: int
    rope_base: float
    norm_eps: float
    qk_bias: bool
    tie_embeddings: bool
    embed_scale: float
    state_std: float

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class RMSNorm(nn.Module):
    """``(x * rsqrt(mean(x^2) + eps))`` in float32, cast back to x's dtype, times the weight (Huginn's order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, base: float) -> tuple[Tensor, Tensor]:
    """cos/sin (seq_len, head_dim/2) in float32, computed in float32 as Huginn computes its ``freqs_cis``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the adjacent pairs (2i, 2i+1) of x (B, T, H, hd) in float32; cos/sin are (T, hd/2)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.Wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, cfg.n_heads, cfg.head_dim)) if cfg.qk_bias else None
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)


class GatedMLP(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 2 * cfg.hidden_dim, bias=False)
        self.proj = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class HuginnBlock(nn.Module):
    """The sandwich block, split into :meth:`qkv` and :meth:`finish` like :class:`~drc_core.model.blocks.Block`;
    ``entry`` (first coda block only): the shared ``norm`` applied to the input first."""

    def __init__(self, cfg: HuginnConfig, entry: RMSNorm | None = None) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm_3, self.norm_4 = RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn, self.mlp = Attention(cfg), GatedMLP(cfg)
        self.entry = nn.Identity() if entry is None else entry

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, d) -> q, k, v (B, H, T, hd): bias on q and k, then RoPE."""
        B, T, _ = x.shape
        a = self.attn
        q, k, v = a.Wqkv(self.norm_1(self.entry(x))).view(B, T, 3, a.n_heads, a.head_dim).unbind(2)
        if a.qk_bias is not None:
            q, k = q + a.qk_bias[0], k + a.qk_bias[1]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def finish(self, x: Tensor, y: Tensor) -> Tensor:
        """The block after attention: ``y`` (..., H * hd) is the attention output of the tokens ``x`` (..., d)."""
        x = self.norm_2(self.attn.proj(y) + self.entry(x))
        return self.norm_4(self.mlp(self.norm_3(x)) + x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_fn: KVFn | None = None) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        if kv_fn is not None:
            k, v = kv_fn(k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.finish(x, y.transpose(1, 2).flatten(2))


class HuginnLM(BlockStack):
    """Huginn's forward as a :class:`~drc_core.model.lm.RecurrentModel` (built by
    :func:`~drc_core.model.huginn_checkpoint.load_huginn`); ``init_scale`` scales s_0's std (0: s_0 = 0)."""

    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.cfg, self.init_scale = cfg, 1.0
        self.vocab_size, self.max_seq_len = cfg.vocab_size, cfg.max_seq_len
        self.mean_recurrence = cfg.mean_recurrence  # the checkpoint's trained mean depth: the default number of loops
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.zeros(cfg.vocab_size, cfg.d_model))
        self.prelude = nn.ModuleList(HuginnBlock(cfg) for _ in range(cfg.n_prelude))
        self.adapter = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.core = nn.ModuleList(HuginnBlock(cfg) for _ in range(cfg.n_core))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)  # before the coda: its parameter is named norm.weight
        self.coda = nn.ModuleList(HuginnBlock(cfg, self.norm if i == 0 else None) for i in range(cfg.n_coda))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # on the meta device (load_huginn), the tables are set after the checks: skip them here
        meta, size = self.adapter.weight.is_meta, (cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        cos, sin = (torch.empty(0), torch.empty(0)) if meta else rope_tables(*size)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def token_embedding(self, idx: Tensor) -> Tensor:
        return self.tok_emb(idx.long()) * self.cfg.embed_scale

    def initial_state(self, e: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Huginn's "like-init" s_0 from ``generator`` (else the global RNG), drawing exactly what upstream draws: a
        normal draw, overwritten by a normal truncated at +-3 std, times embed_scale; zeros when std is 0."""
        x = torch.randn(e.shape, generator=generator, device=e.device, dtype=e.dtype)
        std = self.cfg.state_std * self.init_scale
        if std <= 0:
            return x.zero_()
        nn.init.trunc_normal_(x, 0.0, std, -3 * std, 3 * std, generator=generator)
        return x * self.cfg.embed_scale

    def inject(self, s: Tensor, e: Tensor) -> Tensor:
        return self.adapter(torch.cat([s, e], dim=-1))

    def forward(self, idx: Tensor, n_loops: int | None = None, *, generator: torch.Generator | None = None,
                state: Tensor | None = None) -> Tensor:
        """Logits (B, T, V) after ``n_loops`` loops (default: the trained mean depth); ``state``: s_0."""
        n = self.mean_recurrence if n_loops is None else n_loops
        return logits_at(self, idx, n, generator=generator, state=state)
