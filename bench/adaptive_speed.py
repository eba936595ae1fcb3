"""Realized speedup of per-token halting: FLOP proxy versus wall-clock at matched quality, side by side.

    .venv/bin/python bench/adaptive_speed.py --run data/reference --data data/corpus/default
    .venv/bin/python bench/adaptive_speed.py --run data/reference --windows 64 --rounds 5 --json runs/bench/speed.json
    .venv/bin/python bench/adaptive_speed.py --run runs/cpu/final --families kl,state_delta,cosine --threads 2

In one process (``drc_core.experiments.speed.run_speed``): each rule family's threshold is matched to uniform depth r's
validation cross-entropy (within ``--ce-tolerance`` nats, on the same windows: lowest-average-depth grid
point, offline sweep checked online); then, interleaved over ``--rounds`` rounds with medians,

* batched eval: ``model(x, r)`` against ``skip_forward`` with each matched rule (and with ``Uniform(r)``,
  which shows the skipping machinery's own overhead at equal depth);
* generation: ``generate`` with ``Uniform(r)`` against ``generate`` with each matched rule, same prompt, same
  number of greedy new tokens; time per new token with the prompt pass subtracted;
* the measurement pass: ``measure_windows`` at 32 loops against one depth-32 forward and a bare pass that
  reads out at every loop.

It prints the FLOP proxy (r / average exit loop), the matmul-FLOP model of ``drc_core.halting.skipping``, the
wall-clock speedup and wall-clock / proxy against the issue's target (>= 0.9), and the measurement-pass ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from drc_core.analysis.measure import val_windows_with_docs
from drc_core.book.workspace import save_results
from drc_core.data.sampler import Corpus
from drc_core.errors import DrcError, run_cli
from drc_core.experiments.speed import (
    TARGET_MEASURE,
    TARGET_RATIO,
    SpeedConfig,
    SpeedReport,
    measurement_pass,
    run_speed,
    skip_overhead,
)
from drc_core.model import DepthRecurrentLM
from drc_core.rundir import open_run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="data/reference", metavar="DIR",
                    help="model directory (model.safetensors + config.json), e.g. data/reference or runs/x/final")
    ap.add_argument("--data", default="data/corpus/default", metavar="DIR", help="prepared corpus the model was "
                    "trained on (its validation windows are used)")
    ap.add_argument("--windows", type=int, default=32, help="validation windows (default 32)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="tokens per window (default: the run's train_config.json seq_len, else max_seq_len)")
    ap.add_argument("--loops", type=int, default=None,
                    help="uniform depth r to match and beat (default: the run's training-mean depth, else 8)")
    ap.add_argument("--rounds", type=int, default=3, help="timed interleaved rounds (default 3)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--families", default="kl,state_delta",
                    help="comma-separated rule families of drc_core.halting.sweep.default_rules "
                         "(default kl,state_delta)")
    ap.add_argument("--rule-max-loops", type=int, default=16, help="every rule's max_loops (default 16)")
    ap.add_argument("--ce-tolerance", type=float, default=0.005, help="matched quality: CE <= CE(uniform r) + this")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated per timed call")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt: the first tokens of the first windows")
    ap.add_argument("--gen-rows", type=int, default=1, help="prompts decoded together (batch rows)")
    ap.add_argument("--measure-windows", type=int, default=8, help="windows for the measurement-pass comparison")
    ap.add_argument("--measure-loops", type=int, default=32, help="loops of the measurement pass (default 32)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")
    ap.add_argument("--quiet", action="store_true", help="no per-round lines")
    return ap


def load_run(run: str) -> tuple[DepthRecurrentLM, dict]:
    """The model in ``run`` (a training run, its final/ or a shipped copy; eval mode) and its training config
    as a dict (empty if absent)."""
    path = Path(run)
    if not path.is_dir():
        raise DrcError(f"model directory '{path}' does not exist: pass --run with a directory like data/reference")
    found = open_run(path)
    return found.load_model(), (found.train_config_dict() if found.train_config_path else {})


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _fmt_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    line = lambda r: "  " + "  ".join(f"{str(c):>{w}}" if i else f"{str(c):<{w}}"  # noqa: E731
                                      for i, (c, w) in enumerate(zip(r, widths, strict=True)))
    return "\n".join([line(header), *(line(r) for r in rows)])


def report(rep: SpeedReport, r: int, vocab: int) -> str:
    """The printed report: matching, the two timing tables, the measurement pass, and the verdicts."""
    cfg, out = rep.config, []
    m = rep.matched.table
    out.append(f"\nmatched quality: CE <= CE(uniform {r}) + {cfg.ce_tolerance:g} = {m.ce_target.iloc[0]:.4f} nats "
               f"(CE(uniform {r}) = {m.ce_uniform.iloc[0]:.4f}); grid of drc_core.halting.sweep.default_rules, "
               f"max_loops {cfg.rule_max_loops}")
    rows = []
    for _, x in m.iterrows():
        rows.append([x.family, x.rule, f"{x.avg_loops_offline:.3f}", f"{x.ce_offline:.4f}", f"{x.avg_loops:.3f}",
                     f"{x.ce:.4f}", "yes" if x.within_tolerance else f"NO ({x.note})"])
    out.append(_fmt_table(rows, ["family", "chosen rule", "loops off", "CE off", "loops on", "CE on", "within"]))

    b = rep.batched
    out.append(f"\nbatched eval: {b.tokens_per_s.iloc[0] * b.seconds.iloc[0]:,.0f} tokens, batch {cfg.batch_size}; "
               f"median seconds over {cfg.rounds} interleaved rounds")
    rows = [[x.rule, x.path, f"{x.avg_loops:.3f}", f"{x.ce:.4f}", f"{x.ce_gap:+.4f}", f"{x.seconds:.3f}",
             f"{x.spread:.0%}", f"{x.proxy_speedup:.2f}x", f"{x.flop_speedup:.2f}x", f"{x.wallclock_speedup:.2f}x",
             f"{x.wall_over_proxy:.2f}"] for _, x in b.iterrows()]
    out.append(_fmt_table(rows, ["variant", "path", "avg loops", "CE", "dCE", "s", "spread", "proxy",
                                 "matmul", "wall", "wall/proxy"]))

    g = rep.generation
    out.append(f"\ngeneration: {cfg.gen_rows} row(s), prompt {cfg.prompt_len} tokens, {cfg.new_tokens} greedy new "
               f"tokens; ms per new token = (t(n) - t(1)) / (n - 1), medians over {cfg.rounds} rounds")
    rows = [[x.rule, f"{x.avg_loops:.3f}", f"{x.first_divergence:.0f}", f"{x.same_tokens:.0%}",
             f"{x.ms_per_token:.2f}", f"{x.prompt_ms:.1f}",
             f"{x.spread:.0%}", f"{x.proxy_speedup:.2f}x", f"{x.flop_speedup:.2f}x", f"{x.wallclock_speedup:.2f}x",
             f"{x.wall_over_proxy:.2f}"] for _, x in g.iterrows()]
    out.append(_fmt_table(rows, ["variant", "avg loops", "1st diff", "same tok", "ms/token", "prompt ms", "spread",
                                 "proxy", "matmul", "wall", "wall/proxy"]))

    ms = rep.measurement
    out.append(f"\nmeasurement pass: {ms.windows.iloc[0]} windows, {ms.loops.iloc[0]} loops, medians over "
               f"{cfg.rounds} rounds")
    rows = [[x["pass"], f"{x.seconds:.3f}", f"{x.spread:.0%}", f"{x.x_forward:.2f}x", f"{x.x_readout_pass:.2f}x"]
            for _, x in ms.iterrows()]
    out.append(_fmt_table(rows, ["pass", "s", "spread", "x forward", "x readout pass"]))

    out.append(f"\nverdicts (target: wall-clock speedup >= {TARGET_RATIO} x FLOP proxy at matched quality):")
    for frame in (b, g):
        for _, x in frame[~frame.baseline & (frame.family != "uniform")].iterrows():
            verdict = "MET" if x.wall_over_proxy >= TARGET_RATIO else "NOT met"
            if not bool(m[m.rule == x.rule].within_tolerance.all()):
                verdict += " (quality NOT matched)"
            out.append(f"  {x.setting:12s} {x.rule:22s} proxy {r}/{x.avg_loops:.2f} = {x.proxy_speedup:.2f}x, "
                       f"wall-clock {x.wallclock_speedup:.2f}x, ratio {x.wall_over_proxy:.2f} -> {verdict}")
    out.append(f"  (skip_forward with Uniform({r}) runs at {skip_overhead(b):.2f}x the dense "
               f"forward: the fixed cost of gathering/scattering active tokens, before any halting)")
    mw, ro = measurement_pass(ms, "measure_kl_final"), measurement_pass(ms, "readout")
    met = "MET" if mw.x_forward <= TARGET_MEASURE else "NOT met"
    out.append(f"measurement pass (kl_to_final=True) = {mw.x_forward:.2f}x one depth-{mw.loops} forward "
               f"(issue target as worded: <= {TARGET_MEASURE}x -> {met}); = {mw.x_readout_pass:.2f}x the bare "
               "every-loop readout pass.")
    out.append(f"  The bare readout pass alone costs {ro.x_forward:.2f}x a depth-{mw.loops} forward: per-loop "
               f"statistics need the coda, the {vocab}-way head and a log-softmax at "
               "every loop, so <= 1.2x one forward cannot hold as worded; the measurement's own overhead is its "
               "ratio to the readout pass.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("windows", "rounds", "new_tokens", "prompt_len", "measure_windows"):
        v = getattr(args, name)
        if v < 1:
            raise DrcError(f"--{name.replace('_', '-')} {v} is invalid: it must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise DrcError(f"--threads {args.threads} is invalid: it must be >= 1")
        torch.set_num_threads(args.threads)
    json_path = Path(args.json) if args.json else None
    if json_path is not None and json_path.suffix != ".json":
        raise DrcError(f"--json {json_path} is invalid: name a .json file, e.g. runs/bench/speed.json")
    model, train_cfg = load_run(args.run)
    corpus = Corpus.open(args.data)
    if corpus.vocab_size != model.cfg.vocab_size:
        raise DrcError(f"corpus '{args.data}' has vocabulary {corpus.vocab_size} but the model in '{args.run}' has "
                       f"{model.cfg.vocab_size}: pass the corpus the model was trained on")
    seq_len = args.seq_len or int(train_cfg.get("seq_len", model.cfg.max_seq_len))
    if not 1 <= seq_len <= model.cfg.max_seq_len:
        raise DrcError(f"--seq-len {seq_len} is invalid: it must be in [1, max_seq_len={model.cfg.max_seq_len}]")
    r = args.loops or int(round(train_cfg.get("recurrence", {}).get("mean", 8)))
    cfg = SpeedConfig(reference_loops=r, rule_max_loops=args.rule_max_loops,
                      families=tuple(f.strip() for f in args.families.split(",") if f.strip()),
                      ce_tolerance=args.ce_tolerance, batch_size=args.batch_size, rounds=args.rounds,
                      new_tokens=args.new_tokens, prompt_len=args.prompt_len, gen_rows=args.gen_rows,
                      measure_loops=args.measure_loops, measure_windows=args.measure_windows)
    windows, _ = val_windows_with_docs(corpus, seq_len, args.windows)
    c = model.cfg
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, load avg {_loadavg()}")
    print(f"model {args.run}: {model.num_params() / 1e6:.2f} M params, d={c.d_model}, heads={c.n_heads}, "
          f"P/R/C={c.n_prelude}/{c.n_core}/{c.n_coda}, V={c.vocab_size}; corpus {args.data}: {len(windows)} "
          f"validation windows x {seq_len} tokens; uniform depth r={r}")
    t0 = time.perf_counter()
    rep = run_speed(model, windows, cfg, log=None if args.quiet else (lambda s: print("  " + s, flush=True)))
    print(report(rep, r, c.vocab_size))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if json_path is not None:
        out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "run": args.run, "data": args.data,
               "windows": len(windows), "seq_len": seq_len, **rep.to_dict()}
        print(f"wrote {save_results(json_path.parent, json_path.stem, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
