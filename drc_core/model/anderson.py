"""Anderson acceleration and damping of the core iteration ``x -> f(x) = core_step(x, e)`` at inference: one
evaluation of ``f`` per step, the next point ``beta * sum_i alpha_i f(x_i) + (1 - beta) * sum_i alpha_i x_i`` with
``alpha`` minimising ``|| sum_i alpha_i (f(x_i) - x_i) ||`` (sum 1, Tikhonov-regularised) over the last ``m + 1``
iterates, per token (``scope="token"``) or per sequence. ``m = 0, beta = 1`` is exactly plain :func:`iterate`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from drc_core.errors import DrcError, need_float, need_int, need_loops
from drc_core.model.lm import READOUTS, RecurrentModel, read_out

SCOPES = ("token", "sequence")


@dataclass(frozen=True)
class AndersonConfig:
    """``m``: history (0: plain); ``beta``: damping (1: none); ``lam``: Tikhonov weight relative to the Gram
    matrix's trace; ``start``: plain steps before mixing; ``scope``: "token" or "sequence"."""

    m: int = 3
    beta: float = 1.0
    lam: float = 1e-4
    start: int = 1
    scope: str = "token"

    def __post_init__(self) -> None:
        need_int("m", self.m, 0, "anderson")
        need_float("beta", self.beta, 0.0, 1.0, lo_open=True, owner="anderson")
        need_float("lam", self.lam, 0.0, owner="anderson")
        need_int("start", self.start, 1, "anderson")
        if self.scope not in SCOPES:
            raise DrcError(f"anderson: scope={self.scope!r} is not supported; use one of {', '.join(SCOPES)}")

    @property
    def label(self) -> str:
        if self.m == 0:
            return "plain" if self.beta == 1 else f"plain (beta {self.beta:g})"
        return f"anderson m={self.m} beta={self.beta:g} ({self.scope})"


PLAIN = AndersonConfig(m=0)


def anderson_weights(residuals: Tensor, lam: float) -> Tensor:
    """The mixing weights (..., h) for residuals (..., h, n): ``z / sum(z)`` with ``(G + reg I) z = 1`` in float64."""
    g = residuals.double()
    gram = g @ g.transpose(-1, -2)
    h = gram.shape[-1]
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    reg = lam * trace + 1e-30 + 1e-12 * trace.amax().clamp_min(0)
    eye = torch.eye(h, dtype=gram.dtype, device=gram.device)
    z = torch.linalg.solve(gram + reg[..., None, None] * eye, gram.new_ones(gram.shape[:-1]))
    return (z / z.sum(-1, keepdim=True)).to(residuals.dtype)


def anderson_step(xs: list[Tensor], fxs: list[Tensor], cfg: AndersonConfig) -> Tensor:
    """The next point from iterates ``xs`` and their images ``fxs`` (each (B, T, d), oldest first)."""
    if cfg.m == 0 or len(xs) < 2:
        mix_f, mix_x = fxs[-1], xs[-1]
    else:
        X, FX = torch.stack(xs, 2), torch.stack(fxs, 2)  # (B, T, h, d)
        if cfg.scope == "token":
            alpha = anderson_weights(FX - X, cfg.lam)[..., None]  # (B, T, h, 1)
        else:
            B, T, h, d = X.shape
            alpha = anderson_weights((FX - X).permute(0, 2, 1, 3).reshape(B, h, T * d), cfg.lam)[:, None, :, None]
        mix_f, mix_x = (alpha * FX).sum(2), (alpha * X).sum(2)
    return mix_f if cfg.beta == 1 else cfg.beta * mix_f + (1 - cfg.beta) * mix_x


@dataclass
class AndersonOutput:
    """After ``evals`` core evaluations: the last image f(x), its readout and ||f(x) - x|| / ||f(x)|| per token."""

    evals: int
    state: Tensor
    out: Tensor | None
    residual: Tensor


def anderson_iterate(model: RecurrentModel, idx: Tensor, max_evals: int, cfg: AndersonConfig = AndersonConfig(), *,
                     generator: torch.Generator | None = None, state: Tensor | None = None,
                     readout: str | None = "log_probs") -> Iterator[AndersonOutput]:
    """Yield an :class:`AndersonOutput` after each core evaluation 1..``max_evals``, from the s_0
    :func:`~drc_core.model.lm.iterate` draws (with :data:`PLAIN`, its states loop by loop)."""
    need_loops("max_evals", max_evals)
    if readout not in READOUTS:
        raise DrcError(f"readout={readout!r} is not supported; use logits, log_probs or None")
    e = model.embed(idx)
    x = model.initial_state(e, generator) if state is None else state
    history: deque[tuple[Tensor, Tensor]] = deque(maxlen=cfg.m + 1)  # (x, f(x)), oldest first
    for k in range(1, max_evals + 1):
        fx = model.core_step(x, e)
        residual = (fx - x).norm(dim=-1) / fx.norm(dim=-1).clamp_min(1e-12)
        yield AndersonOutput(evals=k, state=fx, out=read_out(model, fx, readout), residual=residual)
        if k == max_evals:
            return
        if k < cfg.start:  # plain steps: no history yet
            x = fx
            continue
        history.append((x, fx))
        x = anderson_step([p[0] for p in history], [p[1] for p in history], cfg)


def evals_to_converge(kl: Tensor, eps: float) -> Tensor:
    """Per token, the first evaluation after which the successive KL (``kl`` (..., K-1), for k = 2..K) stays below
    ``eps``, as in :func:`drc_core.analysis.measure.convergence_depth`."""
    above = ~(kl.double() < eps)
    n = above.shape[-1]
    last = (n - 1) - above.flip(-1).int().argmax(-1)
    return torch.where(above.any(-1), last + 2, torch.ones_like(last))
