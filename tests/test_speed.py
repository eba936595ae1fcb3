"""Realized speedup: matched rules, timing frames, measurement-pass cost, and the benchmark script
(drc_book/speed.py, bench/adaptive_speed.py). Behaviour only: no assertion depends on how fast anything
ran."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from drc_book.cost import VOCAB_STAT_FLOPS, flop_parts, matmul_flops_per_token
from drc_book.fixed_point import fixed_point_costs
from drc_book.speed import (
    SpeedConfig,
    decode_loop_cost,
    decode_prediction,
    matched_rules,
    skip_overhead,
    speedup_table,
    time_batched,
    time_decoder_sets,
    time_generation,
)
from drc_book.speed_checks import (
    anderson_configs,
    anderson_summary,
    anderson_table,
    by_kind,
    measurement_cost,
    measurement_pass,
    measurement_summary,
    profile_generation,
    run_speed,
)
from drc_core import RuleSpec
from drc_core.data import PrepareConfig, SourceSpec, prepare
from drc_core.errors import DrcError, run_cli
from drc_core.halting.generate import generate
from drc_core.halting.rules import KLThreshold, StateDelta
from drc_core.training.evaluate import loss_by_depth

V = 64
ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "adaptive_speed.py"
SPEED_COLS = ("proxy_speedup", "flop_speedup", "wallclock_speedup", "wall_over_proxy")


@pytest.fixture(scope="module")
def model(one_thread, tiny_model_factory):
    return tiny_model_factory(V).eval()


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, V, (6, 17), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def cfg():
    return SpeedConfig(reference_loops=4, rule_max_loops=8, batch_size=4, rounds=1, new_tokens=4, prompt_len=8,
                       measure_loops=6, measure_windows=2)


@pytest.fixture(scope="module")
def report(model, windows, cfg):
    return run_speed(model, windows, cfg)


def _finite_positive(frame: pd.DataFrame, cols) -> None:
    values = frame[list(cols)].to_numpy(float)
    assert (values > 0).all() and pd.notna(values).all() and (values < math.inf).all(), frame[list(cols)]


def test_frames_have_the_expected_columns(report, cfg):
    assert {"family", "param", "rule", "needs_log_probs", "avg_loops", "ce", "ce_uniform", "ce_target",
            "matched_offline", "within_tolerance", "note"} <= set(report.matched.table.columns)
    assert list(report.matched.table.family) == list(cfg.families)
    common = {"setting", "family", "param", "rule", "path", "baseline", "needs_log_probs", "avg_loops", "seconds",
              "spread", *SPEED_COLS}
    assert common | {"ce", "ce_uniform", "ce_gap", "within_tolerance", "tokens_per_s", "page_faults_per_batch"} <= set(
        report.batched.columns)
    assert (report.batched.page_faults_per_batch >= 0).all()
    assert common | {"ms_per_token", "prompt_ms", "same_tokens", "first_divergence"} <= set(report.generation.columns)
    assert set(report.batched.setting) == {"batched eval"} and set(report.generation.setting) == {"generation"}
    # baseline, Uniform(r) through skip_forward, one row per matched rule
    assert len(report.batched) == 2 + len(report.matched.specs)
    assert len(report.generation) == 2 + len(report.matched.specs)  # dense decoder, Uniform(r) via generate
    assert {"pass", "loops", "seconds", "x_forward", "x_readout_pass", "target_as_worded"} <= set(
        report.measurement.columns)
    assert len(report.measurement) == 4 and set(report.measurement.loops) == {cfg.measure_loops}
    table = report.table()
    assert list(table.columns[:5]) == ["setting", "rule", "avg_loops", "proxy_speedup", "flop_speedup"]
    assert {"wallclock_speedup", "wall_over_proxy"} <= set(table.columns)
    assert len(table) == len(report.batched) - 1 + len(report.generation) - 1  # baselines left out
    assert table.rule.map(type).eq(str).all()
    json.dumps(report.to_dict(), default=str)  # JSON-ready


def test_speedups_are_positive_and_finite(report):
    for frame in (report.batched, report.generation):
        _finite_positive(frame, (*SPEED_COLS, "seconds", "avg_loops"))
    _finite_positive(report.measurement, ("seconds", "x_forward", "x_readout_pass"))
    base = report.batched[report.batched.baseline].iloc[0]
    assert base.path == "forward" and base.wallclock_speedup == 1 and base.proxy_speedup == 1
    for frame in (report.batched, report.generation):
        r = report.config.reference_loops
        rules = frame[frame.family != "uniform"]
        assert list(rules.proxy_speedup) == pytest.approx(list(r / rules.avg_loops))
        assert list(rules.wall_over_proxy) == pytest.approx(list(rules.wallclock_speedup / rules.proxy_speedup))


def test_matched_rules_are_within_tolerance_of_uniform(model, windows, report, cfg):
    m = report.matched.table
    assert m.within_tolerance.all() and m.matched_offline.all(), m
    assert (m.ce <= m.ce_target + 1e-9).all()
    r = cfg.reference_loops
    want = loss_by_depth(model, windows, [r], batch_size=cfg.batch_size, seed=cfg.seed)[r]
    assert m.ce_uniform.iloc[0] == pytest.approx(want, rel=1e-5)
    b = report.batched.set_index("rule")
    assert b.ce_uniform.iloc[0] == pytest.approx(want, rel=1e-5)
    assert b.loc[f"uniform={r} via skip_forward", "ce"] == pytest.approx(want, rel=1e-4)
    for row in m.itertuples():  # the timed outputs are exactly the matched point's online outputs
        assert b.loc[row.rule, "ce"] == pytest.approx(row.ce, rel=1e-5)
        assert b.loc[row.rule, "avg_loops"] == pytest.approx(row.avg_loops)
        assert b.loc[row.rule, "ce_gap"] <= cfg.ce_tolerance
        assert b.loc[row.rule, "within_tolerance"]
    grid = report.matched.grid
    assert grid.chosen.sum() == len(m)
    for row in m.itertuples():  # no shallower grid point of the family met the target offline
        fam = grid[grid.family == row.family]
        shallower = fam[fam.avg_depth < row.avg_loops_offline]
        assert (shallower.ce > row.ce_target).all()


def test_rules_keep_their_needs_log_probs_path(report):
    b = report.batched.set_index("family")
    assert b.loc["kl", "path"] == "skip_log_probs" and bool(b.loc["kl", "needs_log_probs"])
    assert b.loc["state_delta", "path"] == "skip_states" and not bool(b.loc["state_delta", "needs_log_probs"])


def test_generation_rows(report, cfg):
    g = report.generation
    base = g[g.baseline].iloc[0]
    assert base.rule == f"uniform={cfg.reference_loops} dense decode" and base.same_tokens == 1
    assert base.path == "dense decode" and base.wallclock_speedup == 1
    uniform = g[(g.family == "uniform") & ~g.baseline].iloc[0]  # generate with Uniform(r): the dense decoder's tokens
    assert uniform.same_tokens == 1 and uniform.avg_loops == cfg.reference_loops
    assert uniform.honest_flops == pytest.approx(base.honest_flops, rel=1e-9)
    assert base.first_divergence == cfg.new_tokens
    assert ((g.first_divergence >= 0) & (g.first_divergence <= cfg.new_tokens)).all()
    assert (g.same_tokens[g.first_divergence < cfg.new_tokens] < 1).all()
    assert base.avg_loops == cfg.reference_loops
    assert ((g.same_tokens >= 0) & (g.same_tokens <= 1)).all()
    assert (g.avg_loops <= cfg.rule_max_loops).all() and (g.avg_loops >= 1).all()


def test_loops_run_is_the_deepest_exit_per_step(model, windows, cfg):
    """``loops_run`` of a generation row: mean over new positions of the max exit loop over rows; = avg_loops at
    batch 1, >= avg_loops at batch > 1, r for the uniform rows."""
    rules = [StateDelta(3e-1, max_loops=8), KLThreshold(3e-2, max_loops=8)]
    one = time_generation(model, windows[:1, :6], rules, cfg)
    assert list(one.loops_run) == pytest.approx(list(one.avg_loops))
    three = time_generation(model, windows[:3, :6], rules, cfg)
    assert (three.loops_run >= three.avg_loops - 1e-12).all() and (three.loops_run <= 8).all()
    assert list(three.loops_run[three.family == "uniform"]) == [cfg.reference_loops] * 2
    for rule, row in zip(rules, three.iloc[2:].itertuples(), strict=True):
        res = generate(model, windows[:3, :6], cfg.new_tokens, rule, state=_gen_state(model, cfg, 3, 6),
                       fused=cfg.fused)
        assert row.loops_run == pytest.approx(float(res.exit_loop[:, 5:].max(dim=0).values.double().mean()))


def _gen_state(model, cfg, rows, t0):
    """The initial states time_generation draws (seeded by cfg.seed)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    return model.initial_state(torch.zeros(rows, t0 + cfg.new_tokens, model.cfg.d_model), gen)


