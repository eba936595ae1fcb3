"""Train a depth-recurrent LM: ``python -m drc_core.training.train --preset NAME --data DIR --out DIR``.

Each step draws its loop count r, runs r core loops with truncated backprop through the last k, and updates with
AdamW under warmup + cosine decay. Everything random is a pure function of ``(seed, step)``, so a resumed or
two-rank run computes exactly the updates of one uninterrupted process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import SafetensorError
from tqdm.auto import tqdm

from drc_core.data.labels import read_labels
from drc_core.data.sampler import Corpus, WindowSampler, eval_windows
from drc_core.errors import ArgumentParser, DrcError, Interrupted, first_line, need_disk, run_cli
from drc_core.guard import exclusive, open_append, refuse_links, remove_path, write_dir, write_file
from drc_core.model import precision
from drc_core.model.lm import WEIGHTS_FILE, DepthRecurrentLM, load_state
from drc_core.model.recurrence import RecurrenceSampler
from drc_core.training.config import PRESETS, TrainConfig, apply_overrides, config_diff, preset
from drc_core.training.evaluate import loss_by_depth
from drc_core.training.rundir import (
    CHECKPOINTS_DIR,
    CORPUS_RECORD,
    FINAL_DIR,
    METRICS_FILE,
    check_weights,
    corpus_record,
    metrics_rows,
    open_run,
)
from drc_core.training.state import RESUME_FIX, apply_state, read_state, write_state


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed() -> tuple[Dist, torch.device]:
    """Join the process group when launched by ``torchrun`` (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    d = Dist(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{d.local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return d, device


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def initial_state(cfg: TrainConfig, step: int, d: Dist, device: torch.device) -> torch.Tensor | None:
    """s_0 for this rank's share of the global batch; a pure function of (seed, step)."""
    m = cfg.model
    if m.init_state == "zeros":
        return None
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    s = torch.randn((cfg.batch_size, cfg.seq_len, m.d_model), generator=g) * m.init_state_scale
    local = cfg.batch_size // d.world_size
    return s[d.rank * local : (d.rank + 1) * local].to(device)


def make_optimizer(model: DepthRecurrentLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms, not the embedding)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "tok_emb" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)


def checkpoints(out: Path) -> list[Path]:
    """The checkpoint directories (``step-N``) of run ``out``, oldest first."""
    found = [p for p in (out / CHECKPOINTS_DIR).glob("step-*") if p.name[5:].isdigit()]  # none without the folder
    return sorted(found, key=lambda p: int(p.name[5:]))


def save_checkpoint(out: Path, model: DepthRecurrentLM, opt, sched, cfg: TrainConfig, step: int,
                    sampler: WindowSampler) -> Path:
    root = out / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    need_disk(root, checkpoint_bytes(model), f"checkpoint {name}")

    def fill(tmp: Path) -> None:
        model.save(tmp)
        write_state(tmp, opt, sched, sampler.state_dict(), cfg.to_dict(), step)

    try:
        final = write_dir(root / name, fill, prefix=f".tmp-{name}-")
    except (RuntimeError, OSError):
        if shutil.disk_usage(root).free < checkpoint_bytes(model):
            raise DrcError(f"not enough disk space at {root} for checkpoint {name} (the disk filled up while "
                           "writing it): free some space, then continue with --resume") from None
        raise
    for old in checkpoints(out)[: -cfg.keep_last]:
        remove_path(old)
    return final


def answer_weights(corpus: Corpus, answer_weight: float) -> np.ndarray | None:
    """One loss weight per training token: ``answer_weight`` on the depth-task answers, 1 elsewhere (None if 1)."""
    if answer_weight == 1:
        return None
    w = np.ones(len(corpus.tokens("train")), dtype=np.float32)
    where = read_labels(corpus.path, "train").token.to_numpy()
    if len(where) and (where.dtype.kind not in "iu" or where.min() < 0 or where.max() >= len(w)):
        raise DrcError(f"corpus '{corpus.path}': labels.parquet names train tokens outside 0..{len(w) - 1}: the file "
                       "is damaged; prepare the corpus again with --force")
    w[where] = answer_weight
    return w


def weighted_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged with per-token ``weights`` (B, T): sum(w * ce) / sum(w)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    w = weights.flatten().to(ce.dtype)
    return (ce * w).sum() / w.sum()


def checkpoint_bytes(model: DepthRecurrentLM, optimizer: bool = True) -> int:
    """An upper estimate of a checkpoint's size: fp32 weights, plus AdamW's two moments when ``optimizer``."""
    n = sum(p.numel() for p in model.parameters()) * 4
    return n * 3 + (1 << 20) if optimizer else n + (1 << 16)


INIT_RECORD = "init.json"
RUN_FILES = ("config.json", CORPUS_RECORD, INIT_RECORD, METRICS_FILE, CHECKPOINTS_DIR, FINAL_DIR)  # what train writes


def check_out_dir(out: Path, cfg: TrainConfig, corpus: Corpus, resume: bool) -> list[Path]:
    """The checkpoints to resume from, after checking that training may write into ``out`` (new or empty, or with
    ``resume`` an unfinished run of the same config and corpus, no link among its entries); what a killed run was
    writing is removed."""
    if out.exists() and not out.is_dir():
        raise DrcError(f"--out '{out}' is a file: choose a directory path")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return []
    if not resume:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise DrcError(f"'{out}' is not empty ({shown}): training writes only into a new or empty directory; pass "
                       "--resume to continue the run in it, or choose a new --out")
    owner = f"run directory '{out}'"
    refuse_links([out / name for name in RUN_FILES], owner)
    if not (out / "config.json").is_file():
        raise DrcError(f"'{out}' is not a run of this trainer that can be resumed (no readable config.json): choose a "
                       "new --out")
    try:
        saved = TrainConfig.from_dict(open_run(out).train_config_dict(), str(out / "config.json"))
    except (KeyError, TypeError, ValueError) as exc:
        raise DrcError(f"'{out}' is not a run of this trainer that can be resumed ({exc}): choose a new --out"
                       ) from None
    if diff := config_diff(saved, cfg):
        raise DrcError(f"--resume with a config that differs from the run in '{out}' in {', '.join(diff)}: resume "
                       "with the same preset and --set values")
    for name in (CHECKPOINTS_DIR, FINAL_DIR):
        if (out / name).exists() and not (out / name).is_dir():
            raise DrcError(f"'{out / name}' is a file, not the run's {name}/ directory: the run is damaged; move "
                           "the file away (a resume would otherwise start again from step 0) and rerun")
    root = out / CHECKPOINTS_DIR
    if root.is_dir():  # what a killed run was writing (.tmp-step-*) is removed below, a link as a link
        refuse_links([p for p in root.iterdir() if not p.name.startswith(".tmp-step-")], owner)
    found = checkpoints(out)
    # its corpus.json: the same tokenizer and documents; required where there is a checkpoint to continue (a run
    # killed before its first one starts again from step 0 and records its corpus anew)
    open_run(out).check_corpus(corpus, required=bool(found))
    # a checkpoint a killed run was writing, and a file or final/ it was replacing
    for leftover in [*root.glob(".tmp-step-*"), *out.glob(".*.tmp-*")]:
        remove_path(leftover, strict=True)
    if not found and (out / FINAL_DIR).exists():
        raise DrcError(f"'{out}' holds a finished run and no checkpoint to resume: choose a new --out")
    return found


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop the metric rows after the checkpoint a run resumes from, and a last line torn by a kill."""
    if not path.exists():
        return
    rows, lines = metrics_rows(path)
    keep = [ln for row, ln in zip(rows, lines, strict=True) if row["step"] <= step]
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        torn = f.tell() > 0 and (f.seek(-1, os.SEEK_END) or f.read(1)) != b"\n"
    if len(keep) != len(lines) or torn:
        write_file(path, "".join(ln + "\n" for ln in keep))


def train(cfg: TrainConfig, data: str | Path, out: str | Path, resume: bool = False,
          progress: bool = True, init: str | Path | None = None) -> dict:
    """Train (or resume) under the run directory's lock; a summary: final step, last eval losses, tokens/s.
    ``init``: start from another run's weights with a fresh optimizer (a second stage, recorded in ``init.json``)."""
    d, device = init_distributed()
    out = Path(out)
    with exclusive(out, "run directory") if d.main else nullcontext():
        return _train(cfg, data, out, resume, progress, d, device, init)


def _train(cfg: TrainConfig, data: str | Path, out: Path, resume: bool, progress: bool, d: Dist,
           device: torch.device, init: str | Path | None = None) -> dict:
    corpus = Corpus.open(data)
    if corpus.vocab_size != cfg.model.vocab_size:
        raise DrcError(f"corpus '{data}' was tokenized with vocab {corpus.vocab_size} but the model expects "
                       f"{cfg.model.vocab_size}: prepare it with --vocab-size {cfg.model.vocab_size} or pass "
                       f"--set model.vocab_size={corpus.vocab_size}")
    found = check_out_dir(out, cfg, corpus, resume)
    torch.manual_seed(cfg.seed)
    model = DepthRecurrentLM(cfg.model).to(device)
    opt = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(cfg, s) / cfg.lr)
    sampler = WindowSampler(corpus.tokens("train"), cfg.seq_len, cfg.batch_size, seed=cfg.seed,
                            rank=d.rank, world_size=d.world_size)
    recur = RecurrenceSampler(cfg.recurrence)
    start = 0
    if resume and found:
        ckpt, fix = found[-1], RESUME_FIX
        state = read_state(ckpt, opt, sched)  # JSON + safetensors (or an old train_state.pt, weights only), checked
        try:
            saved = TrainConfig.from_dict(state.train_config, f"{ckpt} (its train_config)")
        except (KeyError, TypeError, ValueError) as exc:
            raise DrcError(f"cannot resume from {ckpt}: its training state is damaged ({first_line(exc)}); {fix}"
                           ) from None
        if diff := config_diff(saved, cfg):
            raise DrcError(f"--resume with a config that differs from the checkpoint in {', '.join(diff)}: "
                           "resume with the same preset and --set values")
        if state.step > cfg.max_steps:
            raise DrcError(f"cannot resume from {ckpt}: its training state is at step {state.step}, past max_steps="
                           f"{cfg.max_steps}; {fix}")
        try:
            check_weights(ckpt / WEIGHTS_FILE, cfg.model)  # names, shapes, float dtypes: before anything is read
            load_state(model, ckpt / WEIGHTS_FILE, map_location=device)
        except (ValueError, OSError, SafetensorError) as exc:  # mismatching or damaged: one line, no traceback
            raise DrcError(f"cannot resume from {ckpt}: {first_line(exc)}; {fix}") from None
        apply_state(state, opt, sched, sampler)
        start = state.step
    init_record = None
    if init is not None and start == 0:  # the weights of the run at init; init.json records where from
        run = open_run(init)
        record = run.corpus_record()
        if record is not None and record.get("tokenizer_sha256") != corpus.tokenizer_hash:
            raise DrcError(f"--init '{init}' was trained with another tokenizer than corpus '{corpus.path}' uses: "
                           f"prepare the corpus with --tokenizer {init}")
        load_state(model, run.need_weights(), map_location=device)
        init_record = {"init": str(init), "weights": str(run.need_weights() / WEIGHTS_FILE),
                       "trained_on": None if record is None else record.get("fingerprint")}
    if d.main:
        _truncate_metrics(out / METRICS_FILE, start)  # also rows of a run killed before its first checkpoint
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / CORPUS_RECORD, json.dumps(corpus_record(corpus), indent=2) + "\n")  # first: see check_out_dir
        write_file(out / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        if init_record is not None:
            write_file(out / INIT_RECORD, json.dumps(init_record, indent=2) + "\n")

    val = eval_windows(corpus.tokens("val"), cfg.seq_len, cfg.eval_windows)
    weights = answer_weights(corpus, cfg.answer_weight)
    path = precision.choose(cfg.autocast, cfg.compile, device)
    if d.main and progress:
        tqdm.write(path.why, file=sys.stderr)
    if path.compile:
        for block in (*model.prelude, *model.core, *model.coda):
            block.compile()
    net = torch.nn.parallel.DistributedDataParallel(model) if d.world_size > 1 else model
    autocast = path.autocast_context(device)
    metrics = open_append(out / METRICS_FILE) if d.main else None
    good = found[-1] if found else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t0, last_eval, done = time.perf_counter(), {}, start
    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", disable=not (progress and d.main), unit="step",
               dynamic_ncols=True)
    try:
        for step in range(start, cfg.max_steps):
            n = recur.sample(step)
            x, y = sampler.batch(step)
            sampler.step = step + 1
            x, y, s0 = x.to(device), y.to(device), initial_state(cfg, step, d, device)
            with autocast:
                if weights is None:
                    _, loss = net(x, n, n_grad_loops=recur.n_grad_loops(n), state=s0, targets=y)
                else:
                    logits = net(x, n, n_grad_loops=recur.n_grad_loops(n), state=s0)
                    loss = weighted_loss(logits, y, sampler.target_weights(step, weights).to(device))
            if not torch.isfinite(loss):
                where = f"the last good checkpoint is {good}" if good else "no checkpoint was written yet"
                raise DrcError(f"loss became {loss.item()} at step {step}: training stopped and {where}; train "
                               "again into a new --out with a lower lr or more warmup_steps (--resume continues "
                               "only with the same config, which would diverge again)")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            lr = sched.get_last_lr()[0]  # the lr of this update (sched.step() moves on to the next one)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            done = step + 1
            bar.update(1)
            if metrics and (done % cfg.log_every == 0 or done == cfg.max_steps):
                row = {"kind": "train", "step": done, "loss": loss.item(), "lr": lr, "loops": n,
                       "tokens": done * tokens_per_step, "seconds": round(time.perf_counter() - t0, 3)}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                bar.set_postfix(loss=f"{row['loss']:.3f}", r=n)
            if (done % cfg.eval_every == 0 or done == cfg.max_steps) and d.main:
                last_eval = loss_by_depth(model, val, cfg.eval_loops)
                for loops, ce in last_eval.items():
                    metrics.write(json.dumps({"kind": "eval", "step": done, "loops": loops, "loss": ce}) + "\n")
                metrics.flush()
                bar.write(f"step {done}: val loss " + "  ".join(f"{k}:{v:.3f}" for k, v in last_eval.items()))
            if done % cfg.ckpt_every == 0 or done == cfg.max_steps:
                if d.main:
                    good = save_checkpoint(out, model, opt, sched, cfg, done, sampler)
                if d.world_size > 1:
                    dist.barrier()
    except KeyboardInterrupt:
        where = f"the last checkpoint is {good.name}" if good else "no checkpoint was written yet"
        raise Interrupted(f"interrupted at step {done}; {where}: continue with the same command and --resume"
                          ) from None
    finally:
        bar.close()
        if metrics:
            metrics.close()
    seconds = time.perf_counter() - t0
    if d.main:
        need_disk(out, checkpoint_bytes(model, optimizer=False), "the final weights")
        write_dir(out / FINAL_DIR, model.save)
    steps_run = cfg.max_steps - start
    return {"step": cfg.max_steps, "eval": last_eval, "seconds": seconds, "numeric_path": path.why,
            "tokens_per_second": steps_run * tokens_per_step / seconds if seconds > 0 else float("nan")}


def preset_for(name: str, overrides: Sequence[str], corpus: Corpus) -> TrainConfig:
    """The preset ``name`` with ``--set`` ``overrides``, its vocabulary ``corpus``'s unless overridden."""
    return apply_overrides(preset(name), [f"model.vocab_size={corpus.vocab_size}", *overrides])


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m drc_core.training.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, dotted for nested ones: model.d_model=256 (repeat)")
    ap.add_argument("--data", default="data/corpus/default", help="a prepared corpus directory")
    ap.add_argument("--out", required=True, help="run directory (checkpoints, metrics, final weights)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    ap.add_argument("--init", default=None, metavar="RUN",
                    help="start from the weights of this run / shipped model (a second stage; fresh optimizer)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.data).is_dir():
        raise DrcError(f"data dir '{args.data}' does not exist: run `python -m drc_core.data prepare --out "
                       f"{args.data}` first")
    cfg = preset_for(args.preset, args.overrides, Corpus.open(args.data))
    summary = train(cfg, args.data, args.out, resume=args.resume, progress=not args.quiet, init=args.init)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, default=float))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
