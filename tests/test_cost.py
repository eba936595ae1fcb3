"""The FLOP model's pieces and the interleaved timer shared by the speed measurements and bench/."""

from __future__ import annotations

import gc
import mmap
import sys

import pytest
import torch

import drc_book.cost as cost
from drc_book.cost import (
    Autorange,
    flop_parts,
    flop_summary,
    interleaved,
    keep_freed_memory,
    matmul_flops_per_token,
    median,
    median_interval,
    page_faults,
    rotations,
    speedup_model,
    spread,
    train_flops_per_token,
)
from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM


def test_train_flops_are_forward_plus_twice_the_graph():
    m = DepthRecurrentLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_prelude=1, n_core=2, n_coda=1,
                                     max_seq_len=16))
    f = m.flops_per_token
    assert train_flops_per_token(m, 8, None, 16) == 3 * f(8, 16)
    assert train_flops_per_token(m, 8, 3, 16) == f(8, 16) + 2 * f(3, 16)
    assert train_flops_per_token(m, 4, 9, 16) == 3 * f(4, 16)  # k above n is full backprop


def test_rotations_start_one_later_each_round():
    assert list(rotations("abc", 4)) == [(0, list("abc")), (1, list("bca")), (2, list("cab")), (3, list("abc"))]
    assert list(rotations([], 2)) == [(0, []), (1, [])]


def test_interleaved_times_every_variant_once_per_round():
    calls: list[str] = []
    lines: list[str] = []
    times = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3, lines.append, "x")
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3} and len(lines) == 3
    assert median([3.0, 1.0, 2.0]) == 2.0
    counter = iter(range(100))
    kept: list[tuple[str, int]] = []
    interleaved({"a": lambda: next(counter), "b": lambda: next(counter)}, 2, None, "x",
                keep=lambda *kv: kept.append(kv))
    assert kept == [("a", 0), ("b", 1)]  # the first round's outputs only
    frozen: list[int] = []
    interleaved({"a": lambda: frozen.append(gc.get_freeze_count())}, 1, None, "x")
    assert frozen[0] > 0 and gc.get_freeze_count() == 0  # frozen while timing (cheap collections), thawed after
    assert spread([1.0, 2.0, 3.0]) == pytest.approx(1.0) and spread([5.0]) == 0.0


def test_median_interval_is_the_order_statistic_interval_with_its_coverage():
    """Coverage 1 - 2 P(Binom(n, 1/2) <= j - 1) of [x_(j), x_(n+1-j)], checked by brute force over every sign
    pattern: below 95% with five values or fewer ([min, max]), the narrowest interval at 95% or more from six on."""
    import itertools

    for n in (1, 3, 5, 6, 8, 9, 12, 20):
        xs = [float(v) for v in range(n, 0, -1)]  # unsorted on purpose
        lo, hi, cover = median_interval(xs)
        j = int(lo)  # x_(j) = j for these values
        assert hi == n + 1 - j
        below = sum(sum(p) <= j - 1 for p in itertools.product((0, 1), repeat=n)) / 2**n  # P(B <= j - 1)
        assert cover == pytest.approx(1 - 2 * below)
        if n >= 6:
            assert cover >= 0.95
            narrower = sum(sum(p) <= j for p in itertools.product((0, 1), repeat=n)) / 2**n
            assert j == (n + 1) // 2 or 1 - 2 * narrower < 0.95  # one step in is below 95%
        else:
            assert (lo, hi) == (1.0, float(n)) and cover < 0.95


def _fake_clock(monkeypatch, durations):
    """The wall clock of interleaved: each call takes the next of ``durations``'s values (by variant name)."""
    now = [0.0]

    def tick() -> float:
        return now[0]

    def call(name):
        def go():
            now[0] += next(durations[name])
        return go

    monkeypatch.setitem(cost.CLOCKS, "wall", tick)
    return call


def test_autorange_stops_at_a_tight_interval_at_the_budget_or_at_max_rounds(monkeypatch):
    import itertools

    steady = {"a": itertools.repeat(1.0), "b": itertools.repeat(2.0)}
    call = _fake_clock(monkeypatch, steady)
    t = interleaved({k: call(k) for k in steady}, Autorange(3, 12, 0.03, 1e9), None, "steady")
    assert t.stopped == "interval" and len(t["a"]) == 6  # the first round count with a 95% interval
    assert t.row("a")["seconds_lo"] == t.row("a")["seconds_hi"] == 1.0 and t.row("b")["coverage"] >= 0.95

    noisy = {"a": itertools.cycle([1.0, 2.0, 3.0]), "b": itertools.repeat(1.0)}
    call = _fake_clock(monkeypatch, noisy)
    t = interleaved({k: call(k) for k in noisy}, Autorange(3, 12, 0.03, 1e9), None, "noisy")
    assert t.stopped == "rounds" and len(t["a"]) == 12  # never tight: the round limit
    monkeypatch.setattr(cost.time, "perf_counter", lambda: cost.CLOCKS["wall"]())  # the budget reads the same clock
    noisy = {"a": itertools.cycle([1.0, 2.0, 3.0]), "b": itertools.repeat(1.0)}
    call = _fake_clock(monkeypatch, noisy)
    t = interleaved({k: call(k) for k in noisy}, Autorange(3, 12, 0.03, 10.0), None, "noisy")
    assert t.stopped == "budget" and len(t["a"]) == 4  # 3 rounds = 9 s, the fourth passes 10 s
    assert len(interleaved({"a": lambda: None}, 4, None, "fixed")["a"]) == 4  # a number: exactly that many