def test_decode_loop_cost_rows_and_fit(model, windows, cfg):
    cost = decode_loop_cost(model, windows[:, :6], cfg, rows=(1, 2, 4))
    assert list(cost.rows) == [1, 2, 4] and cost.step_ms.gt(0).all()
    assert list(cost.loop_ms_per_row) == pytest.approx(list(cost.loop_ms / cost.rows))
    # the fit is the least-squares line through (rows, loop_ms)
    slope, icpt = torch.linalg.lstsq(torch.tensor([[1.0, 1], [2, 1], [4, 1]], dtype=torch.float64),
                                     torch.tensor(cost.loop_ms.tolist(), dtype=torch.float64)[:, None]).solution[:, 0]
    assert cost.per_row_ms.iloc[0] == pytest.approx(float(slope)) and cost.fixed_ms.iloc[0] == pytest.approx(
        float(icpt))
    assert list(cost.fixed_share) == pytest.approx(list(cost.fixed_ms / cost.loop_ms))
    with pytest.raises(DrcError, match="rows"):
        decode_loop_cost(model, windows[:2, :6], cfg, rows=(1, 4))


def test_decode_prediction_limits():
    """loop = fixed + per_row x active rows: with no per-row cost the speed-up is r / loops_run, with no fixed
    cost r / avg_loops (the proxy); in between, r (f + p B) / (f loops_run + p B avg_loops)."""
    gen = pd.DataFrame([
        {"rows": 4, "family": "uniform", "baseline": True, "rule": "dense", "avg_loops": 8.0, "loops_run": 8.0,
         "proxy_speedup": 1.0, "honest_speedup": 1.0, "wallclock_speedup": 1.0},
        {"rows": 4, "family": "kl", "baseline": False, "rule": "kl", "avg_loops": 4.0, "loops_run": 6.0,
         "proxy_speedup": 2.0, "honest_speedup": 1.2, "wallclock_speedup": 0.9}])

    def cost(fixed, per_row):
        return pd.DataFrame({"fixed_ms": [fixed], "per_row_ms": [per_row]})

    assert decode_prediction(gen, cost(1.0, 0.0)).loop_cost_speedup.item() == pytest.approx(8 / 6)
    assert decode_prediction(gen, cost(0.0, 1.0)).loop_cost_speedup.item() == pytest.approx(2.0)
    mixed = decode_prediction(gen, cost(1.0, 0.25))
    assert mixed.loop_cost_speedup.item() == pytest.approx(8 * 2 / (6 + 4))
    assert list(mixed.columns) == ["rows", "rule", "avg_loops", "loops_run", "proxy_speedup", "honest_speedup",
                                   "loop_cost_speedup", "wallclock_speedup"]


