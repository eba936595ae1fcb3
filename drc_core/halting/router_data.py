"""What a learned halting router learns from: its features (:class:`FeatureSpec`, :func:`router_features`, the same
in training and deployment), the per-token, per-loop examples and convergence labels of a uniform-depth run
(:func:`harvest`, :class:`RouterData`) and the split of the windows (:func:`split_windows`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
from torch import Tensor

from drc_core.analysis.loops import LoopStats, iterate_stats
from drc_core.analysis.measure import DEFAULT_EPS, depth_from_successive_kl
from drc_core.errors import DrcError, need_float, need_int
from drc_core.model.checks import check_token_ids
from drc_core.model.lm import RecurrentModel
from drc_core.model.passes import EVAL_STATE_SEED, eval_batches

__all__ = ["FeatureSpec", "RouterData", "harvest", "harvest_specs", "router_features", "split_windows"]

_LOOP_FEATURES = ("none", "scalar", "onehot")
_READOUT_STATS = frozenset({"entropy", "top_prob", "kl", "state_delta", "cosine"})  # router_features' order below
_LOG_CLAMP = (-12.0, 4.0)


@dataclass(frozen=True)
class FeatureSpec:
    """Which features a router reads at loop l: ``state`` s_l; ``loop``: "none", "scalar" (l) or "onehot" (over
    1..``max_loops``); ``readout_stats``: entropy, top probability, log10 KL, log10 state change, cosine."""

    state: bool = True
    loop: str = "none"
    readout_stats: bool = False
    max_loops: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.state, bool) or not isinstance(self.readout_stats, bool):
            raise DrcError("FeatureSpec: state and readout_stats must be true or false")
        if self.loop not in _LOOP_FEATURES:
            raise DrcError(f"FeatureSpec: loop={self.loop!r} is not supported; use one of {_LOOP_FEATURES}")
        need_int("max_loops", self.max_loops, 1, "FeatureSpec")
        if not (self.state or self.readout_stats or self.loop != "none"):
            raise DrcError("FeatureSpec selects no features; enable state, readout_stats or a loop feature")

    @property
    def reads(self) -> frozenset[str]:
        """The statistics these features read (the state always comes with a loop's stats)."""
        return _READOUT_STATS if self.readout_stats else frozenset()

    def dim(self, d_model: int) -> int:
        """The number of features for a model with state size ``d_model``."""
        loop = {"none": 0, "scalar": 1, "onehot": self.max_loops}[self.loop]
        return (d_model if self.state else 0) + loop + (len(_READOUT_STATS) if self.readout_stats else 0)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> FeatureSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DrcError(f"FeatureSpec: unknown key {unknown[0]!r}; use {', '.join(sorted(known))}")
        return cls(**data)  # type: ignore[arg-type]


def router_features(stats: LoopStats, spec: FeatureSpec) -> Tensor:
    """The router features (B, T, F) float32 of one loop's :class:`LoopStats` (see :class:`FeatureSpec`)."""
    parts: list[Tensor] = []
    shape, device = stats.shape, stats.state.device
    if spec.state:
        parts.append(stats.state.float())
    if spec.loop == "scalar":
        parts.append(torch.full((*shape, 1), float(stats.loop), device=device))
    elif spec.loop == "onehot":
        hot = torch.zeros((*shape, spec.max_loops), device=device)
        hot[..., min(stats.loop, spec.max_loops) - 1] = 1.0
        parts.append(hot)
    if spec.readout_stats:
        lo, hi = _LOG_CLAMP
        logs = [torch.log10(x.float().clamp_min(10.0**lo)).clamp(lo, hi) for x in (stats.kl, stats.state_delta)]
        cos = torch.nan_to_num(stats.cosine.float(), nan=-1.0, neginf=-1.0, posinf=1.0).clamp(-1.0, 1.0)
        parts.append(torch.stack([stats.entropy.float(), stats.top_prob.float(), *logs, cos], dim=-1))
    return torch.cat(parts, dim=-1)


@dataclass
class RouterData:
    """Harvested router rows, one per (window, pos, loop) in that order: ``features`` (M, F) float32, ``labels`` (M,)
    bool (``loop >= depth``, the token's convergence depth at ``eps``), and (M,) long ``loop``, ``window``, ``pos``,
    ``depth``; ``spec`` the features."""

    features: Tensor
    labels: Tensor
    loop: Tensor
    window: Tensor
    pos: Tensor
    depth: Tensor
    eps: float
    max_loops: int
    spec: FeatureSpec

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.features.shape[1])

    @property
    def positive_rate(self) -> float:
        return float(self.labels.float().mean()) if len(self) else math.nan

    def subset(self, rows: Tensor | np.ndarray) -> RouterData:
        """The rows selected by a (M,) bool mask or an index array."""
        idx = torch.as_tensor(np.asarray(rows))
        idx = (idx.nonzero().squeeze(-1) if idx.dtype == torch.bool else idx).long()
        return RouterData(self.features[idx], self.labels[idx], self.loop[idx], self.window[idx], self.pos[idx],
                          self.depth[idx], self.eps, self.max_loops, self.spec)

    def take_windows(self, windows: Sequence[int] | np.ndarray | Tensor) -> RouterData:
        """The rows of the given window ids."""
        wanted = torch.as_tensor(np.asarray(windows, dtype=np.int64))
        return self.subset(torch.isin(self.window, wanted))


