"""The README's "Headline results" block and the generated tables of docs/*.md, from the executed reference book's
results (``make docs`` runs ``--write``).

    .venv/bin/python scripts/readme_tables.py            # print the README block
    .venv/bin/python scripts/readme_tables.py --write    # rewrite README.md and every docs block between its markers
    .venv/bin/python scripts/readme_tables.py --check    # exit 1 if any of them is not what this generates

A docs page holds a generated table between ``<!-- generated:NAME:start -->`` and ``<!-- generated:NAME:end -->``;
the function that writes it is registered with ``@doc_block(page, NAME)`` below (:data:`DOC_BLOCKS`).

Every number comes from ``papermill_runs/reference/results/*.json`` (what ``make book`` writes); the table names
the file and key of each row. ``tests/test_readme.py`` checks that README.md holds exactly this block.

**Adding a table** (for instance a second model's): write one function ``def name(res: Results) -> str | None``
below the others and decorate it with ``@section``; the block is the sections' outputs in definition order,
separated by blank lines. ``res.get("NN_name")`` is the parsed ``NN_name.json`` or None when that file does not
exist, so a section for a notebook that has not been run returns None and leaves its part out;
``res.need("NN_name")`` is for files a section cannot do without (it raises, naming the file), and
``res.record(Cls)`` is the typed record of a notebook (:mod:`drc_book.handoff`) read from ``need``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import drc_core
from drc_book.handoff import Compute, Convergence, Halting, KnownDepth, Record, Training
from drc_book.report import GAIN_FAMILIES
from drc_book.runner import read_timings
from drc_core import KLThreshold, Oracle

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "papermill_runs" / "reference" / "results"
README = ROOT / "README.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"


class Results:
    """The JSON files of one results directory, read on first use."""

    def __init__(self, directory: Path = RESULTS) -> None:
        self.directory = Path(directory)
        self._cache: dict[str, dict | None] = {}

    def timings(self) -> dict[str, dict]:
        """The reference book's ``timings.json`` (beside the results directory): notebook -> seconds and machine."""
        return read_timings(self.directory.parent / "timings.json")

    def machine(self, notebook: str = "05_compute") -> dict | None:
        """The kind of machine that ran ``notebook`` (its entry in ``timings.json``), if recorded."""
        entry = self.timings().get(notebook)
        return None if entry is None or entry["cpu"] == "unknown" else entry

    def get(self, name: str) -> dict | None:
        if name not in self._cache:
            path = self.directory / f"{name}.json"
            self._cache[name] = json.loads(path.read_text()) if path.is_file() else None
        return self._cache[name]

    def record(self, cls: type[Record]) -> Any:
        """The typed record of ``cls.NOTEBOOK`` in this directory (a missing file raises as :meth:`need`)."""
        return cls.from_results(self.need(cls.NOTEBOOK))

    def need(self, name: str) -> dict:
        data = self.get(name)
        if data is None:
            raise FileNotFoundError(f"{self.directory / (name + '.json')} is missing: run `make book` first")
        return data


Section = Callable[[Results], "str | None"]
SECTIONS: list[Section] = []


def section(fn: Section) -> Section:
    """Register a table of the block (in definition order)."""
    SECTIONS.append(fn)
    return fn


DOCS = ROOT / "docs"
DOC_BLOCKS: dict[tuple[str, str], Section] = {}  # (page under docs/, block name) -> its renderer


def doc_block(page: str, block: str) -> Callable[[Section], Section]:
    """Register the renderer of the generated block ``block`` of ``docs/<page>``."""
    def register(fn: Section) -> Section:
        DOC_BLOCKS[(page, block)] = fn
        return fn
    return register


def markers(block: str) -> tuple[str, str]:
    return f"<!-- generated:{block}:start -->", f"<!-- generated:{block}:end -->"


# ------------------------------------------------------------------------------------------------------ helpers


def name(family: str) -> str:
    """A family in words, as the registry titles it ("state change" for ``state_delta``)."""
    return drc_core.family_title(family)


