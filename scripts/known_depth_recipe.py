"""The known-depth model of notebook 06 in stages, each stopped once its skill is measured: the two-hour attempt.

    .venv/bin/python scripts/known_depth_recipe.py --out runs/known-depth        # resumable: run it again
    .venv/bin/python scripts/known_depth_recipe.py --out runs/known-depth --ship data/known-depth

Each stage prepares its corpus (natural text + ``links`` problems of ``drc_core.data.depth_tasks``, or the problems
alone where the stage's ``source`` says so, all with the tokenizer of ``data/depth-tasks``), trains the ``cpu``
preset from the previous stage's checkpoint (``train --init``; the answer tokens weigh 10) and, beside the trainer,
probes every checkpoint on one thread: held-out answer accuracy at loop 8 for the stage's k (``depth_probe.py``'s
number), or in-context copying for the first stage. A stage ends at the first checkpoint whose probe meets its
target (unless it trains to its cap whatever the probe says: ``stop_at_target=False``), or at its step cap (then the
next stage starts from its last checkpoint and ``done.json`` says the target was missed). Every stage but the last
runs at a constant learning rate after warm-up, so that it can stop at any checkpoint; the last one decays (cosine).
``--plan`` picks the staging (``PLANS``); ``--budget-min`` cuts the last stage (its cosine included) to the minutes
left. What each plan reached on the development machine is in ``docs/training.md``: ``deep-k3`` met every target in
119.4 minutes and is ``data/known-depth``; the others stopped short on three hops.

Written to ``--out``: ``<stage>/run`` (the training run), ``<stage>/probes.jsonl``, ``<stage>/done.json`` (the
checkpoint the next stage starts from, whether the target was met, the trainer's wall time) and ``recipe.log``.
A stopped driver resumes: finished stages are skipped, a started trainer resumes from its newest checkpoint,
probed checkpoints are not probed again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
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
from drc_core.training.config import preset
from drc_core.training.rundir import FINAL_DIR, WEIGHTS_FILE, open_run
from drc_core.training.train import checkpoints as saved_checkpoints

TOKENIZER = "data/depth-tasks"
PRESET = "cpu"  # every stage trains this preset
PREPARE = [sys.executable, "-m", "drc_core.data", "prepare", "--tokenizer", TOKENIZER]
MIXED = "wikipedia+sotu+depth-tasks"  # natural text and problems


def links(k: int, docs: int, repeats: float, max_k: int | None = None, family: str = "links") -> list[str]:
    """Prepare flags of a corpus whose ``links`` chains have exactly ``k`` hops (``k..max_k``, drawn per chain, when
    ``max_k`` is given), every object asked; another ``family``'s problems with their k drawn the same way."""
    ask = ["--task-ask-every"] if family == "links" else []
    return ["--task-families", family, *ask, "--task-min-k", str(k), "--task-max-k",
            str(k if max_k is None else max_k), "--task-docs", str(docs), "--task-repeat-share", str(repeats)]


@dataclass(frozen=True)
class Stage:
    name: str
    corpus: str  # directory under data/corpus
    prepare: list[str]  # flags of `drc_core.data prepare` besides source and tokenizer
    lr: float
    cap: int  # max steps
    skill: str  # "copy", or the k of the answers that must be right, comma-separated ("1,2,3")
    target: float  # accuracy at loop `probe_loop`
    first_probe: int  # no checkpoint before this step is probed
    decay: bool = False  # cosine to lr / 10 over `cap` steps; else constant after warm-up
    mean_depth: float | None = None  # training-mean depth (recurrence.mean); None: the preset's
    backprop_loops: int | None = None  # truncated backprop (recurrence.backprop_loops); None: the preset's
    sigma: float | None = None  # spread of the loop-count distribution (recurrence.sigma); None: the preset's
    probe_loop: int = 8  # the loop at which the target must be met
    source: str = MIXED  # the corpus's sources (``depth-tasks`` alone: problems only)
    stop_at_target: bool = True  # False: train to the cap (a grokking phase comes after the target is met)


