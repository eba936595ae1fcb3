"""Validation loss and mean successive KL at uniform depths (one ``iterate`` pass per batch), per-source bits per
byte, the depth gain during training; ``python -m drc_core.training.evaluate --run DIR --data DIR``."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from drc_core.data.sampler import Corpus, eval_windows
from drc_core.errors import ArgumentParser, DrcError, need_loops, run_cli
from drc_core.guard import owned_file, write_owned_json
from drc_core.model.lm import RecurrentModel, iterate
from drc_core.model.passes import EVAL_STATE_SEED, eval_batches, kl_successive
from drc_core.training.rundir import open_run


def loss_by_depth(model: RecurrentModel, windows: torch.Tensor, loops: tuple[int, ...] | list[int],
                  batch_size: int = 16, seed: int = EVAL_STATE_SEED) -> dict[int, float]:
    """Mean next-token cross-entropy (nats) at each depth in ``loops`` over ``windows`` (N, T+1), from one pass."""
    if not (wanted := sorted({need_loops("loops", n) for n in loops})):
        raise DrcError("loops is empty: pass the depths to evaluate, e.g. [1, 4, 8]")
    totals = dict.fromkeys(wanted, 0.0)
    count = 0
    for batch in eval_batches(model, windows, batch_size, seed):
        for out in iterate(model, batch.x, wanted[-1], generator=batch.generator, readout=None):
            if out.loop in totals:  # read out only the depths asked for (the same numbers as forward)
                logits = model.readout(out.state)
                ce = F.cross_entropy(logits.float().flatten(0, 1), batch.y.flatten(), reduction="sum")
                totals[out.loop] += float(ce)
        count += batch.y.numel()
    return {n: totals[n] / count for n in wanted}


def mean_successive_kl(model: RecurrentModel, windows: torch.Tensor, max_loops: int = 32,
                       batch_size: int = 16, seed: int = EVAL_STATE_SEED) -> dict[int, float]:
    """Mean over tokens of KL(p_l || p_{l-1}) for l = 2..max_loops, one ``iterate`` pass per batch."""
    sums = dict.fromkeys(range(2, need_loops("max_loops", max_loops) + 1), 0.0)
    count = 0
    for batch in eval_batches(model, windows, batch_size, seed):
        prev = None
        for out in iterate(model, batch.x, max_loops, generator=batch.generator, readout="log_probs"):
            if prev is not None:
                sums[out.loop] += float(kl_successive(out.out, prev).sum())
            prev = out.out
        count += batch.x.numel()
    return {n: s / count for n, s in sums.items()}


def unigram_loss(corpus: Corpus, alpha: float = 1.0) -> float:
    """Cross-entropy (nats/token) of the validation split under the training split's add-``alpha`` unigram."""
    counts = np.bincount(np.asarray(corpus.tokens("train")), minlength=corpus.vocab_size).astype(np.float64)
    logp = np.log((counts + alpha) / (counts.sum() + alpha * len(counts)))
    return float(-logp[np.asarray(corpus.tokens("val"))].mean())


def loss_by_source(model: RecurrentModel, corpus: Corpus, seq_len: int, loops: tuple[int, ...],
                   max_windows: int | None = None) -> pd.DataFrame:
    """Validation loss by source (windows never span two) and depth, in nats/token and bits/byte."""
    val = corpus.tokens("val")
    rows = []
    for src, g in corpus.docs[corpus.docs.split == "val"].groupby("source", sort=True):
        toks = np.concatenate([val[a:b] for a, b in zip(g.tok_start, g.tok_end, strict=True)])
        windows = eval_windows(toks, seq_len, max_windows)
        tokens_per_byte = float((g.tok_end - g.tok_start).sum()) / float(g.n_bytes.sum())
        for n, ce in loss_by_depth(model, windows, loops).items():
            rows.append({"source": str(src), "loops": n, "loss": ce,
                         "bits_per_byte": ce * tokens_per_byte / math.log(2), "windows": len(windows)})
    return pd.DataFrame(rows)


