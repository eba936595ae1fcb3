"""The registry of per-loop statistics: one definition per quantity, every consumer derived from it. A made-up
statistic, registered once, reaches LoopStats, the measurement frame, drc_core.trace and every skipping path,
and the skipping paths' compact values equal the reference forward's."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd
import pytest
import torch

import drc_core
from drc_core.analysis.loops import (
    BUILTIN_STATISTICS,
    STATISTICS,
    LoopStats,
    Statistic,
    frame_statistics,
    iterate_stats,
    register_statistic,
    unregister_statistic,
    with_needs,
)
from drc_core.analysis.measure import FRAME_COLUMNS, Measurement, measure_windows
from drc_core.errors import DrcError
from drc_core.halting.continuous import generate_continuous
from drc_core.halting.generate import generate
from drc_core.halting.loopstats import stat_fields
from drc_core.halting.reference import masked_forward
from drc_core.halting.rules import _BelowThreshold
from drc_core.halting.skipping import skip_forward

V, B, T, L = 64, 2, 12, 6


def _state_mean(log_probs, state, prev):
    return state.float().mean(-1)


def _p0_change(log_probs, state, prev):
    return (log_probs[..., 0] - prev["log_probs"][..., 0]).abs()


def _decaying(log_probs, state, prev):  # defined at loop 1 (prev None) and reads its own previous value
    if prev is None:
        return state.float().norm(dim=-1)
    return (state.float() - prev["state"].float()).norm(dim=-1) + 0.5 * prev["decaying"]


MADE_UP = (
    Statistic("state_mean", "mean of s_l over d", "state", frame=True, compute=_state_mean),
    Statistic("p0_change", "|log p_l(0) - log p_{l-1}(0)|", "output", ("log_probs",), math.inf, frame=True,
              compute=_p0_change),
    Statistic("decaying", "||s_l - s_{l-1}|| + decaying_{l-1} / 2 (||s_1|| at loop 1)", "state",
              ("state", "decaying"), compute=_decaying),
)


@pytest.fixture
def registered():
    for stat in MADE_UP:
        register_statistic(stat)
    yield MADE_UP
    for stat in MADE_UP:
        unregister_statistic(stat.name)


@dataclass
class _Below(_BelowThreshold):
    """A rule on a registered statistic (no family: not registered as a rule)."""

    _stat = "p0_change"


@dataclass
class _BelowDecaying(_BelowThreshold):
    _stat = "decaying"


@dataclass
class _BelowDecayingReadsAll(_BelowThreshold):
    """Declares no ``reads``: the skipping path fills every statistic into the full (B, T) layout."""

    _stat = "decaying"
    reads = None  # type: ignore[assignment]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(11)


def _idx() -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))


def test_the_builtins_are_loopstats_fields_and_the_frame_columns():
    names = {f.name for f in fields(LoopStats)} - {"loop", "state", "extra"}
    assert names == set(BUILTIN_STATISTICS) == set(STATISTICS)
    assert set(frame_statistics()) <= set(FRAME_COLUMNS)
    assert {"kl", "state_delta", "entropy", "argmax"} == set(frame_statistics())


@pytest.mark.parametrize("name", sorted(BUILTIN_STATISTICS))
def test_a_caller_reading_one_statistic_gets_the_same_values_and_placeholders(moving_model, name):
    idx = _idx()
    full = list(iterate_stats(moving_model, idx, L, generator=_gen()))
    part = list(iterate_stats(moving_model, idx, L, generator=_gen(), only={name}))
    needed = with_needs({name})
    for a, b in zip(full, part, strict=True):
        for n in needed:
            torch.testing.assert_close(getattr(b, n), getattr(a, n), rtol=0, atol=0)
    if "minp_kl" not in needed:  # the costliest statistic: not computed, a NaN placeholder
        assert all(torch.isnan(st.minp_kl).all() for st in part)


def test_the_min_p_outputs_are_filtered_once_per_loop(moving_model, monkeypatch):
    from drc_core.analysis import loops

    calls = []
    real = loops.minp_log_probs
    monkeypatch.setattr(loops, "minp_log_probs", lambda *a: calls.append(1) or real(*a))
    stats = list(iterate_stats(moving_model, _idx(), L, generator=_gen(), only={"minp_kl"}))
    assert len(calls) == L
    q = [real(st.log_probs) for st in stats]
    for prev_q, cur_q, st in zip(q[:-1], q[1:], stats[1:], strict=True):
        torch.testing.assert_close(st.minp_kl, (prev_q.exp() * (prev_q - cur_q)).sum(-1))
    calls.clear()
    list(iterate_stats(moving_model, _idx(), L, generator=_gen(), only={"kl", "state_delta"}))
    assert not calls
    with pytest.raises(DrcError, match="'klx' is no statistic"):
        with_needs({"klx"})


def test_a_registered_statistic_is_in_loopstats_and_the_frame(moving_model, registered):
    idx = _idx()
    stats = list(iterate_stats(moving_model, idx, L, generator=_gen()))
    for st in stats:
        torch.testing.assert_close(st.state_mean, st.state.float().mean(-1))
    assert torch.isinf(stats[0].p0_change).all()
    torch.testing.assert_close(stats[0].decaying, stats[0].state.norm(dim=-1))
    torch.testing.assert_close(stats[2].p0_change,
                               (stats[2].log_probs[..., 0] - stats[1].log_probs[..., 0]).abs())
    window = torch.cat([idx, idx[:, :1]], dim=1)
    meas = measure_windows(moving_model, window, L, batch_size=B)
    assert {"state_mean", "p0_change"} <= set(meas.stats) and "decaying" not in meas.stats
    assert list(meas.to_frame().columns)[len(FRAME_COLUMNS):] == ["state_mean", "p0_change"]  # after the built-ins
    assert np.isnan(meas.stats["p0_change"][:, 0]).all()  # compares with the previous loop: NaN at loop 1
    assert not np.isnan(meas.stats["p0_change"][:, 1:]).any()
    tr = drc_core.trace(moving_model, idx[0], L)
    assert tr.matrix("state_mean").shape == (T, L)


def test_the_skipping_paths_compute_a_registered_statistic_as_the_reference(moving_model, registered):
    idx = _idx()
    stats = list(iterate_stats(moving_model, idx, L, generator=_gen()))
    for rule_cls, name in ((_Below, "p0_change"), (_BelowDecaying, "decaying"), (_BelowDecayingReadsAll, "decaying")):
        tau = float(stats[2].extra[name].flatten().median())
        rule = rule_cls(tau, max_loops=L)
        assert name in stat_fields(rule)
        ref = masked_forward(moving_model, idx, rule, generator=_gen())
        got = skip_forward(moving_model, idx, rule, generator=_gen())
        assert len(ref.exit_loop.unique()) >= 2, "the rule must halt tokens at different loops to test anything"
        assert torch.equal(got.exit_loop, ref.exit_loop)
    # generation and continuous batching run the same compact statistics
    rule = _Below(float(stats[2].p0_change.flatten().median()), max_loops=L)
    prompts = [idx[0, :4], idx[1, :3]]
    cont = generate_continuous(moving_model, prompts, 6, rule, slots=2, generator=_gen())
    for prompt, c in zip(prompts, cont.completions, strict=True):
        alone = generate(moving_model, prompt[None], 6, rule, state=c.initial_state[None])
        assert c.tokens.tolist() == alone.tokens[0].tolist()
        assert torch.equal(c.exit_loop, alone.exit_loop[0])


def test_register_rejects_a_taken_name_and_a_missing_compute(registered):
    with pytest.raises(DrcError, match="taken"):
        register_statistic(Statistic("kl", "again", "output", compute=_state_mean))
    with pytest.raises(DrcError, match="taken"):
        register_statistic(Statistic("values", "a LoopStats method's name", "state", compute=_state_mean))
    with pytest.raises(DrcError, match="compute"):
        register_statistic(Statistic("nocompute", "x", "state"))
    with pytest.raises(DrcError, match="no statistic"):
        register_statistic(Statistic("needy", "x", "state", ("nope",), compute=_state_mean))
    with pytest.raises(DrcError, match="built-in"):
        unregister_statistic("kl")


def test_a_frame_saved_under_the_old_column_name_loads(tmp_path):
    old = pd.DataFrame({"window": [0], "pos": [0], "loop": [1], "kl_prev": [np.nan]})
    old.to_parquet(tmp_path / "f.parquet", index=False)
    assert "kl" in Measurement.load(tmp_path / "f.parquet").stats


def test_needs_log_probs_is_derived_from_what_a_rule_reads(registered):
    from drc_core.halting import rules as R

    output_rules = [R.KLThreshold(1e-3), R.EntropyDelta(1e-2), R.ArgmaxPatience(2), R.SoftmaxConfidence(0.9),
                    R.MinPKL(1e-3)]
    state_rules = [R.StateDelta(1e-2), R.Cosine(0.99), R.Acceleration(1e-2), R.Uniform(4), R.Never()]
    assert all(r.needs_log_probs for r in output_rules)
    assert not any(r.needs_log_probs for r in state_rules)

    @dataclass
    class OnState(_BelowThreshold):
        _stat = "state_mean"

    @dataclass
    class OnDecaying(_BelowThreshold):  # a state statistic that needs its own previous value
        _stat = "decaying"

    assert not OnState(1.0).needs_log_probs and not OnDecaying(1.0).needs_log_probs
    assert _Below(1.0).needs_log_probs  # p0_change reads the output
    assert not R.Oracle(torch.ones(1, 2, dtype=torch.long)).needs_log_probs  # replays exits, reads nothing
