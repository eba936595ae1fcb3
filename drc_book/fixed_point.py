"""Does Anderson acceleration reach the fixed point in fewer core evaluations than plain iteration? Every
:class:`~drc_core.AndersonConfig` (plain iteration among them) run from the same initial states on the same windows,
measured per core evaluation; wall-clock per evaluation is timed apart, without a readout."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from drc_core import (
    EVAL_STATE_SEED,
    AndersonConfig,
    RecurrentModel,
    anderson_iterate,
    eval_batches,
    evals_to_converge,
    iterate,
    kl_successive,
)
from drc_core import PLAIN_ITERATION as PLAIN


@dataclass
class FixedPointCosts:
    """``curves`` per (method, evals): ce, kl_ref, kl_prev, residual; ``depths`` per (method, eps): evaluations to
    converge (mean, median, p90) and the share converged."""

    curves: pd.DataFrame
    depths: pd.DataFrame


def fixed_point_costs(model: RecurrentModel, windows: torch.Tensor, configs: dict[str, AndersonConfig],
                      max_evals: int = 32, ref_loops: int = 64, eps: tuple[float, ...] = (1e-3, 1e-5),
                      batch_size: int = 16, seed: int = EVAL_STATE_SEED) -> FixedPointCosts:
    """Every config on ``windows`` per core evaluation: ``ce``, ``kl_ref`` (to plain iteration at ``ref_loops``),
    successive ``kl_prev`` and median relative ``residual``; per ``eps``, the evaluations to converge."""
    curves = {name: np.zeros((max_evals, 4)) for name in configs}
    depths: dict[str, list[torch.Tensor]] = {name: [] for name in configs}
    n_tokens = 0
    for batch in eval_batches(model, windows, batch_size, seed):
        start = batch.generator.get_state()
        ref = None
        for out in iterate(model, batch.x, ref_loops, generator=batch.generator, readout="log_probs"):
            ref = out.out if out.loop == ref_loops else None
        p_ref = ref.exp()
        end = batch.generator.get_state()
        y = batch.y.flatten()
        for name, cfg in configs.items():
            batch.generator.set_state(start)
            prev, kls = None, []
            for out in anderson_iterate(model, batch.x, max_evals, cfg, generator=batch.generator):
                k = out.evals - 1
                curves[name][k, 0] += float(F.nll_loss(out.out.flatten(0, 1), y, reduction="sum"))
                curves[name][k, 1] += float(kl_successive(ref, out.out, p_ref).sum())
                if prev is not None:
                    kl = kl_successive(out.out, prev)
                    kls.append(kl)
                    curves[name][k, 2] += float(kl.sum())
                curves[name][k, 3] += float(out.residual.median()) * out.residual.numel()
                prev = out.out
            depths[name].append(torch.stack(kls, -1).flatten(0, 1))
        batch.generator.set_state(end)
        n_tokens += batch.y.numel()
    rows = [{"method": name, "evals": k + 1, "ce": c[k, 0] / n_tokens, "kl_ref": c[k, 1] / n_tokens,
             "kl_prev": c[k, 2] / n_tokens if k else np.nan, "residual": c[k, 3] / n_tokens}
            for name, c in curves.items() for k in range(max_evals)]
    drows = []
    for name, kls in depths.items():
        kl = torch.cat(kls)
        for e in eps:
            d = evals_to_converge(kl, e).double()
            drows.append({"method": name, "eps": e, "mean_evals": float(d.mean()), "median_evals": float(d.median()),
                          "p90_evals": float(d.quantile(0.9)), "converged": float((d < max_evals).double().mean())})
    return FixedPointCosts(pd.DataFrame(rows), pd.DataFrame(drows))


def seconds_per_eval(model: RecurrentModel, x: torch.Tensor, cfg: AndersonConfig = PLAIN, evals: int = 16,
                     rounds: int = 3) -> float:
    """Median over ``rounds`` of the wall-clock seconds per core evaluation (prelude excluded, no readout)."""
    times = []
    with torch.no_grad():
        for _ in range(rounds):
            gen = torch.Generator(device=x.device).manual_seed(0)
            it = anderson_iterate(model, x, evals + 1, cfg, generator=gen, readout=None)
            next(it)  # the prelude and the first evaluation
            t0 = time.perf_counter()
            for _ in it:
                pass
            times.append((time.perf_counter() - t0) / evals)
    return float(np.median(times))
