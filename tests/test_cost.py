"""The FLOP model's pieces and the interleaved timer shared by the speed measurements and bench/."""

from __future__ import annotations

import gc
import mmap
import sys

import pytest
import torch

from drc_book.cost import (
    flop_parts,
    flop_summary,
    interleaved,
    keep_freed_memory,
    matmul_flops_per_token,
    median,
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