def sci(x: float) -> str:
    """1e-3 rather than 0.001."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def pct(x: float) -> str:
    return f"{x * 100:.0f}%".replace("-", "−")


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def speedups(entries: list[dict], families: set[str]) -> list[tuple[str, float, str]]:
    """(rule, wall-clock speed-up over the baseline, the speed-up with its interval) for the matched rules, fastest
    first."""
    rows = [(e["family"], e["wallclock_speedup"], xi(e)) for e in entries
            if not e["baseline"] and e["family"] in families]
    return sorted(rows, key=lambda r: -r[1])


PAIRED = ("Brackets: the interval of the median over rounds of each round's paired ratio (`speedup_lo`, "
          "`speedup_hi`; its coverage is `speedup_coverage`, 75% with three rounds).")


def xi(e: dict) -> str:
    """A row's wall-clock speed-up with the interval of its paired per-round median, where the record has one."""
    lo, hi = e.get("speedup_lo"), e.get("speedup_hi")
    return x(e["wallclock_speedup"]) + ("" if lo is None or hi is None else f" [{lo:.2f}, {hi:.2f}]")


# ----------------------------------------------------------------------------------------------------- sections


@section
def reference_model(res: Results) -> str:
    """The reference model (data/reference) as the reference book measured it."""
    train, conv = res.record(Training), res.record(Convergence)
    halt, speed = res.record(Halting), res.record(Compute)
    ce = train.ce_by_loops
    gaps = halt.gap_intervals
    ref = halt.reference_loops

    def saved(family: str) -> str:
        g = gaps[family]["saved_frac"]
        return (f"{gaps[family]['family_depth'].value:.2f} loops: {pct(g.value)} [{pct(g.lo)}, {pct(g.hi)}] fewer "
                "than uniform depth")

    own_rows = {KLThreshold.family, Oracle.family}  # the rows above; the others share one row
    others = sorted((g["family_depth"].value, f) for f, g in gaps.items() if f not in own_rows)
    matched = {m["family"] for m in speed.matched}
    batched = speedups(speed.batched, matched)
    faster = [f"{name(f)} {said}" for f, v, said in batched if v >= 1.0]
    slower = [v for _, v, _ in batched if v < 1.0]
    if slower:
        faster.append(f"the other {len(slower)}: {min(slower):.2f}–{max(slower):.2f}x")
    best_gen = []
    for rows in sorted({e["rows"] for e in speed.generation}):
        f, _, said = speedups([e for e in speed.generation if e["rows"] == rows], matched)[0]
        best_gen.append(f"{name(f)} {said} with {rows} row{'s' if rows > 1 else ''}")
    tol = halt.ce_tolerance
    rows = [
        ("the model", f"{train.n_params / 1e6:.2f} M parameters, {train.train_tokens / 1e6:.1f} M training "
                      f"tokens, {train.train_minutes:.0f} minutes of training",
         "`01_training.json`: `n_params`, `train_tokens`, `train_minutes`"),
        ("validation loss at 1 / 8 / 32 loops", f"{ce[1]:.3f} / {ce[8]:.3f} / {ce[32]:.3f} nats per token",
         "`01_training.json`: `ce_by_loops`"),
        ("gain from depth, CE(1) − CE(8)", f"{train.ce_gain_1_to_8:.3f} nats",
         "`01_training.json`: `ce_gain_1_to_8`"),
        (f"median loop at which a token's successive KL falls below {sci(conv.eps)}",
         f"{conv.median_depth.value:.0f}; {conv.frac_updating.value * 100:.1f}% of tokens still "
         f"updating at loop {conv.train_mean_depth:.0f}",
         "`02_convergence.json`: `median_depth`, `frac_updating`"),
        (f"uniform depth with the loss of depth {ref} (within {tol:g} nats)",
         f"{halt.depth('uniform'):.2f} loops", "`04_halting_and_routers.json`: `matching`"),
        ("KL halting rule at that loss", saved(KLThreshold.family), "`04_halting_and_routers.json`: `gaps`"),
        ("per-token oracle (offline bound) at that loss", saved(Oracle.family),
         "`04_halting_and_routers.json`: `gaps`"),
        ("the other rules and routers at that loss, loops",
         ", ".join(f"{name(f)} {d:.2f}" for d, f in others), "`04_halting_and_routers.json`: `gaps`"),
        (f"wall-clock speed-up over uniform depth {ref} at its loss, batched evaluation, "
         f"{speed.threads} CPU threads" + (f" of an {kind['cpu']}" if (kind := res.machine()) else "")
         + "; brackets here: the median's interval over the timed rounds (`speedup_coverage`), not a bootstrap",
         ", ".join(faster), "`05_compute.json`: `batched`"),
        (f"the same in KV-cached generation, best rule against the dense decoder at depth {ref}",
         "; ".join(best_gen), "`05_compute.json`: `generation`"),
    ]
    return table(("result", "reference model", "from `papermill_runs/reference/results/`"), rows)


