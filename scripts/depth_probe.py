"""Answer accuracy of a known-depth probe by (family, k) and loop: the number a probe run is judged by.

    .venv/bin/python scripts/depth_probe.py runs/links data/corpus/links            # newest checkpoint (or final/)
    .venv/bin/python scripts/depth_probe.py runs/links data/corpus/links --docs 300 --loops 1,2,4,8,16 --copy
    .venv/bin/python scripts/depth_probe.py data/known-depth data/corpus/links33d --on data/corpus/links33

Reads the corpus's validation task documents (``--docs`` of them, drawn with ``--seed``), runs the model once to
the deepest loop asked and prints the share of answers whose argmax is right at each loop (``accuracy_by_k``),
with the number of answers per k and a 95% interval over documents at the deepest loop asked; ``--copy`` adds
in-context copying (the ``repeats`` paragraphs), the step every lookup builds on; ``--on`` reads the task
documents of another corpus prepared with the same tokenizer (e.g. the same problems asked in another order).
Uses one thread unless ``--threads`` says otherwise, so that it can run beside a training run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from drc_book.known_depth import (
    accuracy_by_k,
    answer_trajectories,
    copy_accuracy,
    corpus_task_windows,
)
from drc_core.api import load
from drc_core.data.sampler import Corpus
from drc_core.errors import DrcError, run_cli


def newest(run: Path) -> Path:
    """``final/`` when the run finished, else its newest checkpoint."""
    if (run / "final").is_dir():
        return run / "final"
    found = sorted((run / "checkpoints").glob("step-*")) if (run / "checkpoints").is_dir() else []
    if not found:
        raise DrcError(f"'{run}' has no final/ and no checkpoint yet: wait for its first checkpoint")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a training run directory (or a shipped model)")
    ap.add_argument("corpus", type=Path, help="the prepared corpus it trains on (with depth-task labels)")
    ap.add_argument("--docs", type=int, default=150)
    ap.add_argument("--loops", default="1,2,4,8")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--boot", type=int, default=200, help="bootstrap resamples (documents) of the intervals")
    ap.add_argument("--copy", action="store_true", help="also measure in-context copying")
    ap.add_argument("--on", type=Path, default=None,
                    help="measure on this corpus's task documents instead (prepared with the same tokenizer)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loops = [int(x) for x in args.loops.split(",")]
    path = newest(args.run) if (args.run / "checkpoints").is_dir() or (args.run / "final").is_dir() else args.run
    m = load(path, corpus=args.corpus)
    trained = Corpus.open(args.corpus)
    on = trained if args.on is None else Corpus.open(args.on)
    if on.tokenizer_hash != trained.tokenizer_hash:
        raise DrcError(f"corpus '{args.on}' has another tokenizer than '{args.corpus}': prepare it with "
                       f"--tokenizer {args.corpus}")
    tw = corpus_task_windows(on, m.model.max_seq_len, n_docs=args.docs, split="val",
                             seed=args.seed)
    traj = answer_trajectories(m.model, tw, max(loops))
    acc = accuracy_by_k(traj, by=("family", "k"), n_boot=args.boot, loops=loops)
    table = acc.pivot(index=["family", "k"], columns="loop", values="acc")
    table["answers"] = acc.groupby(["family", "k"])["n"].first()
    table["last 95% CI"] = [f"[{lo:.3f}, {hi:.3f}]" for lo, hi in
                            acc[acc.loop == loops[-1]][["acc_lo", "acc_hi"]].itertuples(index=False)]
    print(f"{path}: answer accuracy by loop ({len(tw.windows)} documents of {args.on or args.corpus})")
    print(table.round(3).to_string())
    if args.copy:
        print(copy_accuracy(m.model, m.tokenizer, loops, docs=24).round(3).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