def harvest(model: RecurrentModel, windows: Tensor, max_loops: int = 32, eps: float = DEFAULT_EPS, *,
            seed: int = EVAL_STATE_SEED, batch_size: int = 16, loop_feature: str = "none", readout_stats: bool = False,
            state_feature: bool = True, loops: Sequence[int] | None = None, positions: int | None = None,
            subsample_seed: int = 0) -> RouterData:
    """Router features and convergence labels of ``model`` on ``windows`` (N, T+1), from one uniform pass of
    ``max_loops`` loops per batch seeded as :func:`~drc_core.analysis.measure.measure_windows` (so the labels equal
    its convergence depth). ``loops``: the loops kept (default 1..max_loops-1); ``positions``: this many positions
    per window, drawn with the seed ``(subsample_seed, window)`` (None: all)."""
    spec = FeatureSpec(state=state_feature, loop=loop_feature, readout_stats=readout_stats,
                       max_loops=need_int("max_loops", max_loops, 2, "harvest"))
    (data,) = harvest_specs(model, windows, [spec], max_loops, eps, seed=seed, batch_size=batch_size, loops=loops,
                            positions=positions, subsample_seed=subsample_seed)
    return data


@torch.no_grad()
def harvest_specs(model: RecurrentModel, windows: Tensor, specs: Sequence[FeatureSpec], max_loops: int = 32,
                  eps: float = DEFAULT_EPS, *, seed: int = EVAL_STATE_SEED, batch_size: int = 16,
                  loops: Sequence[int] | None = None, positions: int | None = None,
                  subsample_seed: int = 0) -> list[RouterData]:
    """:func:`harvest` of several feature sets (with ``max_loops``) in one pass: one :class:`RouterData` per spec."""
    owner = "harvest"
    windows = check_token_ids(model, windows)
    max_loops = need_int("max_loops", max_loops, 2, owner)
    eps = need_float("eps", eps, 0.0, lo_open=True, owner=owner)
    batch_size = need_int("batch_size", batch_size, 1, owner)
    specs = list(specs)
    if not specs or any(not isinstance(sp, FeatureSpec) or sp.max_loops != max_loops for sp in specs):
        raise DrcError(f"{owner}: specs must be one or more FeatureSpec with max_loops={max_loops}; got {specs!r}")
    n, t_len = windows.shape[0], windows.shape[1] - 1
    if loops is None:
        keep = list(range(1, max_loops))
    else:
        keep = sorted({need_int("loops[i]", lp, 1, owner) for lp in loops})
        if not keep or keep[-1] > max_loops:
            raise DrcError(f"{owner}: loops={list(loops)!r} is invalid; pass loops within 1..{max_loops}")
    if positions is not None:
        positions = min(need_int("positions", positions, 1, owner), t_len)
    pos_idx = torch.stack([
        torch.arange(t_len) if positions is None else
        torch.from_numpy(np.sort(np.random.default_rng([subsample_seed, w]).choice(t_len, positions, replace=False)))
        for w in range(n)
    ]).long()  # (N, P)
    n_pos = pos_idx.shape[1]
    keep_set = set(keep)
    reads = frozenset({"kl"}).union(*(sp.reads for sp in specs))

    feats: list[list[Tensor]] = [[] for _ in specs]
    depths = []
    for batch in eval_batches(model, windows, batch_size, seed):
        sel = pos_idx[batch.start : batch.start + batch_size].to(batch.x.device)  # (B, P)
        kls: list[Tensor] = []
        kept: list[list[Tensor]] = [[] for _ in specs]
        for st in iterate_stats(model, batch.x, max_loops, generator=batch.generator, only=reads):
            if st.loop >= 2:
                kls.append(st.kl)
            if st.loop in keep_set:
                for sp, k in zip(specs, kept, strict=True):
                    f = router_features(st, sp)  # (B, T, F)
                    k.append(f.gather(1, sel[..., None].expand(-1, -1, f.shape[-1])).cpu())
        del st
        depth = depth_from_successive_kl(torch.stack(kls, dim=-1).cpu().numpy(), eps)  # (B, T)
        depths.append(torch.from_numpy(depth).gather(1, sel.cpu()))  # (B, P)
        for out, k in zip(feats, kept, strict=True):
            out.append(torch.stack(k, dim=2))  # (B, P, K, F)

    n_keep = len(keep)
    window = torch.arange(n).view(n, 1, 1).expand(n, n_pos, n_keep).reshape(-1)
    pos = pos_idx.view(n, n_pos, 1).expand(n, n_pos, n_keep).reshape(-1)
    loop = torch.tensor(keep).view(1, 1, n_keep).expand(n, n_pos, n_keep).reshape(-1)
    depth = torch.cat(depths).view(n, n_pos, 1).expand(n, n_pos, n_keep).reshape(-1).long()
    return [RouterData(torch.cat(f).reshape(-1, f[0].shape[-1]).float().contiguous(), loop >= depth, loop.clone(),
                       window.clone(), pos.clone(), depth.clone(), eps, max_loops, sp)
            for sp, f in zip(specs, feats, strict=True)]


def split_windows(n_windows: int, train_fraction: float = 0.5, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted index arrays ``(train, held_out)`` covering 0..n_windows-1, both non-empty, the first of
    ``round(train_fraction * n_windows)`` windows drawn by a permutation seeded with ``seed``."""
    n_windows = need_int("n_windows", n_windows, 2, "split_windows")
    train_fraction = need_float("train_fraction", train_fraction, 0.0, 1.0, lo_open=True, hi_open=True,
                                owner="split_windows")
    n_train = min(max(round(train_fraction * n_windows), 1), n_windows - 1)
    perm = np.random.default_rng(seed).permutation(n_windows)
    return np.sort(perm[:n_train]).astype(np.int64), np.sort(perm[n_train:]).astype(np.int64)