@section
def controlled_depth(res: Results) -> str | None:
    """Natural text beside the model trained with tokens whose required depth is known (data/depth-tasks)."""
    if res.get(KnownDepth.NOTEBOOK) is None or res.get(Halting.NOTEBOOK) is None:
        return None
    known, halt = res.record(KnownDepth), res.record(Halting)
    sets = {"natural text (reference)": halt.gap_intervals}
    sets.update({f"controlled depth: {w}": gaps for w, gaps in known.gaps.items()})

    def cell(gaps: dict, family: str) -> str:
        if family not in gaps:
            return "—"
        g = gaps[family]["saved_frac"]
        return f"{pct(g.value)} [{pct(g.lo)}, {pct(g.hi)}]"

    first = next(iter(sets.values()))
    rows = [("uniform depth of equal quality, loops",
             *(f"{next(iter(g.values()))['uniform_depth'].value:.2f}" for g in sets.values()))]
    rows += [(f"{name(f)}: loops saved against it", *(cell(g, f) for g in sets.values()))
             for f in GAIN_FAMILIES if f in first or f in known.gaps]
    rho = known.spearman_depth
    lo, hi = known.k_range
    shipped = ROOT / known.model_source["path"]
    source = json.loads((shipped / "source.json").read_text()) if (shipped / "source.json").is_file() else {}
    if "step" in source and "of_steps" in source:  # a staged recipe stops its last stage at a met probe
        step, planned = int(source["step"]), int(source["of_steps"])
    else:
        step = max(json.loads(ln)["step"] for ln in (shipped / "metrics.jsonl").read_text().splitlines() if ln.strip())
        planned = json.loads((shipped / "train_config.json").read_text())["max_steps"]
    stage = "" if step >= planned else f"step {step:,} of a {planned:,}-step schedule"
    if "train_wall_minutes" in source:
        stage += ("; " if stage else "") + f"{source['train_wall_minutes']:.0f} minutes of training in all"
    stage = f" ({stage})" if stage else ""
    k_low, at_r = known.lowest_accuracy()
    verdict = (f"k = {k_low}, [{at_r.lo * 100:.1f}%, {at_r.hi * 100:.1f}%]; the target is 90%"
               + (": met" if known.min_accuracy_at_R >= 0.9 else ": missed"))
    head = (f"Controlled depth (`06_known_depth.json`): a second model{stage} trained on the same text mixed with "
            f"generated documents ({pct(known.task_share)} of its training tokens) whose answers need k = "
            f"{lo}..{hi} lookups. Answer accuracy at {known.reference_loops} loops, lowest over k: "
            f"{known.min_accuracy_at_R * 100:.1f}% ({verdict}); Spearman(k, convergence depth) {rho:.2f}. "
            "Loops saved against the uniform depth of equal quality "
            "(`04_halting_and_routers.json`, `06_known_depth.json`: `gaps`):")
    return head + "\n\n" + table(("", *sets), rows)


# ------------------------------------------------------------------------------------------------- docs blocks


def x(v: float) -> str:
    return f"{v:.2f}x"


