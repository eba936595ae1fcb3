"""Learned halting routers, the trained baseline the paper compares the KL rule with: :func:`train_router` fits a
:class:`LinearRouter` or :class:`MLPRouter` on :func:`harvest`'s features and convergence labels (``l >= D``, D the
convergence depth; :mod:`~drc_core.halting.router_data`, re-exported here); :class:`RouterRule` halts when the
router's probability >= ``tau``, evaluated like every other rule."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from scipy.stats import mannwhitneyu
from torch import Tensor, nn

from drc_core.analysis.loops import LoopStats
from drc_core.analysis.measure import DEFAULT_EPS
from drc_core.errors import DrcError, need_float, need_int
from drc_core.halting.router_data import FeatureSpec, RouterData, harvest, harvest_specs, router_features, split_windows
from drc_core.halting.rules import HaltingRule, rule_classes
from drc_core.halting.sweep import RuleSpec
from drc_core.model.lm import RecurrentModel

__all__ = ["FeatureSpec", "LinearRouter", "MLPRouter", "Router", "RouterData", "RouterRule", "TrainLog", "harvest",
           "harvest_specs", "load_router", "family_title", "router_features", "router_metrics", "save_router",
           "split_windows", "train_router"]

ROUTER_CONFIG_FILE = "router.json"
ROUTER_WEIGHTS_FILE = "router.safetensors"


class Router(nn.Module):
    """Base class: one logit per row of the standardised input ``(x - mean) / std``; ``spec`` (the
    :class:`FeatureSpec` it reads) and ``info`` are set by :func:`train_router`."""

    kind = "router"
    title = "router"  # the family in words (family_title)

    def __init__(self, d_in: int) -> None:
        super().__init__()
        self.d_in = need_int("d_in", d_in, 1, type(self).__name__)
        self.register_buffer("mean", torch.zeros(self.d_in))
        self.register_buffer("std", torch.ones(self.d_in))
        self.spec: FeatureSpec | None = None
        self.info: dict[str, object] = {}

    def net(self, z: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """Logits (...,) of features (..., d_in)."""
        if x.shape[-1] != self.d_in:
            raise DrcError(f"{type(self).__name__}: got {x.shape[-1]} features but the router reads {self.d_in}")
        z = (x.to(self.mean.dtype) - self.mean) / self.std
        return self.net(z).squeeze(-1)

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        """P(converged) (...,) of features (..., d_in)."""
        return torch.sigmoid(self(x))

    def config(self) -> dict[str, object]:
        return {"kind": self.kind, "d_in": self.d_in}


class LinearRouter(Router):
    """Logistic regression on the standardised features: one Linear(d_in -> 1) and a sigmoid."""

    kind, title = "linear", "linear router"

    def __init__(self, d_in: int) -> None:
        super().__init__(d_in)
        self.linear = nn.Linear(self.d_in, 1)

    def net(self, z: Tensor) -> Tensor:
        return self.linear(z)


class MLPRouter(Router):
    """A one-hidden-layer MLP on the standardised features: Linear(d_in -> hidden), GELU, Linear(hidden -> 1)."""

    kind, title = "mlp", "MLP router"

    def __init__(self, d_in: int, hidden: int = 64) -> None:
        super().__init__(d_in)
        self.hidden = need_int("hidden", hidden, 1, "MLPRouter")
        self.layers = nn.Sequential(nn.Linear(self.d_in, self.hidden), nn.GELU(), nn.Linear(self.hidden, 1))

    def net(self, z: Tensor) -> Tensor:
        return self.layers(z)

    def config(self) -> dict[str, object]:
        return {**super().config(), "hidden": self.hidden}


_KINDS: dict[str, type[Router]] = {cls.kind: cls for cls in (LinearRouter, MLPRouter)}


def family_title(family: str) -> str:
    """A family of the sweeps in words: a rule's or router's ``title``, else the family with "_" read as " "."""
    kind = family.removeprefix("router_")
    if family.startswith("router_") and kind in _KINDS:
        return _KINDS[kind].title
    return next((c.title for c in rule_classes().values() if c.family == family and c.title), family.replace("_", " "))


@dataclass
class TrainLog:
    """What :func:`train_router` returns: per-epoch training and validation loss, the epoch kept (1-based), sizes."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    best_epoch: int = 0
    best_val_loss: float = math.nan
    stopped_early: bool = False
    pos_weight: float = 1.0
    n_train: int = 0
    n_val: int = 0

    @property
    def epochs_run(self) -> int:
        return len(self.train_loss)