def test_functions_take_plain_rules(model, windows, cfg):
    rules = [KLThreshold(1e-2, max_loops=6), StateDelta(1e-1, max_loops=6)]
    b = time_batched(model, windows[:4], rules, cfg)
    assert list(b.family[2:]) == ["KLThreshold", "StateDelta"] and b.param.iloc[2:].isna().all()
    g = time_generation(model, windows[:2, :5], rules[1:], cfg)
    assert len(g) == 3 and g.ms_per_token.gt(0).all()
    assert speedup_table(b, g).setting.tolist() == ["batched eval"] * 3 + ["generation"] * 2


def test_measurement_cost_ratios(model, windows, cfg):
    ms = measurement_cost(model, windows, cfg).set_index("pass")
    assert ms.loc[f"forward, depth {cfg.measure_loops}", "x_forward"] == 1
    assert ms.loc[f"readout every loop, {cfg.measure_loops} loops", "x_readout_pass"] == 1
    assert (ms.windows == cfg.measure_windows).all()


def test_matmul_flop_model(model):
    T = 16
    assert matmul_flops_per_token(model, 4, T, "forward") == model.flops_per_token(4, T)
    assert matmul_flops_per_token(model, 4, T, "skip_states") == pytest.approx(model.flops_per_token(4, T))
    assert matmul_flops_per_token(model, 2.5, T, "skip_states") < matmul_flops_per_token(model, 4, T, "forward")
    # reading out at every loop costs the coda and the head per loop
    assert matmul_flops_per_token(model, 4, T, "skip_log_probs") > matmul_flops_per_token(model, 4, T, "forward")
    with pytest.raises(ValueError, match="path"):
        matmul_flops_per_token(model, 4, T, "dense")