@doc_block("measurements.md", "batched")
def batched_table(res: Results) -> str:
    """Notebook 05's batched evaluation: every variant against uniform depth through the dense forward."""
    speed = res.record(Compute)
    rows = [(f"`{e['rule']}` ({e['path']})", f"{e['avg_loops']:.2f}", x(e["proxy_speedup"]), x(e["honest_speedup"]),
             xi(e), f"{e['wall_over_proxy']:.2f}", f"{e['wall_over_honest']:.2f}",
             f"{e['page_faults_per_batch']:.0f}") for e in speed.batched]
    counts = sorted({int(e.get("rounds", speed.rounds)) for e in speed.batched})  # autoranged: each row's own
    rounds = str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    return (f"{speed.n_windows} windows x {speed.seq_len} tokens, medians of {rounds} interleaved "
            f"rounds, {speed.threads} threads (`05_compute.json`: `batched`). {PAIRED}\n\n"
            + table(("rule (path)", "avg loops", "FLOP proxy", "honest speed-up", "wall-clock", "wall / proxy",
                     "wall / honest", "page faults per batch"), rows))


@doc_block("measurements.md", "generation")
def generation_table(res: Results) -> str:
    """Notebook 05's KV-cached generation against the dense decoder at the reference depth."""
    speed = res.record(Compute)
    predicted = {(p["rule"], p["rows"]): p["loop_cost_speedup"] for p in speed.decode_prediction}
    rows = [(f"`{e['rule']}` ({e['path']})", str(e["rows"]), f"{e['avg_loops']:.2f}", f"{e['loops_run']:.2f}",
             f"{e['tokens_per_s']:.0f}", x(e["honest_speedup"]),
             x(predicted[(e["rule"], e["rows"])]) if (e["rule"], e["rows"]) in predicted else "",
             xi(e), f"{e['wall_over_honest']:.2f}") for e in speed.generation]
    return (f"`05_compute.json`: `generation`, `decode_prediction`. {PAIRED}\n\n"
            + table(("rule (path)", "rows", "avg loops", "loops run", "tokens/s", "honest speed-up",
                     "loop-cost prediction", "wall-clock", "wall / honest"), rows))


@doc_block("measurements.md", "decoders")
def decoders_table(res: Results) -> str:
    """Notebook 05's three decoders side by side per batch size, and serving through a fixed number of slots."""
    speed = res.record(Compute)
    rows = [(str(e["batch"]), f"`{e['rule']}`", e["path"], f"{e['avg_loops']:.2f}", f"{e['tokens_per_s']:.0f}",
             x(e["x_dense"]), "" if e["realization"] is None else f"{e['realization']:.2f}",
             {True: "yes", False: "NO", None: ""}[e["same_as_generate"]]) for e in speed.decoders]
    serving = [(f"`{e['rule']}`", e["path"], str(e["requests"]), str(e["slots"]), f"{e['p50']:.2f}",
                f"{e['p90']:.2f}", f"{e['p99']:.2f}", f"{e['tokens_per_s']:.0f}") for e in speed.serving or []]
    return ("`05_compute.json`: `decoders`, `serving` (latencies in seconds).\n\n"
            + table(("batch", "rule", "decoder", "avg loops", "tokens/s", "x dense", "realization",
                     "same tokens as generate"), rows)
            + "\n\n" + table(("rule", "decoder", "requests", "slots", "p50", "p90", "p99", "tokens/s"), serving))


@doc_block("measurements.md", "bf16")
def bf16_table(res: Results) -> str:
    """Notebook 05's bf16 autocast against fp32 on the same windows."""
    rows = [(f"`{e['rule']}`", e["precision"], f"{e['avg_loops']:.2f}", f"{e['ce']:.4f}",
             "" if e["same_exit"] is None else pct(e["same_exit"]), x(e["x_fp32_time"]))
            for e in res.record(Compute).bf16 or []]
    return "`05_compute.json`: `bf16`.\n\n" + table(
        ("rule", "precision", "avg loops", "CE", "same exit loop as fp32", "time / fp32"), rows)


