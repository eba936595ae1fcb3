"""Does per-token halting make generation faster at batch > 1? The dense decoder at depth r, the step-synchronous
``generate`` and continuous depth batching (``generate_continuous``) side by side (:func:`time_decoders`), their
targets, and request latency behind a fixed number of slots (:func:`serving_latency`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from torch import Tensor

import drc_core
from drc_book.cost import Log, interleaved, median
from drc_book.decode_speed import decode_setup, time_decoding
from drc_book.speed import RuleSpec, SpeedConfig
from drc_core import DepthRecurrentLM, HaltingRule, generate_continuous
from drc_core import generate_ids as generate

__all__ = ["PATHS", "decoder_targets", "serving_latency", "time_decoders"]

PATHS = ("dense decode", "generate", "continuous")
TARGET_REALIZATION = 0.9  # the state rules realize >= 0.9 of their honest-FLOP speed-up at batch 8 and 32
TARGET_OVERHEAD = 1.05  # continuous batching at equal depth costs <= 1.05x the dense decoder


def time_decoders(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                  cfg: SpeedConfig | None = None, *, batches: Sequence[int] = (1, 8, 32), log: Log = None
                  ) -> pd.DataFrame:
    """One row per (batch, rule, path): greedy decoding after the first B prompts (B in ``batches``) by the
    dense decoder, ``generate`` and ``generate_continuous`` with ``Uniform(r)`` and each rule: ``avg_loops``,
    ``ms_per_step``, ``tokens_per_s``, ``x_dense`` (speed-up over the dense decoder), ``honest_flops``,
    ``flop_speedup``, ``realization`` (x_dense / flop_speedup), ``same_as_generate``, ``spread`` and ``steps``
    (:func:`~drc_book.decode_speed.time_decoding`)."""
    return time_decoding(model, prompt, rules, cfg, batches=batches, log=log).decoders


def decoder_targets(table: pd.DataFrame, state_families: Sequence[str] | None = None,
                    batches: Sequence[int] = (8, 32)) -> pd.DataFrame:
    """The targets on a :func:`time_decoders` table: at each batch of ``batches``, (1) every state rule's continuous
    decoder beats the dense decoder (``x_dense`` > 1) and (2) realizes >= 0.9 of its honest-FLOP speed-up, and (3)
    continuous batching at equal depth (``Uniform(r)``) costs <= 1.05x the dense decoder. One row per check with
    the measured ``value``, the ``target`` and ``met``. ``state_families``: default :func:`drc_core.state_families`."""
    state_families = drc_core.state_families() if state_families is None else state_families
    out = []
    cont = table[table.path == "continuous"]
    for b in batches:
        at = cont[cont.batch == b]
        for fam in state_families:
            for _, row in at[at.family == fam].iterrows():
                out.append({"batch": b, "check": f"{row.rule}: faster than the dense decoder", "value": row.x_dense,
                            "target": "> 1", "met": bool(row.x_dense > 1)})
                out.append({"batch": b, "check": f"{row.rule}: realization", "value": row.realization,
                            "target": f">= {TARGET_REALIZATION}", "met": bool(row.realization >= TARGET_REALIZATION)})
        for _, row in at[at.family == "uniform"].iterrows():
            cost = 1 / row.x_dense
            out.append({"batch": b, "check": "continuous at equal depth: time / dense decoder", "value": cost,
                        "target": f"<= {TARGET_OVERHEAD}", "met": bool(cost <= TARGET_OVERHEAD)})
    return pd.DataFrame(out)


def serving_latency(model: DepthRecurrentLM, prompt: Tensor, rule: HaltingRule, *, slots: int,
                    new_tokens: Sequence[int], cfg: SpeedConfig | None = None, log: Log = None) -> pd.DataFrame:
    """Requests (the prompts of ``prompt``, request i asking for ``new_tokens[i % len(new_tokens)]`` tokens) all
    arrive at once and are served ``slots`` at a time: by continuous depth batching (a slot freed by a finished
    request takes the next one) and by step-synchronous ``generate`` (batches of ``slots`` requests, each batch
    generating its longest request's length). One row per path with per-request latency percentiles (``p50``,
    ``p90``, ``p99``, seconds to the request's last token), ``seconds`` (all requests) and ``tokens_per_s`` (new
    tokens asked for, per second); medians over ``cfg.rounds`` interleaved rounds."""
    cfg = cfg or SpeedConfig()
    n_max = max(new_tokens)
    prompt, s0 = decode_setup(model, prompt, replace(cfg, new_tokens=n_max))
    n_req, t0 = prompt.shape
    asks = [new_tokens[i % len(new_tokens)] for i in range(n_req)]
    states = [s0[i, : t0 + asks[i]] for i in range(n_req)]
    latencies: dict[str, list[list[float]]] = {"continuous": [], "generate": []}

    def continuous() -> None:
        res = generate_continuous(model, list(prompt), asks, rule, slots=slots, states=states, keep_logits=False)
        latencies["continuous"].append([c.finished for c in res.completions])

    def batched() -> None:
        done: list[float] = []
        t_start = time.perf_counter()
        for i in range(0, n_req, slots):
            n = max(asks[i : i + slots])
            generate(model, prompt[i : i + slots], n, rule, state=s0[i : i + slots, : t0 + n], fused=cfg.fused)
            done += [time.perf_counter() - t_start] * len(asks[i : i + slots])
        latencies["generate"].append(done)

    with torch.inference_mode():
        model.eval()
        continuous()
        batched()  # warm-up
        for v in latencies.values():
            v.clear()
        times = interleaved({"continuous": continuous, "generate": batched}, cfg.rounds, log, "serving", cfg.clock)
    rows = []
    for path, lat in latencies.items():
        arr = np.median(np.array(lat), axis=0)  # per request, median over rounds
        sec = median(times[path])
        rows.append({"path": path, "rule": str(rule), "slots": slots, "requests": n_req, "seconds": sec,
                     "tokens_per_s": sum(asks) / sec,
                     **{f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}})
    return pd.DataFrame(rows)