def parse_loops(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4), each count checked; anything else is a one-line :class:`DrcError`."""
    try:
        loops = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise DrcError(f"--loops {text!r} is not a comma-separated list of loop counts: e.g. --loops 1,4,8") from None
    if not loops:
        raise DrcError(f"--loops {text!r} names no loop count: e.g. --loops 1,4,8")
    return tuple(need_loops("--loops", n) for n in loops)


EVAL_WRITER = "drc_core.training.evaluate"  # the owner mark of the --json files it writes
EVAL_KEYS = frozenset({"run", "params", "unigram_loss", "loss_all", "by_source", "successive_kl"})  # before the mark


def main(argv: list[str] | None = None) -> int:
    """``python -m drc_core.training.evaluate --run DIR --data DIR``: loss by depth (per source) and successive KL."""
    ap = ArgumentParser(prog="python -m drc_core.training.evaluate", description=main.__doc__)
    ap.add_argument("--run", required=True,
                    help="a training run directory (uses its final/ weights), its final/, or a shipped copy")
    ap.add_argument("--data", required=True, help="the prepared corpus the run was trained on")
    ap.add_argument("--loops", default="1,2,4,8,16,32")
    ap.add_argument("--windows", type=int, default=128, help="validation windows per source")
    ap.add_argument("--json", default=None,
                    help="also write the results to this file (a new file, or one an earlier evaluate wrote)")
    args = ap.parse_args(argv)
    loops = parse_loops(args.loops)  # every argument is checked before anything is loaded
    if args.windows < 1:
        raise DrcError(f"--windows {args.windows} must be >= 1")
    if args.json:
        owned_file(args.json, EVAL_WRITER, "--json", EVAL_KEYS)  # never replaces a file evaluate did not write
    run = open_run(args.run)
    corpus = Corpus.open(args.data)
    run.check_corpus(corpus)
    model = run.load_model()
    seq_len = run.train_config().seq_len  # the windows it was trained on; no default
    frame = loss_by_source(model, corpus, seq_len, loops, args.windows)
    windows = eval_windows(corpus.tokens("val"), seq_len, args.windows)
    result = {"run": str(run.path), "params": model.num_params(), "unigram_loss": unigram_loss(corpus),
              "loss_all": loss_by_depth(model, windows, loops), "by_source": frame.to_dict(orient="records"),
              "successive_kl": mean_successive_kl(model, windows, max(loops))}
    print(frame.pivot(index="loops", columns="source", values=["loss", "bits_per_byte"]).round(4).to_string())
    print(f"unigram baseline (train unigram on val): {result['unigram_loss']:.4f} nats/token")
    kl = result["successive_kl"]
    print("successive KL(p_l || p_l-1): " + "  ".join(f"{n}:{kl[n]:.2e}" for n in (2, 4, 8, 16, 32) if n in kl))
    if args.json:
        write_owned_json(args.json, result, EVAL_WRITER, EVAL_KEYS)
    print(json.dumps({"loss_all": result["loss_all"]}))
    return 0


def depth_gain_by_step(metrics: pd.DataFrame, shallow: int = 1, deep: int = 8) -> pd.DataFrame:
    """Per evaluated step of ``metrics.jsonl``, the loss at ``shallow`` and ``deep`` loops and their difference."""
    if "kind" not in metrics.columns or not {"step", "loops", "loss"} <= set(metrics.columns):
        raise DrcError("metrics needs kind/step/loops/loss columns: pass metrics.jsonl read with pandas.read_json")
    evals = metrics[metrics.kind == "eval"]
    wide = evals.pivot_table(index="step", columns="loops", values="loss", aggfunc="last")
    if missing := [d for d in (shallow, deep) if d not in wide.columns]:
        raise DrcError(f"no validation rows at {missing} loops; the run evaluated {sorted(wide.columns.tolist())}")
    out = pd.DataFrame({f"loss_{shallow}": wide[shallow], f"loss_{deep}": wide[deep]}).dropna()
    out["gain"] = out[f"loss_{shallow}"] - out[f"loss_{deep}"]
    return out.reset_index()


if __name__ == "__main__":
    sys.exit(run_cli(main))
