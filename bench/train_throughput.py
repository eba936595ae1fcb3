"""Training throughput on this machine: tokens/s, model FLOP/s and MFU of the real training step, side by side.

    .venv/bin/python bench/train_throughput.py                      # the cpu preset, all variants
    .venv/bin/python bench/train_throughput.py --quick              # tiny sizes: a smoke check (still compiles)
    .venv/bin/python bench/train_throughput.py --rounds 7 --steps 3 --json runs/bench/throughput.json
    .venv/bin/python bench/train_throughput.py --set batch_size=16 --variants baseline,fp32-eager,default

Everything is measured in ONE run and interleaved: each round measures the reference matmuls and then every
variant (the order rotates from round to round), and the report gives the median over rounds, so a noisy
machine slows all of them alike instead of whichever happened to run during a burst of load.

The step is the trainer's (``drc_core.training.train``): the initial latent state drawn per step, forward at a fixed
loop count n (the preset's training-mean depth; the trainer draws it at random, fixed here for
comparability), truncated backprop through the last k = ``recurrence.backprop_loops`` loops, the loss check,
backward, gradient clipping, AdamW from ``make_optimizer`` and ``zero_grad``. The tokens are synthetic ids of
the preset's vocabulary. Variants:

* ``baseline``      eager, fp32, full backprop through every loop (``n_grad_loops=None``)
* ``fp32-eager``    eager, fp32, truncated backprop: the plain path (``--set autocast=none --set compile=false``),
  the trainer's default before the fast path
* ``compile-core``  as ``fp32-eager`` plus ``block.compile()`` on the core blocks only
* ``bf16``          as ``fp32-eager`` under ``torch.autocast(bfloat16)``, eager
* ``compile-core+bf16``  both
* ``compile-blocks+bf16``  every block (prelude, core, coda) compiled + autocast bf16 (``--set autocast=bf16``)
* ``default``       what the trainer does with the preset's own ``autocast`` / ``compile`` on this machine
  (``drc_core.model.precision.choose``): fp32 with every block compiled where a C++ compiler exists
* ``compile-model`` ``torch.compile`` of the whole model forward including the loss (backward through
  AOTAutograd; the optimizer stays eager): the cheapest "whole step" to try

A step is the whole training step (forward, backward, clipping, AdamW, zero_grad). MFU is reported against the
peak of the dtype the variant's matmuls run in (the bf16 square-matmul rate for bf16 variants, fp32 for fp32 ones)
and, as before, against the fp32 peak. Compile warm-up (model build + warm-up steps, where compilation happens) is
reported separately from the timed steps. After warm-up every compiled variant runs one step at each of a few other
loop counts and the bench prints how many new graphs dynamo compiled for them: the trainer draws a new depth every
step, so this must be 0 (the per-block compile is independent of the loop count).

A variant that raises (e.g. no C++ compiler for inductor) is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drc_book.cost import median, rotations, spread, train_flops_per_token
from drc_core.model import precision
from drc_core.model.lm import DepthRecurrentLM
from drc_core.model.recurrence import RecurrenceSampler
from drc_core.training.config import PRESETS, TrainConfig, apply_overrides, preset
from drc_core.training.train import Dist, initial_state, make_optimizer

# Under bf16 autocast F.rms_norm gets bf16 input and an fp32 weight and falls back to its unfused kernel; that
# is part of what the bf16 variant measures, so say it once in the docs instead of at every call.
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")

TARGET_MFU = 0.3  # of the peak of the dtype actually used (the fast path's throughput target)
TARGET_SPEEDUP = 2.5  # against fp32-eager, the trainer's default before the fast path, at the same model size


@dataclass(frozen=True)
class Variant:
    name: str
    compile: str = "none"  # "none" | "core" | "blocks" | "model"
    autocast: str = "none"  # "none" | "bf16"
    full_backprop: bool = False
    what: str = ""


VARIANTS = (
    Variant("baseline", full_backprop=True, what="eager fp32, full backprop through every loop"),
    Variant("fp32-eager", what="eager fp32, truncated backprop (the plain path; the old trainer default)"),
    Variant("compile-core", compile="core", what="block.compile() on the core blocks only"),
    Variant("bf16", autocast="bf16", what="eager, autocast bf16"),
    Variant("compile-core+bf16", compile="core", autocast="bf16", what="core blocks compiled + autocast bf16"),
    Variant("compile-blocks+bf16", compile="blocks", autocast="bf16", what="every block compiled + autocast bf16"),
    Variant("default", compile="auto", autocast="auto",
            what="the trainer's default for this preset: precision.choose(cfg.autocast, cfg.compile)"),
    Variant("compile-model", compile="model", what="torch.compile(model): whole forward + loss compiled"),
)


# ------------------------------------------------------------------------------------------------ FLOPs


def formula_text(cfg: TrainConfig, model: DepthRecurrentLM, n: int, k: int | None) -> str:
    c, T = cfg.model, cfg.seq_len
    d, h, V = c.d_model, c.hidden_dim, c.vocab_size
    block = 2 * (4 * d * d + 3 * d * h) + 4 * T * d
    adapter = 4 * d * d if c.injection == "concat" else 0
    fn, fk = model.flops_per_token(n, T), model.flops_per_token(k if k is not None else n, T)
    lines = [
        "training FLOPs/token = F(n) + 2*F(k)     (forward at all n loops; backward ~ 2x forward only for the parts",
        "                                          with gradient: prelude, the last k loops, coda, head)",
        "  F(r) = model.flops_per_token(r, T) = (P+C)*block + r*(R*block + adapter) + 2*d*V",
        f"  block = 2*(4d^2 + 3dh) + 4Td = {block:,}   (d={d}, h={h}, T={T}; attention over the full TxT)",
        f"  adapter = 2*2d*d = {adapter:,}   head 2dV = {2 * d * V:,}   P,R,C = {c.n_prelude},{c.n_core},{c.n_coda}",
        f"  n={n}, k={k}: F(n)={fn:,}  F(k)={fk:,}  ->  {train_flops_per_token(model, n, k, T):,} FLOPs/token",
        f"  baseline (full backprop, k=n): 3*F(n) = {train_flops_per_token(model, n, None, T):,} FLOPs/token",
        "  not counted: embedding gather, norms, RoPE, softmax, cross-entropy, clipping, AdamW",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- matmuls


@dataclass
class Matmul:
    name: str
    m: int
    k: int
    n: int
    dtype: torch.dtype = torch.float32
    reps: int = 1
    samples: list[float] = field(default_factory=list)  # FLOP/s per round

    def setup(self, target_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(self.m, self.k, generator=g).to(self.dtype)
        self.b = torch.randn(self.k, self.n, generator=g).to(self.dtype)
        self.out = torch.empty(self.m, self.n, dtype=self.dtype)
        for _ in range(2):
            torch.mm(self.a, self.b, out=self.out)
        t = self._time(1)
        self.reps = max(1, min(1000, math.ceil(target_s / max(t, 1e-6))))

    def _time(self, reps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(self.a, self.b, out=self.out)
        return time.perf_counter() - t0

    def measure(self) -> float:
        flops = 2 * self.m * self.k * self.n * self.reps / self._time(self.reps)
        self.samples.append(flops)
        return flops

    @property
    def median(self) -> float:
        return median(self.samples) if self.samples else float("nan")


# -------------------------------------------------------------------------------------------- variants


class Runner:
    """One model + optimizer per variant, built from the same seed; ``step()`` is the trainer's loop body."""

    def __init__(self, v: Variant, cfg: TrainConfig, n_loops: int, seed: int) -> None:
        if v.name == "default":
            path = precision.choose(cfg.autocast, cfg.compile, torch.device("cpu"))
            v = Variant(v.name, compile="blocks" if path.compile else "none", autocast=path.autocast,
                        full_backprop=v.full_backprop, what=f"{v.what}: {path.why.split(': ')[1]}")
        self.v, self.cfg, self.n = v, cfg, n_loops
        self.k = None if v.full_backprop else RecurrenceSampler(cfg.recurrence).n_grad_loops(n_loops)
        torch.manual_seed(seed)
        self.model = DepthRecurrentLM(cfg.model)
        self.model.train()
        self.opt = make_optimizer(self.model, cfg)
        if v.compile in ("core", "blocks"):
            m = self.model
            for block in m.core if v.compile == "core" else (*m.prelude, *m.core, *m.coda):
                block.compile()
        self.net: Callable = torch.compile(self.model) if v.compile == "model" else self.model
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.step_i = 0
        self.samples: list[float] = []  # tokens/s per round
        self.warmup_s = float("nan")
        self.skipped: str | None = None
        self.last_loss = float("nan")
        self.new_graphs: int | None = None  # graphs compiled by steps at other loop counts after warm-up

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len

    def step(self, n_loops: int | None = None) -> None:
        cfg = self.cfg
        n = self.n if n_loops is None else n_loops
        k = self.k if n_loops is None else (None if self.v.full_backprop else
                                            RecurrenceSampler(cfg.recurrence).n_grad_loops(n))
        shape = (cfg.batch_size, cfg.seq_len)
        x = torch.randint(0, cfg.model.vocab_size, shape, generator=self.gen)
        y = torch.randint(0, cfg.model.vocab_size, shape, generator=self.gen)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.v.autocast == "bf16" else nullcontext()
        with ctx:
            _, loss = self.net(x, n, n_grad_loops=k,
                               state=initial_state(cfg, self.step_i, Dist(), torch.device("cpu")), targets=y)
        if not torch.isfinite(loss):
            raise RuntimeError(f"loss became {loss.item()}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_i += 1
        self.last_loss = float(loss.detach())

    def measure(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        tps = steps * self.tokens_per_step / (time.perf_counter() - t0)
        self.samples.append(tps)
        return tps

    @property
    def median(self) -> float:
        return median(self.samples) if self.samples else float("nan")


def _reason(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}"


# ------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help=f"one of {', '.join(PRESETS)} (default cpu; tiny with --quick)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set batch_size=16 --set model.d_model=256 (repeat)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; 2 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant per round (default 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per variant first (default 2)")
    ap.add_argument("--loops", type=int, default=None, help="loop count n (default: the training-mean depth)")
    ap.add_argument("--variants", default=",".join(v.name for v in VARIANTS),
                    help="comma-separated subset of: " + ", ".join(v.name for v in VARIANTS))
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few steps: a smoke check")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    rounds = args.rounds if args.rounds is not None else (2 if quick else 5)
    steps = args.steps if args.steps is not None else (1 if quick else 3)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    if rounds < 1 or steps < 1 or warmup < 0:
        raise SystemExit("--rounds and --steps must be >= 1, --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = apply_overrides(preset(args.preset or ("tiny" if quick else "cpu")), args.overrides)
    by_name = {v.name: v for v in VARIANTS}
    wanted = [s.strip() for s in args.variants.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in by_name]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(by_name)}")
    if "baseline" not in wanted:
        wanted.insert(0, "baseline")  # every ratio is to it
    n = args.loops if args.loops is not None else max(1, round(cfg.recurrence.expected_loops()))
    if cfg.recurrence.max_loops is not None:
        n = min(n, cfg.recurrence.max_loops)
    k = RecurrenceSampler(cfg.recurrence).n_grad_loops(n)
    B, T, d = cfg.batch_size, cfg.seq_len, cfg.model.d_model

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, load avg {_loadavg()}")
    m = cfg.model
    print(f"config: d={m.d_model} heads={m.n_heads} P/R/C={m.n_prelude}/{m.n_core}/{m.n_coda} V={m.vocab_size} "
          f"batch={B} seq={T} ({B * T} tokens/step), n={n} loops, backprop_loops k={k}")
    print(f"timing: {rounds} rounds x {steps} steps per variant, {warmup} warmup steps; medians over rounds")

    # reference matmuls: square peak, the training shape (B*T, d) x (d, 4d), the lm_head shape, bf16 info
    sq = (256, 512) if quick else (1024, 2048)
    mms = [Matmul(f"fp32 {s}x{s}x{s}", s, s, s) for s in sq]
    mms.append(Matmul(f"fp32 train ({B * T}x{d})x({d}x{4 * d})", B * T, d, 4 * d))
    mms.append(Matmul(f"fp32 head ({B * T}x{d})x({d}x{m.vocab_size})", B * T, d, m.vocab_size))
    mms.append(Matmul(f"bf16 {sq[-1]}x{sq[-1]}x{sq[-1]}", sq[-1], sq[-1], sq[-1], dtype=torch.bfloat16))
    for mm in mms:
        mm.setup(0.05 if quick else 0.3)

    probe = DepthRecurrentLM(m)
    print("\n" + formula_text(cfg, probe, n, k) + "\n")

    runners: list[Runner] = []
    for name in wanted:
        v = by_name[name]
        t0 = time.perf_counter()
        try:
            r = Runner(v, cfg, n, args.seed)
            for _ in range(warmup):
                r.step()
            if r.v.compile != "none" and warmup == 0:
                r.step()  # never time the compilation
            if r.v.compile != "none":
                before = _graphs_compiled()
                for other in sorted({1, max(1, n - 3), n + 2}):
                    r.step(other)
                r.new_graphs = _graphs_compiled() - before
        except Exception as exc:  # a variant that fails is reported, not fatal
            if name == "baseline":
                traceback.print_exc()
                raise SystemExit("the baseline variant failed: nothing to compare against") from exc
            r = Runner.__new__(Runner)
            r.v, r.samples, r.skipped, r.warmup_s = v, [], _reason(exc), float("nan")
            print(f"  {name:18s} SKIPPED ({r.skipped})")
            runners.append(r)
            continue
        r.warmup_s = time.perf_counter() - t0
        extra = "" if r.new_graphs is None else f"; new graphs at other loop counts: {r.new_graphs}"
        print(f"  {name:18s} ready: build + {warmup} warmup steps in {r.warmup_s:.1f}s (loss {r.last_loss:.3f}{extra})")
        runners.append(r)
        gc.collect()

    live = [r for r in runners if r.skipped is None]
    items: list[Matmul | Runner] = [*mms, *live]
    for rnd, order in rotations(items, rounds):
        line = []
        for item in order:
            if isinstance(item, Matmul):
                item.measure()
                continue
            if item.skipped is not None:
                continue
            try:
                tps = item.measure(steps)
                line.append(f"{item.v.name} {tps:,.0f}")
            except Exception as exc:
                item.skipped = f"failed in round {rnd + 1}: {_reason(exc)}"
                line.append(f"{item.v.name} FAILED")
            gc.collect()
        peak_now = max(mm.samples[-1] for mm in mms[: len(sq)])
        print(f"round {rnd + 1}/{rounds}: tok/s " + ", ".join(line)
              + f" | fp32 square peak {peak_now / 1e9:.1f} GFLOP/s")

    # ------------------------------------------------------------------------------------------ report
    peak = max(mm.median for mm in mms[: len(sq)])
    peak_bf16 = mms[-1].median
    train_mm = mms[len(sq)].median
    print("\nmatmul FLOP/s (median over rounds):")
    for mm in mms:
        print(f"  {mm.name:42s} {mm.median / 1e9:8.1f} GFLOP/s  ({mm.reps} reps/sample)")
    print(f"  -> MFU denominators: fp32 square-matmul peak {peak / 1e9:.1f} GFLOP/s, bf16 {peak_bf16 / 1e9:.1f} "
          f"GFLOP/s; fp32 training-shape matmul {train_mm / 1e9:.1f} GFLOP/s")

    base_tps = next(r for r in runners if r.v.name == "baseline").median
    plain = next((r for r in runners if r.v.name == "fp32-eager" and r.samples), None)
    rows = []
    for r in runners:
        row: dict = {"variant": r.v.name, "what": r.v.what, "skipped": r.skipped}
        if r.samples:
            fpt = train_flops_per_token(r.model, n, r.k, T)
            tps = r.median
            achieved = tps * fpt
            dtype_peak = peak_bf16 if r.v.autocast == "bf16" else peak
            row.update(
                tokens_per_s=tps, ms_per_step=1e3 * r.tokens_per_step / tps, train_flops_per_token=fpt,
                model_flops_per_s=achieved, mfu=achieved / dtype_peak, mfu_fp32=achieved / peak,
                mfu_vs_train_shape=achieved / train_mm, dtype="bf16" if r.v.autocast == "bf16" else "fp32",
                x_baseline=tps / base_tps, x_fp32_eager=tps / plain.median if plain else None,
                samples_tokens_per_s=r.samples, warmup_s=r.warmup_s, backprop_loops=r.k,
                new_graphs_at_other_depths=r.new_graphs,
            )
            row["target_met"] = (row["mfu"] >= TARGET_MFU and row["x_fp32_eager"] is not None
                                 and row["x_fp32_eager"] >= TARGET_SPEEDUP)
        rows.append(row)

    print(f"\n{'variant':18s} {'tok/s':>9s} {'ms/step':>8s} {'GFLOP/s':>8s} {'dtype':>5s} {'MFU':>6s} "
          f"{'MFU32':>6s} {'x fp32':>7s} {'x base':>7s} {'spread':>6s} {'warmup':>7s} {'regraph':>7s}  target")
    for row, r in zip(rows, runners, strict=True):
        if "tokens_per_s" not in row:
            print(f"{row['variant']:18s} skipped: {row['skipped']}")
            continue
        spread_ = spread(r.samples)
        xf = f"{row['x_fp32_eager']:6.2f}x" if row["x_fp32_eager"] is not None else "    n/a"
        regraph = "-" if r.new_graphs is None else str(r.new_graphs)
        print(f"{row['variant']:18s} {row['tokens_per_s']:9,.0f} {row['ms_per_step']:8.0f} "
              f"{row['model_flops_per_s'] / 1e9:8.1f} {row['dtype']:>5s} {row['mfu']:6.3f} {row['mfu_fp32']:6.3f} "
              f"{xf} {row['x_baseline']:6.2f}x {spread_:6.0%} {r.warmup_s:6.1f}s {regraph:>7s}   "
              f"{'MET' if row['target_met'] else 'not met'}"
              + (f"   (then failed: {row['skipped']})" if row["skipped"] else ""))
    print(f"(MFU = model FLOP/s / square-matmul peak of the variant's dtype; MFU32 = / fp32 peak; x fp32 = / "
          f"fp32-eager; warmup = build + warm-up steps incl. compilation; regraph = graphs dynamo compiled for "
          f"steps at other loop counts after warm-up (must be 0); target: MFU >= {TARGET_MFU} and >= "
          f"{TARGET_SPEEDUP}x fp32-eager)")

    measured = {row["variant"]: row for row in rows if "tokens_per_s" in row}
    best = max(measured.values(), key=lambda row: row["tokens_per_s"])
    met = ", ".join(r["variant"] for r in measured.values() if r["target_met"]) or "none"
    print(f"fastest: {best['variant']} ({best['tokens_per_s']:,.0f} tok/s, MFU {best['mfu']:.3f} of its dtype's "
          f"peak); variants meeting the target: {met}")

    if args.json:
        out = {
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "config": cfg.to_dict(), "n_loops": n, "backprop_loops": k, "rounds": rounds, "steps": steps,
            "warmup": warmup, "formula": formula_text(cfg, probe, n, k),
            "matmul": [{"name": mm.name, "shape": [mm.m, mm.k, mm.n], "dtype": str(mm.dtype),
                        "flops_per_s": mm.median, "samples": mm.samples} for mm in mms],
            "peak_flops_per_s": peak, "peak_bf16_flops_per_s": peak_bf16, "train_shape_flops_per_s": train_mm,
            "target": {"mfu": TARGET_MFU, "x_baseline": TARGET_SPEEDUP}, "variants": rows,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def _graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


if __name__ == "__main__":
    sys.exit(main())
