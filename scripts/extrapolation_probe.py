"""Does a known-depth model answer deeper than it was trained, by looping more? Accuracy by lookups k and loop,
convergence depth against k, overthinking, and what stopping each answer by a halting rule recovers.

    .venv/bin/python -m drc_core.data prepare --source depth-tasks --tokenizer data/depth-tasks \\
        --task-families links --task-ask-every --task-min-k 1 --task-max-k 8 --task-docs 4000 \\
        --task-repeat-share 0 --seed 7 --out data/corpus/links18m          # chains of 1..8 links, shuffled questions
    .venv/bin/python scripts/extrapolation_probe.py runs/kd-extrapolate/k4mix/run data/corpus/links14m \\
        --on data/corpus/links18m --trained-k 4 --out runs/kd-extrapolate/probe.json

Reads ``--docs`` validation task documents of ``--on`` (a corpus prepared with the same tokenizer, e.g. chains of
1..8 links when the model trained on 1..4), runs the model once to the deepest loop asked (``--loops``, up to 4x
the training mean) and reports, per k: accuracy at each loop with a 95% interval over documents, the best loop and
its accuracy, the mean convergence depth, Spearman(k, convergence depth) over all k with a document-bootstrap
interval, the share of answers right at some loop and wrong at the last (overthought), and accuracy when each
answer stops at its own exit under the KL rule (offline, from the same trajectories) against the deepest loop.
Writes the numbers as JSON to ``--out``. One thread unless ``--threads`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from drc_book.known_depth import answer_trajectories, corpus_task_windows, extrapolation_probe
from drc_core import Corpus, DrcError, load, run_cli


def newest(run: Path) -> Path:
    """``final/`` when the run finished, else its newest checkpoint, else ``run`` itself (a shipped model)."""
    if (run / "final").is_dir():
        return run / "final"
    found = sorted((run / "checkpoints").glob("step-*")) if (run / "checkpoints").is_dir() else []
    return found[-1] if found else run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a training run directory (its newest checkpoint) or a shipped model")
    ap.add_argument("corpus", type=Path, help="the corpus the model trained on (its tokenizer)")
    ap.add_argument("--on", type=Path, required=True, help="the corpus whose task documents are measured")
    ap.add_argument("--trained-k", type=int, required=True, help="the largest k of the training chains")
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--loops", default="1,2,3,4,6,8,12,16,24,32")
    ap.add_argument("--eps", type=float, default=1e-3, help="convergence threshold and the KL rule's")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--boot", type=int, default=200, help="bootstrap resamples (documents) of the intervals")
    ap.add_argument("--out", type=Path, default=None, help="write the numbers here as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loops = sorted({int(x) for x in args.loops.split(",")})
    path = newest(args.run)
    m = load(path, corpus=args.corpus)
    on = Corpus.open(args.on)
    if on.tokenizer_hash != Corpus.open(args.corpus).tokenizer_hash:
        raise DrcError(f"corpus '{args.on}' has another tokenizer than '{args.corpus}': prepare it with the same")
    tw = corpus_task_windows(on, m.model.max_seq_len, n_docs=args.docs, split="val", seed=args.seed)
    traj = answer_trajectories(m.model, tw, max(loops))
    probe = extrapolation_probe(traj, loops, args.eps, n_boot=args.boot)
    table, per_k, rho = probe.pop("table"), probe["per_k"], probe["spearman_depth"]
    print(f"{path}: {len(tw.windows)} documents of {args.on}, {len(traj)} answers; trained on k <= "
          f"{args.trained_k}, training mean {m.config.recurrence.mean:g} loops")
    print(table.round(3).to_string())
    for k, r in per_k.items():
        print(f"k={k}: best {r['best_acc']:.3f} at loop {r['best_loop']} [{r['best_ci'][0]:.3f}, {r['best_ci'][1]:.3f}]"
              f", mean convergence depth {r['mean_depth']:.2f}, overthought {r['overthought']:.1%}, last loop "
              f"{r['acc_last']:.3f}, KL rule {r['kl_rule']['acc']:.3f} at {r['kl_rule']['mean_exit']:.2f} loops")
    print(f"Spearman(k, convergence depth) {rho[0]:.3f} [{rho[1]:.3f}, {rho[2]:.3f}]")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"checkpoint": str(path), "on": str(args.on), "docs": len(tw.windows),
                                        "trained_k": args.trained_k, **probe}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
