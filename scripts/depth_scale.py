"""What makes a CPU-scale depth-recurrent model use depth? Short runs side by side.

    .venv/bin/python scripts/depth_scale.py                 # train + evaluate every run not yet done (resumable)
    .venv/bin/python scripts/depth_scale.py --only d256-m16 # one run
    .venv/bin/python scripts/depth_scale.py --table         # the grid as a markdown table (data/scale/*)

Every run starts from the ``cpu`` preset (prelude 1 / core 2 / coda 1, 16 x 256-token batches, backprop through
the last 4 loops, vocab 4096, the embedded corpus) on the fast path (bf16 autocast + compiled blocks, set
explicitly: the grid compares levers at the speed that lets it cover them; the parity runs put bf16 within
+0.008 nats of fp32 at depth and +0.02 at one loop) and changes
the width, the training-mean depth R, the token budget or the backprop depth. The token budget x1 is 1000 steps =
4.1 M tokens (1.18 passes over the 3.46 M training tokens). A run is trained with ``drc_core.training.train --resume``
(a finished run is skipped) under ``runs/scale/<name>`` and evaluated here, in fp32, on 128 validation windows spread
evenly over the split and 64 training windows (same spread), with the evaluation's fixed initial state:

* CE at every depth 1..32, the depth gain CE(1) - CE(R) and CE(1) - CE(8);
* the smallest uniform depth within 0.005 nats of CE(R) (``uniform_match``), absolute and as a fraction of R;
* the mean successive KL(p_l || p_l-1) at l = 2, 16 and 2R;
* train vs validation CE at R (over-fitting) and the number of passes over the training split.

``data/scale/<name>/`` receives ``summary.json``, ``train_config.json`` and ``metrics.jsonl`` (no weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
DATA = Path(os.environ.get("DATA", ROOT / "data" / "corpus" / "default"))
RUNS_DIR = Path(os.environ.get("RUNS", ROOT / "runs" / "scale"))
DEST = Path(os.environ.get("DEST", ROOT / "data" / "scale"))
MATCH_NATS = 0.005

STEPS_X1 = 1000
WIDTH = {128: 4, 192: 4, 256: 4, 384: 6}  # d_model -> heads (head size 32..64)


def width(d: int) -> list[str]:
    return [f"model.d_model={d}", f"model.n_heads={WIDTH[d]}"]


def common(steps: int = STEPS_X1, lr: float = 2e-3) -> list[str]:
    return [f"max_steps={steps}", f"lr={lr}", f"eval_every={steps}", f"ckpt_every={min(250, steps)}",
            "eval_loops=1,4,8,16,32", "warmup_steps=100", "autocast=bf16", "compile=true"]


# name -> overrides of the cpu preset; in the order they are run (most informative first)
RUNS: dict[str, list[str]] = {
    "d256-m8": width(256) + common(),
    "d256-m8-k8": width(256) + common() + ["recurrence.backprop_loops=8"],
    "d256-m16-k8": width(256) + common() + ["recurrence.mean=16", "recurrence.max_loops=64",
                                            "recurrence.backprop_loops=8"],
    "d256-m16": width(256) + common() + ["recurrence.mean=16", "recurrence.max_loops=64"],
    "d384-m8": width(384) + common(),
    "d128-m8": width(128) + common(),
    "d256-m8-x2": width(256) + common(2 * STEPS_X1),
    "d192-m8": width(192) + common(),
    "d256-m12": width(256) + common() + ["recurrence.mean=12", "recurrence.max_loops=48"],
    "d256-m8-x4": width(256) + common(4 * STEPS_X1),
    # the shipped reference (data/reference): the cpu preset as it stands, d=256 R=8 k=4, 5000 steps (x5 tokens),
    # autocast/compile "auto" (bf16 + compile on this CPU), validation every 500 steps
    "cpu-ref": [],
}


def train(name: str) -> Path:
    out = RUNS_DIR / name
    if not (out / "final" / "model.safetensors").exists():
        sets = [a for kv in RUNS[name] for a in ("--set", kv)]
        cmd = [PY, "-m", "drc_core.training.train", "--preset", "cpu", "--data", str(DATA), "--out", str(out),
               "--resume", "--quiet", *sets]
        print(f"[{name}] training: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def evaluate(name: str, out: Path) -> dict:
    from drc_core.data.sampler import Corpus, eval_windows
    from drc_core.training.evaluate import loss_by_depth, mean_successive_kl
    from drc_core.training.rundir import open_run

    cfg = json.loads((out / "config.json").read_text())
    model = open_run(out).load_model()
    corpus = Corpus.open(DATA)
    seq = cfg["seq_len"]
    mean = cfg["recurrence"]["mean"]
    R = round(mean)
    deepest = max(32, 2 * R)
    val = eval_windows(corpus.tokens("val"), seq, 128, spread=True)
    tr = eval_windows(corpus.tokens("train"), seq, 64, spread=True)
    ce = loss_by_depth(model, val, list(range(1, deepest + 1)))
    ce_train = loss_by_depth(model, tr, [1, R, 8])
    kl = mean_successive_kl(model, val, deepest)
    match = min(n for n in ce if ce[n] <= ce[R] + MATCH_NATS)
    match8 = min(n for n in ce if ce[n] <= ce[8] + MATCH_NATS)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    last = [r for r in rows if r["kind"] == "train"][-1]
    tokens = cfg["max_steps"] * cfg["batch_size"] * cfg["seq_len"]
    return {
        "name": name, "overrides": RUNS[name], "params": model.num_params(),
        "d_model": cfg["model"]["d_model"], "mean_depth": mean, "R": R,
        "backprop_loops": cfg["recurrence"]["backprop_loops"], "steps": cfg["max_steps"], "tokens": tokens,
        "passes": tokens / len(corpus.tokens("train")), "train_seconds": last["seconds"],
        "tokens_per_second": last["tokens"] / last["seconds"],
        "ce": {str(k): v for k, v in ce.items()},
        "ce_train": {str(k): v for k, v in ce_train.items()},
        "gain_1_R": ce[1] - ce[R], "gain_1_8": ce[1] - ce[8],
        "uniform_match_R": match, "uniform_match_frac": match / R, "uniform_match_8": match8,
        "kl": {str(k): kl[k] for k in sorted({2, 16, 2 * R}) if k in kl},
        "val_minus_train_R": ce[R] - ce_train[R],
        "windows": {"val": len(val), "train": len(tr), "spread": True},
    }


def run(name: str) -> None:
    dest = DEST / name
    if (dest / "summary.json").exists():
        print(f"[{name}] done already ({dest / 'summary.json'})")
        return
    out = train(name)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    summary = evaluate(name, out)
    dest.mkdir(parents=True, exist_ok=True)
    for src, dst in (("config.json", "train_config.json"), ("metrics.jsonl", "metrics.jsonl")):
        (dest / dst).write_bytes((out / src).read_bytes())
    (dest / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[{name}] done: {dest / 'summary.json'}", flush=True)


def table() -> str:
    """The grid (drc_book.report.scale_table) as a markdown table, in the order of RUNS."""
    from drc_book.report import scale_table

    df = scale_table(DEST)
    df = df.loc[[n for n in RUNS if n in df.index] + sorted(set(df.index) - set(RUNS))]

    def cell(col: str, v: object) -> str:
        if col in ("d", "R", "k", "uniform_match"):
            return str(int(v))
        if col.startswith("KL"):
            return f"{v:.2e}"
        return f"{v:+.3f}" if col == "val-train" else f"{v:.1f}" if col in ("tokens_M", "passes") else (
            f"{v:.0f}" if col == "minutes" else f"{v:.3f}")

    head = "| run | " + " | ".join(df.columns) + " |\n|---|" + "---|" * len(df.columns)
    body = ["| " + name + " | " + " | ".join(cell(c, r[c]) for c in df.columns) + " |" for name, r in df.iterrows()]
    return "\n".join([head, *body])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=list(RUNS), help="run only these (repeat)")
    ap.add_argument("--table", action="store_true", help="print the table of finished runs and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table())
        return 0
    for name in args.only or RUNS:
        run(name)
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