def test_the_warmup_check_flags_a_first_round_that_is_always_the_slowest(monkeypatch):
    import itertools

    cold = {f"v{i}": itertools.chain([5.0], itertools.cycle([1.0, 1.1, 0.9])) for i in range(6)}
    call = _fake_clock(monkeypatch, cold)
    check = interleaved({k: call(k) for k in cold}, 4, None, "cold").warmup()
    assert check["first_round_slowest"] == 6 and check["warmup_p"] < 0.01 and check["warmup_ok"] is False
    cold = {f"v{i}": itertools.chain([5.0], itertools.cycle([1.0, 1.1, 0.9])) for i in range(6)}
    call = _fake_clock(monkeypatch, cold)
    times = interleaved({k: call(k) for k in cold}, Autorange(3, 12, 0.03, 1e9), None, "cold")
    check = times.warmup()  # adaptive rounds drop the cold first round once and go on
    assert times.dropped == 1 and check["dropped"] == 1 and check["warmup_ok"] is True
    assert all(5.0 not in xs and len(xs) >= 3 for xs in times.values())
    warm = {f"v{i}": itertools.cycle([1.0, 1.1, 0.9, 1.05][i % 4:] + [1.0, 1.1, 0.9, 1.05][:i % 4])
            for i in range(6)}
    call = _fake_clock(monkeypatch, warm)
    check = interleaved({k: call(k) for k in warm}, 4, None, "warm").warmup()
    assert check["warmup_ok"] is True and check["rounds"] == 4
    assert interleaved({"a": lambda: None}, 1, None, "one").warmup()["warmup_ok"] is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="getrusage's minor faults: Linux")
def test_page_faults_counts_first_touches_of_fresh_memory():
    size = 16 << 20
    with mmap.mmap(-1, size) as mem:  # a fresh anonymous mapping: each 4 KB page faults when first written
        before = page_faults()
        for offset in range(0, size, mmap.PAGESIZE):
            mem[offset] = 1
        assert page_faults() - before >= size // mmap.PAGESIZE // 2  # (huge pages would fault less)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_memory_is_reused_without_page_faults():
    # 64 MB is above glibc's largest dynamic mmap threshold (32 MB): by default every such buffer is a fresh
    # mapping that faults on each of its 16,384 pages; once freed memory is kept, later ones reuse it (after a
    # few rounds in which the heap settles: what the process allocated before leaves it fragmented)
    assert keep_freed_memory()
    n = 16 << 20  # floats: 64 MB
    faults = []
    for _ in range(16):
        before = page_faults()
        torch.ones(n)  # allocated, touched and freed
        faults.append(page_faults() - before)
    assert faults[-1] < 1000 and faults[-2] < 1000, faults


def test_flop_summary_and_speedup_model():
    """Notebook 05's cost-model line and table: the parts in MFLOP, and each path's matmul speed-up at 1, r/4, r/2
    and r loops (at a = r the state path pays exactly the forward's matmuls)."""
    m = DepthRecurrentLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_prelude=1, n_core=2, n_coda=1,
                                     max_seq_len=16))
    parts = flop_parts(m, 16)
    line = flop_summary(m, 16)
    assert line.startswith(f"prelude {parts['prelude'] / 1e6:.2f} MFLOP")
    assert line.endswith(f"= {parts['readout'] / parts['core']:.2f} core loops")
    table = speedup_model(m, 8, 16)
    assert table["avg loops a"].tolist() == [1.0, 2.0, 4.0, 8.0]
    assert table["FLOP proxy r/a"].tolist() == [8.0, 4.0, 2.0, 1.0]
    assert table["matmul speed-up, rule on states"].iloc[-1] == 1.0
    base = matmul_flops_per_token(m, 8, 16, "forward")
    assert table["matmul speed-up, rule on log-probs"].iloc[0] == base / matmul_flops_per_token(m, 1, 16,
                                                                                                "skip_log_probs")
