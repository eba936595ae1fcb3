"""``python -m drc_core.data prepare ...``: prepare a corpus and print what it made."""

from __future__ import annotations

import sys

from drc_core.data.depth_tasks import ASK_ORDERS, FAMILIES, DepthTaskConfig
from drc_core.data.prepare import DEFAULT_OUT, PrepareConfig, PrepareResult, prepare
from drc_core.data.sources import DEFAULT_SOURCE, KNOWN_SOURCES, SourceSpec
from drc_core.errors import ArgumentParser, run_cli


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m drc_core.data", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="read, split, tokenize and write a corpus (cached)")
    p.add_argument("--source", default=DEFAULT_SOURCE,
                   help=f"one of {', '.join(KNOWN_SOURCES)}, combined with '+' (default: {DEFAULT_SOURCE})")
    p.add_argument("--path", action="append", default=[], help="local: a .txt/.jsonl/.parquet file or dir (repeat)")
    p.add_argument("--data-files", action="append", default=[],
                   help="fineweb-edu: local parquet shards with FineWeb-Edu's schema instead of the Hub (repeat)")
    p.add_argument("--max-docs", type=int, default=None, help="first N documents per source (fineweb-edu: required)")
    for field, kind, what in (("docs", int, "documents to generate"),
                              ("min_k", int, "fewest lookups an answer (a chain) needs"),
                              ("max_k", int, "most lookups an answer needs"),
                              ("repeat_share", float, "share of problems that are unlabelled repeats"),
                              ("problems", int, "problems per document")):
        p.add_argument(f"--task-{field.replace('_', '-')}", type=kind, default=getattr(DepthTaskConfig, field),
                       help=f"depth-tasks: {what} (default: {getattr(DepthTaskConfig, field)})")
    p.add_argument("--task-families", default=",".join(DepthTaskConfig.families),
                   help=f"depth-tasks: labelled families, comma-separated, from {','.join(FAMILIES)} (default: "
                        f"{','.join(DepthTaskConfig.families)})")
    p.add_argument("--task-ask-every", action="store_true",
                   help="depth-tasks: ask about every object of each asked chain (containers, links), not only the "
                        "first")
    p.add_argument("--task-ask-order", choices=ASK_ORDERS, default=DepthTaskConfig.ask_order,
                   help="depth-tasks, with --task-ask-every: the questions shuffled (a question after one about an "
                        "object further down its chain needs fewer lookups), or each chain's objects deepest first "
                        f"(no answer shortens a later question) (default: {DepthTaskConfig.ask_order})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer", default="",
                   help="use this tokenizer.json (or a directory with one: a prepared corpus, a shipped model) instead "
                        "of training a BPE, e.g. to continue training a model on new text")
    p.add_argument("--val-fraction", type=float, default=0.1, help="fraction of documents per source in val")
    p.add_argument("--seq-len", type=int, default=256, help="each split must hold one window of seq_len+1 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even when the cache matches")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def describe(res: PrepareResult) -> str:
    m = res.meta
    head = "up to date (same inputs as the prepared corpus), nothing to do" if res.cached else \
        f"prepared in {res.seconds:.1f} s"
    lines = [f"{res.out}: {head}",
             f"  source {m['source']}, vocab {m['vocab_size']}, seed {m['seed']}, dtype {m['dtype']}"]
    for split in ("train", "val"):
        lines.append(f"  {split:5s} {m['documents'][split]:7d} docs {m['characters'][split]:11,d} chars "
                     f"{m['tokens'][split]:11,d} tokens")
    for key, c in m["per_source"].items():
        lines.append(f"    {key:24s} {c['documents']:6d} docs {c['characters']:11,d} chars {c['tokens']:11,d} tokens")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tasks = {k.removeprefix("task_"): v for k, v in vars(args).items() if k.startswith("task_")}  # --task-X: field X
    tasks["families"] = tuple(f.strip() for f in args.task_families.split(",") if f.strip())
    spec = SourceSpec(name=args.source, paths=tuple(args.path), data_files=tuple(args.data_files),
                      max_docs=args.max_docs, tasks=DepthTaskConfig(seed=args.seed, **tasks))
    cfg = PrepareConfig(source=spec, out=args.out, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                        seed=args.seed, seq_len=args.seq_len, force=args.force, tokenizer=args.tokenizer)
    res = prepare(cfg, progress=not args.quiet)
    print(describe(res))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