def test_flop_parts_add_up(model):
    T = 16
    p = flop_parts(model, T)
    for r in (0, 1, 5):
        assert p["prelude"] + r * p["core"] + p["coda"] + p["head"] == pytest.approx(model.flops_per_token(r, T))
    # a log-prob rule's readout per loop: coda + head + the vocabulary statistic, what honest_flops charges
    assert p["readout"] == pytest.approx(p["coda"] + 2 * model.cfg.d_model * V + VOCAB_STAT_FLOPS * V)
    assert matmul_flops_per_token(model, 3, T, "skip_log_probs") == pytest.approx(
        p["prelude"] + 3 * (p["core"] + p["readout"] - p["vocab_stats"]))


@pytest.mark.parametrize("kw, needle", [
    ({"rounds": 0}, "rounds"), ({"new_tokens": 1}, "new_tokens"), ({"ce_tolerance": -1.0}, "ce_tolerance"),
    ({"families": ("kl", "nope")}, "families"), ({"measure_loops": 1}, "measure_loops"),
])
def test_bad_config_is_one_line(kw, needle):
    with pytest.raises(DrcError, match=needle) as exc:
        SpeedConfig(**kw)
    assert "\n" not in str(exc.value)


def test_bad_windows_are_one_line(model, cfg):
    with pytest.raises(DrcError, match="integer tensor"):
        matched_rules(model, torch.zeros(2, 9), cfg)
    with pytest.raises(DrcError, match="vocabulary"):
        time_batched(model, torch.full((2, 9), V), [], cfg)
    with pytest.raises(DrcError, match="max_seq_len"):
        time_generation(model, torch.zeros(1, 30, dtype=torch.long), [], cfg)
    with pytest.raises(DrcError, match="each rule once"):
        time_batched(model, torch.zeros(2, 9, dtype=torch.long), [StateDelta(0.1), StateDelta(0.1)], cfg)


# ---------------------------------------------------------------------------------------------- the bench


