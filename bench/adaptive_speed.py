"""Realized speedup of per-token halting: FLOP proxy versus wall-clock at matched quality, side by side.

    .venv/bin/python bench/adaptive_speed.py --run data/reference --data data/corpus/default
    .venv/bin/python bench/adaptive_speed.py --run data/reference --windows 64 --rounds 5 --json runs/bench/speed.json
    .venv/bin/python bench/adaptive_speed.py --run runs/cpu/final --families kl,state_delta,cosine --threads 2

In one process (``drc_book.speed_checks.run_speed``): each rule family's threshold is matched to
uniform depth r's validation cross-entropy (within ``--ce-tolerance`` nats, on the same windows:
lowest-average-depth grid point, offline sweep checked online); then, interleaved over ``--rounds`` rounds with medians,

* batched eval: ``model(x, r)`` against ``skip_forward`` with each matched rule (and with ``Uniform(r)``,
  which shows the skipping machinery's own overhead at equal depth);
* generation: ``generate`` with ``Uniform(r)`` against ``generate`` with each matched rule, same prompt, same
  number of greedy new tokens; time per new token with the prompt pass subtracted;
* the measurement pass: ``measure_windows`` at 32 loops against one depth-32 forward and a bare pass that
  reads out at every loop;
* decoders (``--decoders 1,8,32``): the dense KV-cached decoder at depth r, step-synchronous ``generate`` and
  continuous depth batching (``generate_continuous``) for ``Uniform(r)`` and the matched KL, state-change,
  cosine and acceleration rules, at each batch size; the realization ratio and its targets; then serving
  (``--serving-slots``): the first windows as requests of mixed lengths behind that many slots, per-request
  latency percentiles. ``--only-decoders`` matches the rules and runs just this part.

It prints the FLOP proxy (r / average exit loop), the matmul-FLOP model of ``drc_core.halting.skipping``, the
wall-clock speedup and wall-clock / proxy against the issue's target (>= 0.9), and the measurement-pass ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

import drc_core
from drc_book.speed import (
    TARGET_MEASURE,
    TARGET_RATIO,
    SpeedConfig,
    decode_loop_cost,
    decode_prediction,
    decoder_targets,
    matched_rules,
    serving_latency,
    skip_overhead,
    time_decoders,
)
from drc_book.speed_checks import (
    SpeedReport,
    anderson_configs,
    anderson_table,
    bf16_check,
    measurement_pass,
    run_speed,
)
from drc_book.workspace import save_results
from drc_core.analysis.measure import val_windows_with_docs
from drc_core.data.sampler import Corpus
from drc_core.errors import DrcError, run_cli
from drc_core.halting.sweep import default_families
from drc_core.model.lm import DepthRecurrentLM
from drc_core.model.precision import bf16_support
from drc_core.training.rundir import open_run


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
    ap.add_argument("--families", default=",".join(default_families()),
                    help="comma-separated rule families of drc_core.halting.sweep.default_rules "
                         "(default: every training-free family, drc_core.halting.sweep.default_families())")
    ap.add_argument("--rule-max-loops", type=int, default=16, help="every rule's max_loops (default 16)")
    ap.add_argument("--ce-tolerance", type=float, default=0.005, help="matched quality: CE <= CE(uniform r) + this")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated per timed call")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt: the first tokens of the first windows")
    ap.add_argument("--gen-rows", type=int, default=1, help="prompts decoded together (batch rows)")
    ap.add_argument("--more-gen-rows", default="8", help="further generation batch sizes, comma-separated ('' none)")
    ap.add_argument("--fused", choices=("auto", "on", "off"), default="auto",
                    help="readout statistics through the compiled kernel (auto: where a C++ compiler exists)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall (perf_counter) or cpu (process time: robust to other jobs with --threads 1)")
    ap.add_argument("--allocator", choices=("keep", "default"), default="keep",
                    help="keep: glibc keeps freed memory for reuse while timing (drc_book.cost."
                         "keep_freed_memory); default: glibc's own settings (fresh buffers fault, by luck of order)")
    ap.add_argument("--no-presets", action="store_true", help="do not time Huginn's presets")
    ap.add_argument("--no-profile", action="store_true", help="do not profile one batch")
    ap.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                    help="also compare fp32 with bf16 autocast (auto: where drc_core.model.precision.bf16_support says "
                         "the device does bf16 fast)")
    ap.add_argument("--anderson-windows", type=int, default=8,
                    help="windows for the Anderson-acceleration table (0: skip it)")
    ap.add_argument("--measure-windows", type=int, default=8, help="windows for the measurement-pass comparison")
    ap.add_argument("--measure-loops", type=int, default=32, help="loops of the measurement pass (default 32)")
    ap.add_argument("--decoders", default="1,8,32", help="batch sizes for the decoder comparison ('' none)")
    ap.add_argument("--serving-slots", type=int, default=8, help="slots of the serving comparison (0: none)")
    ap.add_argument("--only-decoders", action="store_true", help="match the rules, then only the decoder comparison")
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
             f"{x.wall_over_proxy:.2f}", f"{x.page_faults_per_batch:,.0f}"] for _, x in b.iterrows()]
    out.append(_fmt_table(rows, ["variant", "path", "avg loops", "CE", "dCE", "s", "spread", "proxy",
                                 "matmul", "wall", "wall/proxy", "faults/batch"]))
    out.append("\n  honest FLOPs (the work each run really did: core + readouts performed + vocabulary-sized "
               "statistics):")
    rows = [[x.family, x.rule, f"{x.avg_loops:.2f}", f"{x.ce_gap:+.4f}", f"{x.proxy_speedup:.2f}x",
             f"{x.honest_flops / 1e6:.2f} M", f"{x.honest_speedup:.2f}x", f"{x.wallclock_speedup:.2f}x",
             f"{x.wall_over_proxy:.2f}", f"{x.wall_over_honest:.2f}"] for _, x in b.iterrows()]
    out.append(_fmt_table(rows, ["family", "variant", "avg loops", "dCE", "proxy", "honest FLOPs/token", "honest",
                                 "wall", "wall/proxy", "wall/honest"]))

    g = rep.generation
    out.append(f"\ngeneration: {cfg.gen_rows} row(s), prompt {cfg.prompt_len} tokens, {cfg.new_tokens} greedy new "
               f"tokens; ms per new token = (t(n) - t(1)) / (n - 1), medians over {cfg.rounds} rounds")
    rows = [[int(x.rows), x.rule, f"{x.avg_loops:.3f}", f"{x.loops_run:.2f}", f"{x.first_divergence:.0f}",
             f"{x.same_tokens:.0%}",
             f"{x.ms_per_token:.2f}", f"{x.tokens_per_s:.0f}", f"{x.prompt_ms:.1f}",
             f"{x.spread:.0%}", f"{x.proxy_speedup:.2f}x", f"{x.honest_speedup:.2f}x", f"{x.wallclock_speedup:.2f}x",
             f"{x.wall_over_proxy:.2f}", f"{x.wall_over_honest:.2f}"] for _, x in g.iterrows()]
    out.append(_fmt_table(rows, ["batch", "variant", "avg loops", "loops run", "1st diff", "same tok", "ms/step",
                                 "tokens/s", "prompt ms", "spread", "proxy", "honest", "wall", "wall/proxy",
                                 "wall/honest"]))

    ms = rep.measurement
    out.append(f"\nmeasurement pass: {ms.windows.iloc[0]} windows, {ms.loops.iloc[0]} loops, medians over "
               f"{cfg.rounds} rounds")
    rows = [[x["pass"], f"{x.seconds:.3f}", f"{x.spread:.0%}", f"{x.x_forward:.2f}x", f"{x.x_readout_pass:.2f}x"]
            for _, x in ms.iterrows()]
    out.append(_fmt_table(rows, ["pass", "s", "spread", "x forward", "x readout pass"]))

    if rep.targets is not None:
        out.append("\nspeed targets (matched quality):")
        rows = [[x.setting, x.rule, x.target, f"{x.value:.3f}", f"{x.threshold:g}", "MET" if x.met else "NOT met"]
                for _, x in rep.targets.iterrows()]
        out.append(_fmt_table(rows, ["setting", "rule", "target", "value", "threshold", "verdict"]))
    if rep.profile_kinds is not None:
        out.append("\nprofile of one batch (torch.profiler, self CPU ms by kind of op):")
        pk = rep.profile_kinds.pivot_table(index="variant", columns="kind", values="ms", sort=False)
        kinds = [k for k in pk.columns if k != "total"] + ["total"]
        rows = [[v, *(f"{pk.loc[v, k]:.0f}" if k in pk.columns and pk.loc[v, k] == pk.loc[v, k] else "-"
                     for k in kinds)] for v in pk.index]
        out.append(_fmt_table(rows, ["variant", *kinds]))
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
               f"(target as worded: <= {TARGET_MEASURE}x -> {met}); = {mw.x_readout_pass:.2f}x the bare "
               "every-loop readout pass.")
    out.append(f"  The bare readout pass alone costs {ro.x_forward:.2f}x a depth-{mw.loops} forward: per-loop "
               f"statistics need the coda, the {vocab}-way head and a log-softmax at "
               "every loop, so <= 1.2x one forward cannot hold as worded; the measurement's own overhead is its "
               "ratio to the readout pass.")
    return "\n".join(out)


def decoders(model: DepthRecurrentLM, windows: torch.Tensor, specs: list, cfg: SpeedConfig, batches: tuple[int, ...],
             slots: int) -> dict:
    """The decoder comparison and serving latency, printed; returns them for the JSON."""
    out: dict = {}
    rules = [sp for sp in specs if sp.family in (drc_core.KLThreshold.family, *drc_core.state_families())]
    prompt = windows[:, : cfg.prompt_len]
    batches = tuple(b for b in batches if b <= len(prompt))
    if batches:
        table = time_decoders(model, prompt, rules, cfg, batches=batches)
        cols = ["batch", "rule", "path", "avg_loops", "ms_per_step", "tokens_per_s", "x_dense", "flop_speedup",
                "realization"]
        print(f"\ndecoders: {cfg.new_tokens} greedy tokens after {cfg.prompt_len}-token prompts; time per decode step "
              f"(prompt pass subtracted), medians of {cfg.rounds} interleaved rounds:")
        print(table[cols].round(3).to_string(index=False))
        if "same_as_generate" in table:
            same = table.same_as_generate.dropna()
            print(f"continuous batching gives generate's tokens and exit loops: {bool(same.all())} ({len(same)} runs)")
        targets = decoder_targets(table, batches=[b for b in batches if b > 1])
        print(targets.round(3).to_string(index=False))
        out.update(decoders=table.to_dict("records"), decoder_targets=targets.to_dict("records"))
    state = [sp for sp in rules if sp.family == "state_delta"]
    if slots > 0 and state and len(prompt) > slots:
        short = max(1, cfg.new_tokens // 4)
        lat = serving_latency(model, prompt, state[0].rule, slots=slots, new_tokens=(short, cfg.new_tokens), cfg=cfg)
        print(f"\nserving {len(prompt)} requests ({short} or {cfg.new_tokens} new tokens each) with "
              f"{slots} slots, {state[0].rule}: latency (s) to each request's last token")
        print(lat.round(3).to_string(index=False))
        out["serving"] = lat.to_dict("records")
    return out


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
    try:
        more_rows = tuple(int(v) for v in args.more_gen_rows.split(",") if v.strip())
    except ValueError:
        raise DrcError(f"--more-gen-rows {args.more_gen_rows!r} is invalid: give batch sizes like 8 or 4,8") from None
    fused = args.fused == "on" or (args.fused == "auto" and bool(shutil.which("g++") or shutil.which("c++")))
    cfg = SpeedConfig(reference_loops=r, rule_max_loops=args.rule_max_loops,
                      families=tuple(f.strip() for f in args.families.split(",") if f.strip()),
                      ce_tolerance=args.ce_tolerance, batch_size=args.batch_size, rounds=args.rounds,
                      new_tokens=args.new_tokens, prompt_len=args.prompt_len, gen_rows=args.gen_rows,
                      measure_loops=args.measure_loops, measure_windows=args.measure_windows,
                      more_gen_rows=more_rows, fused=fused, clock=args.clock, presets=not args.no_presets,
                      profile=not args.no_profile, keep_freed=args.allocator == "keep")
    windows, _ = val_windows_with_docs(corpus, seq_len, args.windows)
    c = model.cfg
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, load avg {_loadavg()}; clock {cfg.clock}, fused "
          f"statistics {'on' if cfg.fused else 'off'}, allocator {args.allocator}")
    print(f"model {args.run}: {model.num_params() / 1e6:.2f} M params, d={c.d_model}, heads={c.n_heads}, "
          f"P/R/C={c.n_prelude}/{c.n_core}/{c.n_coda}, V={c.vocab_size}; corpus {args.data}: {len(windows)} "
          f"validation windows x {seq_len} tokens; uniform depth r={r}")
    t0 = time.perf_counter()
    try:
        decoder_batches = tuple(int(v) for v in args.decoders.split(",") if v.strip())
    except ValueError:
        raise DrcError(f"--decoders {args.decoders!r} is invalid: give batch sizes like 8 or 1,8,32") from None
    if args.only_decoders:
        matched = matched_rules(model, windows, cfg)
        print(matched.table.round(4).to_string(index=False))
        out = decoders(model, windows, matched.specs, cfg, decoder_batches, args.serving_slots)
        print(f"total {time.perf_counter() - t0:.0f} s")
        if json_path is not None:
            out["matched"] = matched.table.to_dict("records")
            print(f"wrote {save_results(json_path.parent, json_path.stem, out)}")
        return 0
    rep = run_speed(model, windows, cfg, log=None if args.quiet else (lambda s: print("  " + s, flush=True)))
    print(report(rep, r, c.vocab_size))
    most = max((cfg.gen_rows, *cfg.more_gen_rows))
    cost = None
    if most > 1:
        cost = decode_loop_cost(model, windows[:, : cfg.prompt_len], cfg,
                                rows=sorted({1, *(2**k for k in range(1, most.bit_length())), most}))
        print(f"\ndecode loop cost by active rows (fit: {cost.fixed_ms.iloc[0]:.3f} ms per loop + "
              f"{cost.per_row_ms.iloc[0]:.3f} ms per active row):")
        print(cost.round(3).to_string(index=False))
        print("expected core-loop speed-up at that cost (loop_cost_speedup) beside the measured one:")
        print(decode_prediction(rep.generation, cost).round(3).to_string(index=False))
    bf16 = kl_check = None
    fast = bf16_support(next(model.parameters()).device)
    if args.bf16 == "on" or (args.bf16 == "auto" and fast):
        named = [sp for sp in rep.matched.specs
                 if sp.family in (drc_core.KLThreshold.family, drc_core.StateDelta.family)]
        bf16, kl_check = bf16_check(model, windows, named, cfg)
        print(f"\nbf16 autocast against fp32 ({fast or 'no fast bf16 on this device'}); same windows, "
              f"medians of {cfg.rounds} interleaved rounds:")
        print(bf16.round(4).to_string(index=False))
        print("  successive KL under bf16 against fp32, first batch (relative difference over tokens):")
        print(kl_check.round(5).to_string(index=False))
    anderson = None
    if args.anderson_windows > 0:
        anderson = anderson_table(model, windows[: args.anderson_windows], anderson_configs(),
                                  batch_size=min(args.batch_size, args.anderson_windows), time_rounds=args.rounds)
        print(f"\nAnderson acceleration of the core iteration ({args.anderson_windows} windows; per-sequence, damping "
              "0.7; mean core evaluations per token until the successive KL stays below eps; reference: plain "
              "iteration at 32 loops):")
        print(anderson.round(6).to_string(index=False))
    dec = decoders(model, windows, rep.matched.specs, cfg, decoder_batches, args.serving_slots)
    print(f"total {time.perf_counter() - t0:.0f} s")
    if json_path is not None:
        out = {**dec, "torch": torch.__version__, "threads": torch.get_num_threads(), "run": args.run,
               "data": args.data, "windows": len(windows), "seq_len": seq_len, **rep.to_dict(),
               "anderson": None if anderson is None else anderson.to_dict("records"),
               "decode_loop_cost": None if cost is None else cost.to_dict("records"),
               "bf16": None if bf16 is None else bf16.to_dict("records"),
               "bf16_kl": None if kl_check is None else kl_check.to_dict("records")}
        print(f"wrote {save_results(json_path.parent, json_path.stem, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