COPY = Stage("copy", "mixed", [], 2e-3, 4000, "copy", 0.85, 3000)
K1 = Stage("k1", "links11", links(1, 20000, 0.2), 1e-3, 1000, "1", 0.95, 250)
K2 = Stage("k2", "links22", links(2, 40000, 0.1), 1e-3, 2000, "2", 0.85, 1500)
K3 = Stage("k3", "links33", links(3, 40000, 0.1), 1e-3, 2750, "1,2,3", 0.90, 1500, decay=True)  # shuffled questions
COPY_LONG = replace(COPY, name="copy-long", cap=5500, target=0.97)  # one run until copying is reliable
PLANS = {
    # natural text + containers / swaps / hops (k 1..6) + half of the problems said twice: copying forms first
    "copy-first": [COPY, K1, K2, K3],
    # the same first three stages, then two hops trained further (a fresh optimizer), three hops for what is
    # left of the budget (--budget-min)
    "long-k2": [COPY, K1, K2, replace(K2, name="k2b", cap=1000, target=0.92, first_probe=250), replace(K3, cap=4000)],
    # the copying stage at training-mean depth 2 (backprop through 2 loops: ~1.7x the steps per minute), judged
    # at loop 2 and trained until copying is reliable (the lookups chain copies), then the lookups at the preset's
    # depth 8, three hops for what is left of the budget
    "shallow-copy": [replace(COPY, name="copy2", mean_depth=2.0, backprop_loops=2, probe_loop=2, cap=6000,
                             target=0.95, first_probe=2000), K1, K2, replace(K3, cap=5000)],
    # the copy-first plan's copying stage trained on (a fresh optimizer) until copying is reliable at loop 8 (the
    # longer recipe's first stage copies at 100% at loops 1, 2 and 8; this plan's at 77 / 84 / 91%), then the
    # lookups, three hops for what is left of the budget
    "mature-copy": [COPY, replace(COPY, name="copy-more", cap=1500, target=0.97, first_probe=250), K1, K2,
                    replace(K3, cap=5000)],
    # the copying stage run longer in one go (its optimizer kept) until copying is reliable at loop 8, then the
    # lookups, three hops for what is left of the budget
    "long-copy": [COPY_LONG, K1, K2, replace(K3, cap=5000)],
    # the long-copy plan's stages, then three hops on chains whose objects are asked deepest first: shuffled, a
    # question after one about the object below it in its chain is answered in two lookups (half of the k = 3
    # questions), so only a sixth of the answers needed three; deepest first, a third do
    "deep-k3": [COPY_LONG, K1, K2,
                replace(K3, corpus="links33d", prepare=[*links(3, 40000, 0.1), "--task-ask-order", "deepest-first"],
                        cap=5000)],
    # from the shipped known-depth model (three hops, asked deepest first): chains of 1..4 links drawn per chain,
    # every object asked in shuffled order (depth, not question order), and a heavier-tailed loop count in training
    # (sigma 1.0 against 0.5), so that the model meets loop counts well past its mean; tested on chains up to 8
    "extrapolate": [Stage("k4mix", "links14m", links(1, 60000, 0.1, max_k=4), 1e-3, 5000, "1,2,3,4", 0.95, 500,
                          decay=True, sigma=1.0)],
    # the extrapolation plan's model trained longer (the longer-training lever: extrapolation in looped models came
    # after long training with weight decay): the same corpus and loop-count spread from data/known-depth-k4, a fresh
    # 2,500-step cosine from 5e-4 with the preset's weight decay 0.1, within what is left of that model's 4-hour
    # budget (its first 5,000 steps took 110 minutes)
    "extrapolate-long": [Stage("k4mix-long", "links14m", links(1, 60000, 0.1, max_k=4), 5e-4, 2500, "1,2,3,4", 0.95,
                               250, decay=True, sigma=1.0)],
    # a second depth law: pointer jumping (``hops``, k = 1..4 jumps drawn per problem) from the shipped known-depth
    # model (which copies and looks up), with the extrapolation plan's heavier-tailed loop count; tested on k up to 8.
    # At about 4.4 s per step on a contended 2-core AMD machine 5,000 steps would take twice the 4-hour budget, so
    # the first stage ran to step 1,750 (its rate still 0.77e-3 of a 5,000-step cosine from 1e-3, roughly the
    # constant rate declared here) and a second stage decays from there over 750 steps
    "hops": [Stage("hops14", "hops14", links(1, 40000, 0.1, max_k=4, family="hops"), 1e-3, 1750, "1,2,3,4", 0.90,
                   500, sigma=1.0),
             Stage("hops14-decay", "hops14", links(1, 40000, 0.1, max_k=4, family="hops"), 8e-4, 750, "1,2,3,4",
                   0.90, 250, decay=True, sigma=1.0)],
    # the anchor's setting (arXiv 2604.07822: composition from scratch, extrapolation after long training): problems
    # only, no natural text, from random weights; chains of 1..4 links drawn per chain, every object asked in
    # shuffled order, the heavier-tailed loop count; trained to its cap whatever the probe says, within the 4-hour
    # budget (5,000 steps at about 2.5 s a step on the idle 2-core AMD machine)
    "task-only": [Stage("k4-scratch", "tasks14m", links(1, 100000, 0.1, max_k=4), 1e-3, 5000, "1,2,3,4", 0.95, 500,
                        decay=True, sigma=1.0, source="depth-tasks", stop_at_target=False)],
    # one-hop lookups from random weights, without the copying stage
    "links-first": [replace(K1, lr=2e-3, cap=2500, first_probe=500), replace(K2, cap=3000, target=0.92),
                    replace(K3, cap=4000)],
}
# plans whose first stage starts from a shipped model
PLAN_INIT = {"extrapolate": Path("data/known-depth"), "hops": Path("data/known-depth"),
             "extrapolate-long": Path("data/known-depth-k4")}