@doc_block("measurements.md", "anderson")
def anderson_table(res: Results) -> str:
    """Notebook 05's fixed-point solvers: core evaluations to a successive KL below 1e-3 and 1e-5."""
    rows = [(e["method"], f"{e['evals_kl_1e-3']:.2f}", f"{e['evals_kl_1e-5']:.2f}", pct(e["converged_1e-5"]),
             f"{e['ce_at_8']:.4f}", x(e["x_plain_time_per_eval"])) for e in res.record(Compute).anderson or []]
    return "`05_compute.json`: `anderson`.\n\n" + table(
        ("method", "evaluations to KL < 1e-3", "to KL < 1e-5", "tokens reaching 1e-5", "CE at 8 evaluations",
         "time per evaluation / plain"), rows)


@doc_block("book.md", "timings")
def timings_table(res: Results) -> str:
    """The reference book's seconds per notebook (``timings.json`` beside the results directory)."""
    timed = res.timings()
    if not timed:
        return "no timings recorded yet: run `make book`"

    def kind(e: dict) -> str:
        return "unknown" if e["cpu"] == "unknown" else f"{e['cpu']} (bf16 matmul: {e['bf16']}), {e['cores']} cores"

    rows = [(name, f"{e['seconds']:.0f}", kind(e)) for name, e in sorted(timed.items())]
    total = sum(e["seconds"] for e in timed.values())
    kinds = {kind(e) for e in timed.values()}
    rows.append(("all notebooks", f"{total:.0f} ({total / 60:.1f} minutes)",
                 kinds.pop() if len(kinds) == 1 else "mixed: compare only within one kind"))
    return "`timings.json`: each notebook's seconds with the kind of machine that ran it.\n\n" + table(
        ("notebook", "seconds", "machine"), rows)


def doc_pages(results: Path | Results = RESULTS, docs: Path = DOCS) -> dict[Path, str]:
    """Every docs page with a generated block, its text with each block as generated now."""
    res = results if isinstance(results, Results) else Results(results)
    pages: dict[Path, str] = {}
    for (page, block), fn in DOC_BLOCKS.items():
        path = docs / page
        text = pages.get(path) or path.read_text()
        start, end = markers(block)
        if text.count(start) != 1 or text.count(end) != 1:
            raise ValueError(f"{path} must hold {start} and {end} once each")
        head, rest = text.split(start, 1)
        pages[path] = head + start + "\n" + (fn(res) or "").strip() + "\n" + end + rest.split(end, 1)[1]
    return pages


def render(results: Path | Results = RESULTS, sections: list[Section] | None = None) -> str:
    """The block between the markers: each section's markdown, blank-line separated; None leaves a section out."""
    res = results if isinstance(results, Results) else Results(results)
    parts = [text.strip() for fn in (SECTIONS if sections is None else sections) if (text := fn(res))]
    return "\n" + "\n\n".join(parts) + "\n"


def readme_block(text: str) -> str:
    """What README.md holds between the markers."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"README.md must hold {START} and {END} once each")
    return text.split(START, 1)[1].split(END, 1)[0]


def rewrite(text: str, block: str) -> str:
    head, rest = text.split(START, 1)
    return head + START + block + END + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="rewrite README.md's and docs' generated blocks")
    group.add_argument("--check", action="store_true", help="exit 1 if a generated block differs")
    ap.add_argument("--results", type=Path, default=RESULTS, help="results directory (default: the reference's)")
    args = ap.parse_args(argv)
    block = render(args.results)
    pages = doc_pages(args.results)
    if args.write:
        README.write_text(rewrite(README.read_text(), block))
        for path, text in pages.items():
            path.write_text(text)
        print(f"rewrote the headline block of {README} and the generated blocks of {len(pages)} docs page(s)")
    elif args.check:
        stale = [str(p) for p, text in pages.items() if p.read_text() != text]
        if readme_block(README.read_text()) != block:
            stale.insert(0, str(README))
        if stale:
            print(f"stale generated blocks in {', '.join(stale)}: run scripts/readme_tables.py --write",
                  file=sys.stderr)
            return 1
    else:
        print(block.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