def train_router(router: Router, data: RouterData, *, epochs: int = 50, lr: float = 1e-2, weight_decay: float = 0.0,
                 batch_size: int = 1024, seed: int = 0, val_fraction: float = 0.2, patience: int = 5) -> TrainLog:
    """Fit ``router`` in place on ``data`` (AdamW, BCE with ``pos_weight = n_negative / n_positive``, features
    standardised on the training part). ``seed`` re-initialises the router and draws the validation part (of the
    windows) and the batch order; training stops after ``patience`` epochs without a lower validation loss,
    keeping the best epoch's weights (``val_fraction=0``: all epochs, the last weights)."""
    owner = "train_router"
    if not isinstance(router, Router):
        raise DrcError(f"{owner}: router={router!r} is not a Router; pass LinearRouter(d) or MLPRouter(d)")
    if not isinstance(data, RouterData) or len(data) == 0:
        raise DrcError(f"{owner}: data is empty; harvest some windows first (harvest(model, windows, ...))")
    if data.n_features != router.d_in:
        raise DrcError(f"{owner}: data has {data.n_features} features but the router reads {router.d_in}")
    epochs = need_int("epochs", epochs, 1, owner)
    lr = need_float("lr", lr, 0.0, lo_open=True, owner=owner)
    weight_decay = need_float("weight_decay", weight_decay, 0.0, owner=owner)
    batch_size = need_int("batch_size", batch_size, 1, owner)
    val_fraction = need_float("val_fraction", val_fraction, 0.0, 1.0, hi_open=True, owner=owner)
    patience = need_int("patience", patience, 1, owner)
    if len(data) < 2 and val_fraction > 0:
        raise DrcError(f"{owner}: data has 1 row; pass more rows or val_fraction=0")

    # the validation rows: whole windows when there are >= 2, else single rows
    win = data.window.numpy()
    uniq = np.unique(win)
    if len(uniq) < 2:
        win = uniq = np.arange(len(data))
    n_val = min(max(round(val_fraction * len(uniq)), 1), len(uniq) - 1) if val_fraction else 0
    val_mask = torch.from_numpy(np.isin(win, np.random.default_rng(seed).permutation(uniq)[:n_val]))
    x_tr, y_tr = data.features[~val_mask].float(), data.labels[~val_mask].float()
    x_va, y_va = data.features[val_mask].float(), data.labels[val_mask].float()
    n_pos = int(y_tr.sum())
    n_neg = len(y_tr) - n_pos
    if n_pos == 0 or n_neg == 0:
        which = "converged" if n_neg == 0 else "not converged"
        raise DrcError(f"{owner}: every training label is {which!r}; use another eps or more loops so both classes "
                       "occur")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in router.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    device = router.mean.device
    with torch.no_grad():
        router.mean.copy_(x_tr.mean(0))
        router.std.copy_(x_tr.std(0, unbiased=False).clamp_min(1e-6))
    router.spec = data.spec
    router.info = {"eps": data.eps, "max_loops": data.max_loops, "n_train_rows": len(y_tr),
                   "positive_rate": n_pos / len(y_tr)}
    pos_weight = torch.tensor(n_neg / n_pos, device=device)
    x_tr, y_tr, x_va, y_va = (t.to(device) for t in (x_tr, y_tr, x_va, y_va))
    opt = torch.optim.AdamW(router.parameters(), lr=lr, weight_decay=weight_decay)
    log = TrainLog(pos_weight=float(pos_weight), n_train=len(y_tr), n_val=len(y_va))
    gen = torch.Generator().manual_seed(seed)
    best_state, since_best = None, 0
    router.train()
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(y_tr), generator=gen).to(device)
        total = 0.0
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            loss = F.binary_cross_entropy_with_logits(router(x_tr[idx]), y_tr[idx], pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        log.train_loss.append(total / len(y_tr))
        if len(y_va) == 0:
            log.val_loss.append(math.nan)
            log.best_epoch = epoch
            continue
        with torch.no_grad():
            val = float(F.binary_cross_entropy_with_logits(router(x_va), y_va, pos_weight=pos_weight))
        log.val_loss.append(val)
        if best_state is None or val < log.best_val_loss:
            log.best_val_loss, log.best_epoch, since_best = val, epoch, 0
            best_state = copy.deepcopy(router.state_dict())
        else:
            since_best += 1
            if since_best >= patience:
                log.stopped_early = epoch < epochs
                break
    if best_state is not None:
        router.load_state_dict(best_state)
    router.eval()
    return log


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC: the Mann-Whitney U of the positives over n_pos * n_neg (ties count half); NaN with one class."""
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    return float(mannwhitneyu(scores[labels], scores[~labels]).statistic / (n_pos * n_neg))


@torch.no_grad()
def router_metrics(router: Router, data: RouterData, tau: float = 0.5) -> dict[str, float]:
    """Classification quality of ``router`` on ``data`` at threshold ``tau`` (accuracy, balanced accuracy, AUC) and
    the baselines ``majority_accuracy``, ``chance_balanced_accuracy`` = ``chance_auc`` = 0.5."""
    if not isinstance(data, RouterData) or len(data) == 0:
        raise DrcError("router_metrics: data is empty; pass harvested rows (harvest(model, windows, ...))")
    tau = need_float("tau", tau, 0.0, 1.0, lo_open=True, hi_open=True, owner="router_metrics")
    device = router.mean.device
    was_training = router.training
    router.eval()
    logits = torch.cat([router(data.features[i : i + 65536].to(device)).cpu()
                        for i in range(0, len(data), 65536)]).double().numpy()
    router.train(was_training)
    y = data.labels.numpy().astype(bool)
    pred = logits >= math.log(tau / (1.0 - tau))
    pos_rate = float(y.mean())
    tpr = float(pred[y].mean()) if y.any() else math.nan
    tnr = float((~pred[~y]).mean()) if (~y).any() else math.nan
    return {
        "n": float(len(y)),
        "positive_rate": pos_rate,
        "predicted_positive_rate": float(pred.mean()),
        "accuracy": float((pred == y).mean()),
        "balanced_accuracy": (tpr + tnr) / 2.0,
        "auc": _auc(logits, y),
        "majority_accuracy": max(pos_rate, 1.0 - pos_rate),
        "chance_balanced_accuracy": 0.5,
        "chance_auc": 0.5,
    }


@dataclass(eq=False)
class RouterRule(HaltingRule):
    """Halt once the router's P(converged) >= ``tau`` in (0, 1) on the loop's :func:`router_features` (tested on
    the logit, ``logit >= log(tau / (1 - tau))``, which does not saturate)."""

    router: Router
    tau: float = 0.5

    def _validate(self, owner: str) -> None:
        if not isinstance(self.router, Router):
            raise DrcError(f"{owner}: router={self.router!r} is not a Router; pass a trained LinearRouter/MLPRouter")
        if self.router.spec is None:
            raise DrcError(f"{owner}: the router has no feature spec; train it with train_router or load_router")
        self.tau = need_float("tau", self.tau, 0.0, 1.0, lo_open=True, hi_open=True, owner=owner)

    def logits(self, stats: LoopStats) -> Tensor:
        """The router's logits (B, T) at this loop."""
        assert self.router.spec is not None
        feats = router_features(stats, self.router.spec)
        was_training = self.router.training
        self.router.eval()
        with torch.no_grad():
            out = self.router(feats.to(self.router.mean.device))
        self.router.train(was_training)
        return out.to(stats.state.device)

    def criterion(self, stats: LoopStats) -> Tensor:
        return self.logits(stats) >= math.log(self.tau / (1.0 - self.tau))

    @property
    def name(self) -> str:
        return f"router-{self.router.kind}>={self.tau:g}"


def save_router(router: Router, path_dir: str | Path) -> Path:
    """Write ``router.safetensors`` (weights, mean, std) and ``router.json`` (kind, sizes, spec, info)."""
    if not isinstance(router, Router):
        raise DrcError(f"save_router: router={router!r} is not a Router")
    path = Path(path_dir)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in router.state_dict().items()},
              str(path / ROUTER_WEIGHTS_FILE))
    config = {**router.config(), "spec": None if router.spec is None else router.spec.to_dict(), "info": router.info}
    (path / ROUTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path


def load_router(path_dir: str | Path, map_location: str | torch.device = "cpu") -> Router:
    """Rebuild a router written by :func:`save_router` (in eval mode)."""
    path = Path(path_dir)
    cfg_path, w_path = path / ROUTER_CONFIG_FILE, path / ROUTER_WEIGHTS_FILE
    if not cfg_path.is_file() or not w_path.is_file():
        raise DrcError(f"{path} lacks {ROUTER_CONFIG_FILE} or {ROUTER_WEIGHTS_FILE}; pass a save_router directory")
    cfg = json.loads(cfg_path.read_text())
    kind = cfg.get("kind")
    if kind not in _KINDS:
        raise DrcError(f"{cfg_path}: kind={kind!r} is not supported; use one of {tuple(_KINDS)}")
    missing = [k for k in ("d_in", *(("hidden",) if kind == "mlp" else ())) if k not in cfg]
    if missing:
        raise DrcError(f"{cfg_path} lacks {missing[0]!r}; pass a directory written by save_router")
    router = LinearRouter(cfg["d_in"]) if kind == "linear" else MLPRouter(cfg["d_in"], cfg["hidden"])
    router.load_state_dict(load_file(str(w_path)), strict=True)
    router.spec = None if cfg.get("spec") is None else FeatureSpec.from_dict(cfg["spec"])
    router.info = dict(cfg.get("info") or {})
    return router.to(map_location).eval()


ROUTER_TAUS = (0.3, 0.5, 0.7, 0.9, 0.97, 0.99)


def trained_router_specs(model: RecurrentModel, windows: Tensor, max_loops: int, eps: float = DEFAULT_EPS, *,
                         positions: int | None = 64, seed: int = 0,
                         taus: Sequence[float] = ROUTER_TAUS) -> tuple[list, dict[str, dict[str, float]]]:
    """The book's two routers trained on ``windows``: ``linear`` on the state (the paper's), ``mlp`` (64 hidden) on
    the state, loop one-hot and readout statistics; their sweep points (one per ``tau``) and metrics."""
    specs, metrics = [], {}
    kinds = [("linear", LinearRouter, FeatureSpec(max_loops=max_loops)),
             ("mlp", lambda d: MLPRouter(d, hidden=64), FeatureSpec(loop="onehot", readout_stats=True,
                                                                    max_loops=max_loops))]
    harvested = harvest_specs(model, windows, [spec for _, _, spec in kinds], max_loops, eps, positions=positions)
    for (kind, make, _), data in zip(kinds, harvested, strict=True):
        router = make(data.n_features)
        train_router(router, data, seed=seed)
        metrics[kind] = {"rows": len(data), "positive_rate": data.positive_rate, **router_metrics(router, data)}
        specs += [RuleSpec(f"router_{kind}", tau, RouterRule(router=router, tau=tau, max_loops=max_loops))
                  for tau in taus]
    return specs, metrics