PROBE_DOCS = 60


@dataclass
class Driver:
    out: Path
    threads: int
    log_file: Path = field(init=False)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = self.out / "recipe.log"

    def log(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}"
        print(line, flush=True)
        with self.log_file.open("a") as f:
            f.write(line + "\n")

    def corpus(self, st: Stage) -> Path:
        """The stage's corpus, prepared (a no-op when ``path`` already holds it with these flags: prepare's cache)."""
        path = corpus_dir(st)
        self.log(f"{st.name}: preparing {path}")
        subprocess.run([*PREPARE, "--source", st.source, *st.prepare, "--out", str(path)], check=True,
                       stdout=subprocess.DEVNULL)
        return path

    def probe(self, st: Stage, ckpt: Path, corpus: Path) -> dict:
        """Accuracy at loops 1 (/2/4) and 8 of the stage's skill on ``ckpt``, one thread, and whether it is met."""
        torch.set_num_threads(1)
        m = load(ckpt, corpus=corpus)
        if st.skill == "copy":
            acc = copy_accuracy(m.model, m.tokenizer, sorted({1, st.probe_loop, 8}), docs=24)
            by = {"copy": {int(r.loop): float(r.copy_acc) for r in acc.itertuples()}}
            met = by["copy"][st.probe_loop] >= st.target
        else:
            tw = corpus_task_windows(Corpus.open(corpus), m.model.max_seq_len, n_docs=PROBE_DOCS, split="val",
                                     seed=1)
            by = skill_accuracy(m.model, tw, sorted({1, 2, 4, 8, st.probe_loop}))
            met = all(by[f"k{k}"][st.probe_loop] >= st.target for k in map(int, st.skill.split(",")))
        return {"checkpoint": str(ckpt), "met": met, "accuracy": by}

    def run_stage(self, st: Stage, init: Path | None) -> dict:
        """Run (or resume) one stage; its ``done.json`` record: the checkpoint it ended at, met, wall time."""
        sdir = self.out / st.name
        done = sdir / "done.json"
        if done.is_file():
            rec = json.loads(done.read_text())
            self.log(f"{st.name}: done before ({rec['checkpoint']}, target met: {rec['met']})")
            return rec
        corpus = self.corpus(st)
        run = sdir / "run"
        probes_file = sdir / "probes.jsonl"
        lines = probes_file.read_text().splitlines() if probes_file.is_file() else []
        probed = {rec["checkpoint"]: rec for rec in map(json.loads, lines)}
        met = next((p for p in probed.values() if p["met"]), None)
        wall = json.loads((sdir / "wall.json").read_text())["s"] if (sdir / "wall.json").is_file() else 0.0
        proc = None
        if met is None:
            cmd = train_command(st, corpus, run, init)
            env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
            sdir.mkdir(parents=True, exist_ok=True)
            self.log(f"{st.name}: training ({' '.join(cmd[1:])})")
            logf = (sdir / "train.log").open("a")
            proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            started = time.time()
        while met is None:
            finished = proc is not None and proc.poll() is not None
            for ckpt in checkpoints(run):
                if str(ckpt) in probed or step_of(ckpt) < st.first_probe:
                    continue
                rec = {**self.probe(st, ckpt, corpus), "step": step_of(ckpt)}
                probed[str(ckpt)] = rec
                with probes_file.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                self.log(f"{st.name}: step {rec['step']}: {fmt(rec['accuracy'])}" + ("  -> met" if rec["met"]
                                                                                       else ""))
                if rec["met"] and st.stop_at_target:
                    met = rec
                    break
            if met is not None or finished:
                break
            if proc is not None:  # the trainer's wall so far: a killed driver loses at most this sleep
                (sdir / "wall.json").write_text(json.dumps({"s": wall + time.time() - started}))
            time.sleep(15)
        if proc is not None:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
            wall += time.time() - started
            (sdir / "wall.json").write_text(json.dumps({"s": wall}))
            if proc.returncode not in (0, -signal.SIGTERM) and met is None:
                raise DrcError(f"stage {st.name}: the trainer exited with {proc.returncode}: see {sdir}/train.log")
        last = met or max(probed.values(), key=lambda r: r["step"])
        rec = {**last, "stage": asdict(st), "train_wall_s": wall}
        done.write_text(json.dumps(rec, indent=1))
        self.log(f"{st.name}: {'target met' if last['met'] else 'TARGET MISSED'} at step {last['step']}, "
                 f"trainer wall {wall / 60:.1f} min")
        return rec


