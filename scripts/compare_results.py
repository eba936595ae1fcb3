"""Compare two re-executions of the book number by number: every leaf of every results JSON.

    .venv/bin/python scripts/compare_results.py OLD_RESULTS_DIR NEW_RESULTS_DIR

Prints, per results file, how many leaves are equal, the leaves that differ (path, old, new), the largest relative
difference of the numbers that differ (a re-execution on another kind of CPU differs in the last bits of its float
sums) and the leaves only one side has. A leaf whose path names a clock (``TIMING_WORDS``) is counted apart:
timings differ between runs by nature. Exit 1 when a non-timing leaf differs or is missing on one side, else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

# a path containing one of these measures the clock, not the model
TIMING_WORDS = ("seconds", "_ms", "ms_", "tok_s", "tokens_per_s", "per_s", "speedup", "realization", "wall",
                "timing", "latency", "p50", "p90", "p99", "throughput", "elapsed")


def leaves(value: object, path: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from leaves(sub, f"{path}/{key}")
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from leaves(sub, f"{path}[{i}]")
    else:
        yield path, value


def same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def is_timing(path: str) -> bool:
    low = path.lower()
    return any(word in low for word in TIMING_WORDS)


def compare(old: Path, new: Path) -> int:
    bad = 0
    for old_file in sorted(old.glob("*.json")):
        new_file = new / old_file.name
        if not new_file.is_file():
            print(f"{old_file.name}: missing in {new}")
            bad += 1
            continue
        a = dict(leaves(json.loads(old_file.read_text())))
        b = dict(leaves(json.loads(new_file.read_text())))
        equal = [p for p in a if p in b and same(a[p], b[p])]
        differ = [p for p in a if p in b and not same(a[p], b[p])]
        timing = [p for p in differ if is_timing(p)]
        real = [p for p in differ if not is_timing(p)]
        one_side = sorted(set(a) ^ set(b))
        rel = [abs(a[p] - b[p]) / max(abs(a[p]), abs(b[p])) for p in real
               if isinstance(a[p], float | int) and isinstance(b[p], float | int) and not isinstance(a[p], bool)]
        worst = f" (numbers: largest relative difference {max(rel):.1e})" if rel else ""
        print(f"{old_file.name}: {len(equal)} equal, {len(timing)} timing leaves differ, {len(real)} other leaves "
              f"differ{worst}, {len(one_side)} on one side only")
        for p in real[:20]:
            print(f"  {p}: {a[p]!r} -> {b[p]!r}")
        for p in one_side[:20]:
            print(f"  only {'old' if p in a else 'new'}: {p}")
        bad += len(real) + len(one_side)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args(argv)
    return compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