def _bench():
    spec = importlib.util.spec_from_file_location("adaptive_speed", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _one_error_line(capsys, rc: int) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small prepared corpus of synthetic text (vocabulary 300, windows of 16 tokens)."""
    rng = random.Random(0)
    text = ("the of and a to in is was for on that with as by it his he at from this be are an which or had "
            "time state nation people year law power war house work government congress")
    words = text.split(" ")
    src = tmp_path_factory.mktemp("speed_txt")
    for i in range(20):
        text = " ".join(rng.choice(words) for _ in range(400))
        (src / f"doc{i}.txt").write_text(text.capitalize() + ".")
    out = tmp_path_factory.mktemp("speed_corpus") / "corpus"
    prepare(PrepareConfig(source=SourceSpec("local", paths=(str(src),)), out=str(out), vocab_size=300, seq_len=16),
            progress=False)
    return out


def test_bench_missing_run_dir_is_one_error_line(capsys, tmp_path):
    line = _one_error_line(capsys, run_cli(_bench().main, ["--run", str(tmp_path / "nope")]))
    assert "does not exist" in line and "--run" in line


def test_bench_script_exits_2_on_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--run", str(tmp_path / "nope")], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model directory"), proc.stderr


def test_bench_bad_corpus_and_vocab_mismatch(capsys, tmp_path, corpus, tiny_model_factory):
    run = tiny_model_factory(V).save(tmp_path / "run")
    line = _one_error_line(capsys, run_cli(_bench().main, ["--run", str(run), "--data", str(tmp_path / "none")]))
    assert "does not exist" in line
    (tmp_path / "empty").mkdir()
    line = _one_error_line(capsys, run_cli(_bench().main, ["--run", str(run), "--data", str(tmp_path / "empty")]))
    assert "not a prepared corpus" in line
    line = _one_error_line(capsys, run_cli(_bench().main, ["--run", str(run), "--data", str(corpus)]))
    assert "vocabulary 300" in line and f"has {V}" in line
    line = _one_error_line(capsys, run_cli(_bench().main, ["--run", str(run), "--data", str(corpus),
                                                            "--windows", "0"]))
    assert "--windows" in line


def test_bench_end_to_end(capsys, tmp_path, corpus, tiny_model_factory):
    run = tiny_model_factory(300).save(tmp_path / "run")
    out = tmp_path / "speed.json"
    argv = ["--run", str(run), "--data", str(corpus), "--windows", "4", "--seq-len", "16", "--loops", "4",
            "--rule-max-loops", "8", "--rounds", "1", "--batch-size", "2", "--new-tokens", "3", "--prompt-len", "6",
            "--measure-windows", "1", "--measure-loops", "4", "--threads", "1", "--quiet", "--ce-tolerance", "0.05",
            "--families", "kl,state_delta,acceleration", "--more-gen-rows", "2", "--fused", "off",
            "--anderson-windows", "2", "--bf16", "on", "--json", str(out), "--decoders", "1,2", "--serving-slots", "2"]
    assert run_cli(_bench().main, argv) == 0
    text = capsys.readouterr().out
    for needle in ("matched quality", "batched eval", "generation", "measurement pass", "verdicts", "wall/proxy",
                   "cannot hold as worded", "wall/honest", "speed targets", "profile of one batch", "huginn",
                   "Anderson acceleration", "anderson m=3", "bf16 autocast against fp32", "rel_diff_median",
                   "decode loop cost by active rows", "loop_cost_speedup", "loops run", "decoders:", "realization",
                   "gives generate's tokens and exit loops: True", "serving 4 requests"):
        assert needle in text
    data = json.loads(out.read_text())
    assert data["windows"] == 4 and {"batched", "generation", "measurement", "matched", "table", "targets",
                                     "profile_kinds", "anderson", "bf16", "bf16_kl", "decode_loop_cost",
                                     "decoders", "decoder_targets", "serving"} <= set(data)
    assert {row["path"] for row in data["decoders"]} == {"dense decode", "generate", "continuous"}
    assert [row["rows"] for row in data["decode_loop_cost"]] == [1, 2]
    assert {row["rows"] for row in data["generation"]} == {1, 2}
    assert {row["setting"] for row in data["table"]} == {"batched eval", "generation"}


def test_summaries_of_the_frames(report, cfg):
    """What notebook 5 and the benchmark read from the frames, by pass kind and rule, not by label strings."""
    ms = report.measurement
    assert measurement_pass(ms, "forward").x_forward == 1
    assert measurement_pass(ms, "readout").x_readout_pass == 1
    full = ms[ms["pass"] == "measure_windows (kl_to_final=True)"].iloc[0]
    assert measurement_summary(ms) == {"measurement_x_forward": full.x_forward,
                                       "measurement_x_readout_pass": full.x_readout_pass,
                                       "readout_pass_x_forward": measurement_pass(ms, "readout").x_forward}
    with pytest.raises(DrcError, match="not a measurement pass"):
        measurement_pass(ms, "backward")
    b = report.batched
    assert skip_overhead(b) == b.set_index("rule").loc[f"uniform={cfg.reference_loops} via skip_forward",
                                                       "wallclock_speedup"]


def test_honest_flops_columns(report, model):
    b = report.batched.set_index("rule")
    r = report.config.reference_loops
    # the skipping path at uniform depth does exactly the forward's work; a rule reading log-probs pays a readout
    # per loop, a rule on states does not
    assert b.loc[f"uniform={r} via skip_forward", "honest_flops"] == pytest.approx(b.loc[f"uniform={r}",
                                                                                          "honest_flops"])
    for row in report.batched[~report.batched.baseline].itertuples():
        assert row.wall_over_honest == pytest.approx(row.wallclock_speedup / row.honest_speedup)
    T = 16
    kl = report.batched[report.batched.family == "kl"].iloc[0]  # coda + head + statistics at every active loop
    want = matmul_flops_per_token(model, kl.avg_loops, T, "skip_log_probs") + \
        VOCAB_STAT_FLOPS * V * kl.avg_loops
    assert kl.honest_flops == pytest.approx(want, rel=1e-9) and kl.honest_speedup < kl.proxy_speedup
    sd = report.batched[report.batched.family == "state_delta"].iloc[0]  # one readout, plus the coda context
    assert sd.honest_flops >= matmul_flops_per_token(model, sd.avg_loops, T, "skip_states") * (1 - 1e-9)


def test_speed_targets_rows(report):
    t = report.targets
    assert {"setting", "rule", "target", "value", "threshold", "met", "ceiling", "reachable"} <= set(t.columns)
    assert (t.met == [v <= th if "<=" in tg else (v > th if "> 1" in tg else v >= th)
                      for v, th, tg in zip(t.value, t.threshold, t.target, strict=True)]).all()
    # the ceiling is the value at wall = honest FLOPs; a met target has a reachable ceiling
    b = report.batched.set_index("rule")
    for row in t.itertuples():
        if row.setting != "batched eval":
            continue
        if row.target == "wall / proxy >= 0.9":
            assert row.ceiling == pytest.approx(b.loc[row.rule, "honest_speedup"] / b.loc[row.rule, "proxy_speedup"])
        elif "speedup" in row.target:
            assert row.ceiling == pytest.approx(b.loc[row.rule, "honest_speedup"])
        else:
            assert row.ceiling == 1.0 and row.reachable
    assert (t.reachable == [c <= th if "<=" in tg else (c > th if "> 1" in tg else c >= th)
                            for c, th, tg in zip(t.ceiling, t.threshold, t.target, strict=True)]).all()
    targets = set(t.target)
    assert {"time / dense time at equal depth <= 1.05", "wall / honest FLOPs >= 0.9", "wall / proxy >= 0.9",
            "wall-clock speedup >= 1.5", "faster than uniform depth (wall-clock speedup > 1)"} <= targets
    assert set(t.setting) == {"batched eval", "generation, batch 1"}
    # each judged on the interval of its paired per-round speed-up: a verdict only where the interval agrees
    for frame in (report.batched, report.generation):
        rules = frame[~frame.baseline]
        assert (rules.speedup_lo <= rules.speedup_hi).all() and (rules.speedup_coverage >= 0).all()
    for row in t.itertuples():
        assert row.lo <= row.hi
        ends = [row.lo <= row.threshold if "<=" in row.target else row.lo > row.threshold if "> 1" in row.target
                else row.lo >= row.threshold,
                row.hi <= row.threshold if "<=" in row.target else row.hi > row.threshold if "> 1" in row.target
                else row.hi >= row.threshold]
        assert row.verdict == ("met" if all(ends) else "missed" if not any(ends) else "unresolved")


def test_target_row_judges_the_interval_not_the_median():
    from drc_book.speed import paired_speedup, target_row

    at_least_one = lambda v: v >= 1.0  # noqa: E731
    assert target_row(1.1, 0.9, 1.3, at_least_one)["verdict"] == "unresolved"
    assert target_row(1.1, 0.9, 1.3, at_least_one)["met"]  # the median alone would say met
    assert target_row(1.1, 1.05, 1.3, at_least_one)["verdict"] == "met"
    assert target_row(0.9, 0.8, 0.95, at_least_one)["verdict"] == "missed"
    assert target_row(0.9, math.nan, math.nan, at_least_one)["verdict"] == "missed"  # no interval: the median
    assert not target_row(0.9, 0.8, 0.95, at_least_one, ceiling=0.99)["reachable"]
    assert target_row(0.9, 0.8, 0.95, at_least_one, ceiling=math.nan)["reachable"]
    # the median of each round's ratio: drift common to both calls of a round cancels
    got = paired_speedup([2.0, 4.0, 8.0], [1.0, 2.0, 4.0])
    assert (got["speedup_lo"], got["speedup_hi"], got["speedup_coverage"]) == (2.0, 2.0, 0.75)


def test_presets_profile_and_more_rows(model, windows):
    cfg = SpeedConfig(reference_loops=4, rule_max_loops=8, batch_size=4, rounds=1, new_tokens=3, prompt_len=6,
                      measure_loops=4, measure_windows=1, presets=True, profile=True, more_gen_rows=(2,),
                      families=("kl", "acceleration"))
    rep = run_speed(model, windows, cfg)
    huginn = rep.batched[rep.batched.family == "huginn"]
    assert len(huginn) >= 6 and huginn.ce.notna().all() and (huginn.avg_loops <= 8).all()
    assert "huginn" not in set(rep.targets.rule.map(lambda r: "huginn" if r in set(huginn.rule) else r))
    assert sorted(set(rep.generation.rows)) == [1, 2]
    assert (rep.generation.groupby("rows").baseline.sum() == 1).all()
    kinds = rep.profile_kinds
    assert set(kinds.variant) == {"uniform=4", "uniform=4 via skip_forward", *map(str, (s.rule for s in
                                                                                            rep.matched.specs))}
    for _, g in kinds.groupby("variant"):
        assert g[g.kind != "total"].ms.sum() == pytest.approx(g[g.kind == "total"].ms.iloc[0], rel=1e-6)
    assert len(rep.profile_ops) > 0 and rep.profile_ops.calls.gt(0).all()
    for _, g in kinds.groupby("variant"):
        assert g[g.kind != "total"].calls.sum() == g[g.kind == "total"].calls.iloc[0]
    json.dumps(rep.to_dict(), default=str)


def test_profile_generation_variants(model, windows, cfg, capfd):
    rules = [StateDelta(1e-1, max_loops=6), KLThreshold(1e-2, max_loops=6)]
    capfd.readouterr()
    kinds, ops = profile_generation(model, windows[:2, :6], rules, cfg, top=5)
    assert "profiler_st" not in capfd.readouterr().err  # torch's C++ start/stop lines stay out of notebooks
    r = cfg.reference_loops
    assert list(dict.fromkeys(kinds.variant)) == [f"uniform={r} dense decode", f"uniform={r}", *map(str, rules)]
    for _, g in kinds.groupby("variant"):
        assert g[g.kind != "total"].ms.sum() == pytest.approx(g[g.kind == "total"].ms.iloc[0], rel=1e-6)
        assert "matmul" in set(g.kind)
    assert ops.groupby("variant").size().le(5).all() and ops.calls.gt(0).all()
    kinds, _ = profile_generation(model, windows[:2, :6], rules[:1], cfg, top=5, continuous=True)
    assert list(dict.fromkeys(kinds.variant))[-1] == f"continuous {rules[0]}"


def test_self_cpu_ms_is_what_key_averages_gives(model, windows):
    from torch.profiler import ProfilerActivity, profile

    from drc_book.speed_checks import self_cpu_ms

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, windows[:2, :6], 3, KLThreshold(1e-2, max_loops=6))  # redispatched ops (add_, div_) too
    mine = self_cpu_ms(prof)
    ref = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
    assert set(mine) == set(ref) and len(mine) > 20
    for op, (ms, calls) in ref.items():
        assert mine[op][1] == calls, op
        assert mine[op][0] == pytest.approx(ms, rel=1e-9, abs=1e-9), op


def test_bad_clock_and_rows_are_one_line():
    with pytest.raises(DrcError, match="clock"):
        SpeedConfig(clock="sundial")
    with pytest.raises(DrcError, match="more_gen_rows"):
        SpeedConfig(more_gen_rows=(0,))


def test_bf16_check_rows(model, windows, cfg):
    from drc_book.speed_checks import bf16_check

    frame, kl = bf16_check(model, windows[:4], [KLThreshold(1e-2, max_loops=6)], cfg)
    assert list(frame.precision) == ["fp32", "bf16", "fp32", "bf16"]
    fp32 = frame[frame.precision == "fp32"]
    assert (fp32.same_exit == 1).all() and (fp32.x_fp32_time == 1).all()
    assert ((frame.same_exit >= 0) & (frame.same_exit <= 1)).all()
    assert frame[frame.rule == f"uniform={cfg.reference_loops}"].avg_loops.eq(cfg.reference_loops).all()
    assert list(kl.loop) == list(range(2, cfg.reference_loops + 1)) and (kl.rel_diff_median >= 0).all()


def test_anderson_table_rows_agree_with_fixed_point_costs(model, windows):
    configs = anderson_configs(ms=(2,), damped=(0.85,))
    assert list(configs) == ["plain", "plain (beta 0.85)", "anderson m=2 beta=0.7 (sequence)"]
    t = anderson_table(model, windows, configs, max_evals=5, ref_loops=8, at_evals=3, batch_size=4,
                       time_rounds=1).set_index("method")
    assert list(t.index) == list(configs) and t.loc["plain", "x_plain_time_per_eval"] == 1.0
    with torch.inference_mode():
        costs = fixed_point_costs(model, windows, configs, max_evals=5, ref_loops=8, batch_size=4)
    c = costs.curves.set_index(["method", "evals"])
    for name in configs:
        assert t.loc[name, "kl_prev_at_5"] == pytest.approx(c.loc[(name, 5), "kl_prev"], rel=1e-6, abs=1e-12)
        assert t.loc[name, "ce_at_3"] == pytest.approx(c.loc[(name, 3), "ce"], rel=1e-6)
    with pytest.raises(DrcError, match="at_evals"):
        anderson_table(model, windows, configs, max_evals=3, at_evals=4)


def test_time_decoder_sets_times_each_batch_once(model, windows, cfg):
    """Notebook 05's decoder timings: generation at the generation batch sizes, the decoder table at the decoder
    batch sizes (those beyond the prompts left out), ordered by batch."""
    state, kl = StateDelta(0.1, max_loops=8), KLThreshold(0.01, max_loops=8)
    specs = [RuleSpec(state.family, 0.1, state), RuleSpec(kl.family, 0.01, kl)]
    out = time_decoder_sets(model, windows[:, : cfg.prompt_len], specs, cfg, gen_batches=[1],
                            decoder_batches=[2, 1, 64], continuous=[state.family])
    assert set(out.generation.rows) == {1} and set(out.generation.rule) >= {str(sp.rule) for sp in specs}
    assert out.decoders.batch.tolist() == sorted(out.decoders.batch) and set(out.decoders.batch) == {1, 2}
    assert set(out.decoders[out.decoders.path == "continuous"].family) == {"uniform", state.family}


def test_profile_by_kind_and_anderson_summary():
    kinds = pd.DataFrame([{"variant": "a", "kind": "matmul", "ms": 2.4, "calls": 3},
                          {"variant": "a", "kind": "total", "ms": 5.6, "calls": 10}])
    table = by_kind(kinds)
    assert table.loc["a", "matmul"] == 2 and table.loc["a", "matmul_calls"] == 3 and table.loc["a", "ops"] == 10
    anderson = pd.DataFrame({"method": ["plain", "plain (damped 0.85)", "anderson m=2", "anderson m=3"],
                             "evals_kl_1e-3": [4.0, 3.0, 2.0, 2.5], "evals_kl_1e-5": [10.0, 8.0, 5.0, 4.0],
                             "converged_1e-5": [0.5, 0.6, 0.9, 0.95], "x_plain_time_per_eval": [1.0, 1.0, 1.5, 2.0]})
    lines = anderson_summary(anderson).splitlines()
    assert lines[0].startswith("plain (damped 0.85): evaluations to 1e-5 8.00 (plain 10.00)")
    assert lines[1] == ("Anderson: evaluations to 1e-5 4.00-5.00, to 1e-3 2.00-2.50; each evaluation costs "
                        "1.50-2.00x a plain one; time to 1e-5, best (anderson m=2): 0.75x plain")