def train_command(st: Stage, corpus: Path, run: Path, init: Path | None) -> list[str]:
    """The trainer's command line for stage ``st``: resuming ``run`` when it has a checkpoint, else from ``init``."""
    cmd = [sys.executable, "-m", "drc_core.training.train", "--preset", PRESET, "--data", str(corpus),
           "--out", str(run), "--quiet", "--set", f"lr={st.lr}", "--set", f"max_steps={st.cap}",
           "--set", "answer_weight=10", "--set", "eval_loops=1,8", "--set", "keep_last=4",
           "--set", f"min_lr_ratio={0.1 if st.decay else 1.0}"]
    if st.mean_depth is not None:
        cmd += ["--set", f"recurrence.mean={st.mean_depth}"]
    if st.backprop_loops is not None:
        cmd += ["--set", f"recurrence.backprop_loops={st.backprop_loops}"]
    if st.sigma is not None:
        cmd += ["--set", f"recurrence.sigma={st.sigma}"]
    if saved_checkpoints(run):
        return [*cmd, "--resume"]
    return cmd if init is None else [*cmd, "--init", str(init)]


def corpus_dir(st: Stage) -> Path:
    return Path("data/corpus") / st.corpus


def step_of(ckpt: Path) -> int:
    """A checkpoint's step; ``final/``'s is its run's ``max_steps``."""
    if ckpt.name == FINAL_DIR:
        return open_run(ckpt).train_config().max_steps
    return int(ckpt.name.split("-")[1])


def checkpoints(run: Path) -> list[Path]:
    """The run's saved checkpoints (the trainer writes each whole, then renames it), then ``final/`` when it is
    not the same step as the last checkpoint."""
    found = saved_checkpoints(run)
    final = run / FINAL_DIR
    if (final / WEIGHTS_FILE).is_file() and step_of(final) not in map(step_of, found):
        found.append(final)
    return found


