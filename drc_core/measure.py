"""Per-loop convergence measurements (this module grows into the full per-token study, issue C).

Direction convention, used everywhere in this project: the successive-output KL at loop l is
``KL(p_l || p_{l-1}) = sum_v p_l(v) (log p_l(v) - log p_{l-1}(v))``, the new output measured against the
previous one; it is defined for l >= 2.
"""

from __future__ import annotations

import torch

from drc_core.evaluate import EVAL_STATE_SEED
from drc_core.model import DepthRecurrentLM


def kl_successive(logp_new: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """KL(p_new || p_old) over the last axis, from log-probabilities; shape = input shape minus the last."""
    return (logp_new.exp() * (logp_new - logp_old)).sum(-1)


@torch.no_grad()
def mean_successive_kl(model: DepthRecurrentLM, windows: torch.Tensor, max_loops: int = 32,
                       batch_size: int = 16, seed: int = EVAL_STATE_SEED) -> dict[int, float]:
    """Mean over tokens of KL(p_l || p_{l-1}) for l = 2..max_loops, one ``iterate`` pass per batch."""
    sums = dict.fromkeys(range(2, max_loops + 1), 0.0)
    count = 0
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for start in range(0, len(windows), batch_size):
        x = windows[start : start + batch_size, :-1].to(device)
        prev = None
        for out in model.iterate(x, max_loops, generator=gen, readout="log_probs"):
            if prev is not None:
                sums[out.loop] += float(kl_successive(out.out, prev).sum())
            prev = out.out
        count += x.numel()
    model.train(was_training)
    return {n: s / count for n, s in sums.items()}