def skill_accuracy(model, tw, loops: list[int]) -> dict[str, dict[int, float]]:
    """Answer accuracy per ``k`` (``"k1"``, ...) at each of ``loops``, on the task windows ``tw``."""
    acc = accuracy_by_k(answer_trajectories(model, tw, max(loops)), n_boot=200, loops=loops)
    return {f"k{k}": {int(r.loop): float(r.acc) for r in g.itertuples()} for k, g in acc.groupby("k")}


def fmt(acc: dict) -> str:
    return "  ".join(f"{name} " + "/".join(f"{100 * v:.0f}" for v in by.values()) for name, by in acc.items())


def budget_cap(st: Stage, sdir: Path, records: list[dict], budget_min: float | None) -> Stage:
    """The last stage with its step cap cut to what is left of ``budget_min`` minutes of trainer wall, at the
    seconds per step the earlier stages took (probes beside the trainer included); fixed once it has started."""
    plan = sdir / "cap.json"
    if plan.is_file():
        return replace(st, cap=json.loads(plan.read_text())["cap"])
    if budget_min is None or not records:
        return st
    spent = sum(r["train_wall_s"] for r in records)
    per_step = max(r["train_wall_s"] / r["step"] for r in records)  # the slowest stage's rate: probes slow it
    every = preset(PRESET).ckpt_every  # a stage can only end at a checkpoint
    cap = min(st.cap, int((budget_min * 60 - spent) / per_step) // every * every)
    if cap < st.first_probe:
        raise DrcError(f"{spent / 60:.0f} of the {budget_min:g} budgeted minutes are spent: {cap} steps are left "
                       f"for stage {st.name}, fewer than its first probe ({st.first_probe}); raise --budget-min")
    sdir.mkdir(parents=True, exist_ok=True)
    plan.write_text(json.dumps({"cap": cap, "spent_s": spent, "s_per_step": per_step, "budget_min": budget_min}))
    return replace(st, cap=cap)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where the stages' runs go (resumable)")
    ap.add_argument("--plan", choices=sorted(PLANS), default="copy-first", help="which staging")
    ap.add_argument("--budget-min", type=float, default=None,
                    help="cut the last stage's steps (its cosine included) to what is left of this many minutes")
    ap.add_argument("--threads", type=int, default=2, help="trainer threads (the probes use one)")
    ap.add_argument("--ship", type=Path, default=None, help="ship the last stage's model here when all targets met")
    args = ap.parse_args(argv)
    drv = Driver(args.out, args.threads)
    stages = PLANS[args.plan]
    records: list[dict] = []
    for i, st in enumerate(stages):
        if i == len(stages) - 1:
            st = budget_cap(st, args.out / st.name, records, args.budget_min)
        records.append(drv.run_stage(st, Path(records[-1]["checkpoint"]) if records else PLAN_INIT.get(args.plan)))
    ckpt = Path(records[-1]["checkpoint"])
    total = sum(r["train_wall_s"] for r in records)
    drv.log(f"all stages: trainer wall {total / 60:.1f} min; targets met: {[r['met'] for r in records]}")
    if args.ship is not None:
        if not all(r["met"] for r in records):
            raise DrcError(f"a stage missed its target (see {args.out}/recipe.log): nothing shipped")
        info = {"kind": f"staged recipe (scripts/known_depth_recipe.py --plan {args.plan})",
                "step": records[-1]["step"], "of_steps": records[-1]["stage"]["cap"],
                "train_wall_minutes": round(total / 60, 1),
                "stages": [{"name": r["stage"]["name"], **{k: r[k] for k in ("checkpoint", "step", "met", "accuracy")},
                            "train_wall_minutes": round(r["train_wall_s"] / 60, 1)} for r in records]}
        dest = open_run(ckpt).ship(args.ship, corpus=Corpus.open(corpus_dir(stages[-1])),
                                   info=info, replace=True)
        drv.log(f"shipped {ckpt} to {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
