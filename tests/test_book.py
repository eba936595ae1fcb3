"""The book runner (drc_core.book): profiles, papermill execution, failures, the Jupyter Book build, and a real
browser drawing a plotly figure of a built page.

The fixture book (tests/book_fixtures) has a passing notebook, a failing one and one with a plotly figure. The
``slow`` tests run the real book at the ``smoke`` profile end to end and open its convergence page.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest
import yaml

from drc_core.book.paths import ROOT_ENV, RUN_ENV
from drc_core.book.runner import build_book, find_browser, load_profiles, main, run_book, toc_for
from drc_core.book.runner import declared_parameters as declare
from drc_core.errors import DrcError

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "book_fixtures"


def chromium() -> str:
    if path := find_browser():
        return path
    pytest.skip("no Chromium on PATH: `apt-get install chromium` (.ci/run installs it)")


def rendered_dom(html: Path) -> str:
    """The DOM of ``html`` after headless Chromium ran its scripts (no network is needed or used)."""
    res = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          "--dump-dom", html.as_uri()], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@pytest.fixture
def fixture_book(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository-like directory: book/ with the fixture notebooks and a profiles file, and _config.yml."""
    shutil.copytree(FIXTURES, tmp_path / "book")
    shutil.copy(ROOT / "_config.yml", tmp_path / "_config.yml")
    (tmp_path / "book" / "profiles.toml").write_text(
        '[book]\nroot = "00_overview"\nnotebooks = ["01_pass", "02_fail", "03_plot"]\n\n'
        '[profiles.p]\ndescription = "fixture"\n[profiles.p.parameters]\nresults_dir = "res"\nn_windows = 3\n'
        'not_declared_anywhere = 7\n[profiles.p.notebooks.01_pass]\nlabel = "special"\n'
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def outputs(nb_path: Path) -> str:
    nb = nbformat.read(nb_path, as_version=4)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_run_injects_only_declared_parameters(fixture_book: Path) -> None:
    spec = load_profiles("book/profiles.toml")
    timings = run_book(spec, "p", "papermill_runs", only=["01_pass"], progress=False)
    assert set(timings) == {"01_pass"} and timings["01_pass"] > 0
    # the runner tells the kernel that it runs the profile (drc_core.book.paths.RUN_ENV): results may go to the
    # committed results_dir only then
    assert json.loads(Path("res/01_pass.json").read_text()) == {"profile": "p", "n_windows": 3, "run": "p"}
    executed = Path("papermill_runs/p/01_pass.ipynb")
    assert "profile=p n_windows=3 label=special" in outputs(executed)
    injected = [c for c in nbformat.read(executed, as_version=4).cells if "injected-parameters" in c.metadata.get(
        "tags", [])]
    assert len(injected) == 1 and "not_declared_anywhere" not in injected[0].source
    assert json.loads(Path("papermill_runs/p/timings.json").read_text())["01_pass"] == timings["01_pass"]


def test_overrides_from_the_command_line(fixture_book: Path) -> None:
    assert main(["run", "--profile", "p", "--only", "01_pass", "--set", "n_windows=11", "--quiet"]) == 0
    assert json.loads(Path("res/01_pass.json").read_text())["n_windows"] == 11


def test_failing_cell_stops_with_one_line_and_keeps_partial_output(fixture_book: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    good = Path("papermill_runs/p/02_fail.ipynb")
    good.parent.mkdir(parents=True)
    good.write_text("an earlier successful run")
    assert main(["run", "--profile", "p", "--quiet"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1
    assert "notebook 02_fail failed at cell" in err[0] and "ValueError: fixture failure on purpose" in err[0]
    partial = Path("papermill_runs/p/failed/02_fail.ipynb")
    assert partial.is_file() and "before the failure" in outputs(partial)
    assert "never reached" not in outputs(partial)
    assert good.read_text() == "an earlier successful run"  # not overwritten by the failed run
    assert Path("papermill_runs/p/01_pass.ipynb").is_file()  # notebooks before the failure ran
    assert not Path("papermill_runs/p/03_plot.ipynb").exists()  # and none after it


@pytest.mark.parametrize(("argv", "needle"), [
    (["run", "--profile", "nope"], "unknown profile 'nope'"),
    (["run", "--profile", "p", "--only", "99_none"], "unknown notebook"),
    (["run", "--profile", "p", "--set", "novalue"], "is not KEY=VALUE"),
    (["run", "--profile", "p", "--set", "n_windos=3"], "--set ['n_windos']: no notebook run here declares it"),
    (["build", "--profile", "p"], "no executed notebook"),
])
def test_bad_input_gives_one_error_line(fixture_book: Path, capsys: pytest.CaptureFixture, argv: list[str],
                                        needle: str) -> None:
    from drc_core.errors import run_cli

    assert run_cli(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


def test_declared_parameters_reads_the_cell_itself() -> None:
    """Comments holding '=' or quotes (which papermill's own inspection misreads) and annotations count."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        'checkpoint = "data/reference"  # "" = train here\nmax_docs = 0  # 0 = all\nxs: list[str] = []\n'
        'a = b = 1\n', metadata={"tags": ["parameters"]}), nbformat.v4.new_code_cell("later = 2")])
    assert declare(nb) == {"checkpoint", "max_docs", "xs", "a", "b"}


def test_notebook_specific_parameter_must_be_declared(fixture_book: Path) -> None:
    toml = fixture_book / "book" / "profiles.toml"
    toml.write_text(toml.read_text().replace('label = "special"', 'label = "special"\ntypo_param = 1'))
    with pytest.raises(DrcError, match=r"sets \['typo_param'\] for notebook 01_pass"):
        run_book(load_profiles(toml), "p", "papermill_runs", only=["01_pass"], progress=False)


def test_profiles_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DrcError, match="not found"):
        load_profiles(tmp_path / "none.toml")
    bad = tmp_path / "p.toml"
    bad.write_text('[book]\nnotebooks = ["missing"]\n[profiles.a]\n')
    with pytest.raises(DrcError, match="has no source"):
        load_profiles(bad)
    bad.write_text("[book\n")
    with pytest.raises(DrcError, match="not valid TOML"):
        load_profiles(bad)


def test_project_profiles_and_toc() -> None:
    """The shipped profiles file lists every notebook source, has the three profiles, and the top-level
    _toc.yml is exactly the reference profile's generated table of contents."""
    spec = load_profiles(ROOT / "book" / "profiles.toml")
    assert set(spec.profiles) >= {"smoke", "reference", "paper"}
    assert sorted(spec.notebooks) == sorted(p.stem for p in (ROOT / "book").glob("[0-9][0-9]_*.py"))
    assert yaml.safe_load((ROOT / "_toc.yml").read_text()) == yaml.safe_load(toc_for(spec, "reference",
                                                                                      ROOT / "papermill_runs", ROOT))


def test_build_draws_plotly_in_a_real_browser(fixture_book: Path) -> None:
    spec = load_profiles("book/profiles.toml")
    run_book(spec, "p", "papermill_runs", only=["01_pass", "03_plot"], progress=False)
    (fixture_book / "book" / "profiles.toml").write_text(
        (fixture_book / "book" / "profiles.toml").read_text().replace('"02_fail", ', ""))
    index = build_book(load_profiles("book/profiles.toml"), "p", "papermill_runs")
    page = index.parent / "papermill_runs" / "p" / "03_plot.html"
    assert page.is_file()
    dom = rendered_dom(page)
    assert 'class="main-svg"' in dom and "fixture figure" in dom  # plotly drew the figure, offline


@pytest.mark.slow
def test_smoke_profile_runs_every_notebook_and_renders(tmp_path: Path) -> None:
    """The real book at the smoke profile, end to end (< 5 min on 2 cores), then the HTML: every figure of the
    convergence page drawn by Chromium."""
    out = tmp_path / "runs"
    spec = load_profiles(ROOT / "book" / "profiles.toml")
    timings = run_book(spec, "smoke", out, cwd=ROOT, progress=False,
                       overrides={"results_dir": str(tmp_path / "results"), "work_dir": str(tmp_path / "work"),
                                  "runs_dir": str(tmp_path / "experiments")})
    assert list(timings) == list(spec.notebooks)
    for name in spec.notebooks:
        nb = nbformat.read(out / "smoke" / f"{name}.ipynb", as_version=4)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        assert not errors, name
        assert (tmp_path / "results" / f"{name}.json").is_file(), name
    # render inside a copy of the repository layout so the generated toc's paths resolve
    site = tmp_path / "site"
    (site / "book").mkdir(parents=True)
    shutil.copy(ROOT / "_config.yml", site)
    shutil.copy(ROOT / "book" / "00_overview.md", site / "book")
    shutil.copy(ROOT / "book" / "profiles.toml", site / "book")
    for name in spec.notebooks:
        shutil.copy(ROOT / "book" / f"{name}.py", site / "book")
    shutil.copytree(out, site / "papermill_runs")
    index = build_book(load_profiles(site / "book" / "profiles.toml"), "smoke", site / "papermill_runs", site)
    page = index.parent / "papermill_runs" / "smoke" / "02_convergence.html"
    html = page.read_text()
    n_figures = html.count('class="plotly-graph-div"')
    assert n_figures >= 3
    dom = rendered_dom(page)
    assert dom.count('class="main-svg"') >= n_figures  # each figure drew at least its main SVG


def test_render_png_draws_a_saved_figure(tmp_path: Path) -> None:
    import plotly.graph_objects as go

    from drc_core.book.runner import render_png

    chromium()  # skip without a browser
    fig_json = tmp_path / "f.figure.json"
    go.Figure(go.Scatter(x=[1, 2], y=[2, 1])).write_json(fig_json)
    png = render_png(fig_json, tmp_path / "out" / "f.png", width=400, height=300)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    with pytest.raises(DrcError, match="not found"):
        render_png(tmp_path / "missing.json", tmp_path / "x.png")


# --- paths: the notebooks' parameters resolve against the repository root from any working directory -----------


@pytest.fixture
def no_book_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROOT_ENV, raising=False)
    monkeypatch.delenv(RUN_ENV, raising=False)


def test_repo_root_walks_up_from_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       no_book_env: None) -> None:
    from drc_core.book.paths import at_root, repo_root

    (tmp_path / "repo" / "book" / "deeper").mkdir(parents=True)
    (tmp_path / "repo" / "_config.yml").write_text("title: t\n")
    monkeypatch.chdir(tmp_path / "repo" / "book" / "deeper")
    assert repo_root() == (tmp_path / "repo").resolve()
    assert at_root("data/corpus/default") == "../../data/corpus/default"
    assert at_root("runs/x", "", "/abs/path") == ("../../runs/x", "", "/abs/path")
    monkeypatch.chdir(tmp_path / "repo")
    assert at_root("data/corpus/default") == "data/corpus/default"  # papermill's cwd: the strings stay as given
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DrcError, match="no repository root"):
        repo_root()
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "repo"))  # the override wins over the search
    assert repo_root() == (tmp_path / "repo").resolve() and at_root("runs") == "repo/runs"
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "missing"))
    with pytest.raises(DrcError, match="is not a directory"):
        repo_root()


def _parameters_and_path_cell(src: Path) -> tuple[str, str]:
    import jupytext

    cells = [c for c in jupytext.read(src).cells if c.cell_type == "code"]
    i = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    return cells[i].source, cells[i + 1].source


@pytest.mark.parametrize("src", sorted((ROOT / "book").glob("[0-9][0-9]_*.py")), ids=lambda p: p.stem)
def test_every_notebook_resolves_its_paths_in_the_cell_after_its_parameters(
        src: Path, monkeypatch: pytest.MonkeyPatch, no_book_env: None) -> None:
    """The first code cell after the parameters, run with the kernel in book/ (JupyterLab), gives every path
    parameter pointing into the repository root (not into book/); the same strings at the root (papermill)."""
    params, paths = _parameters_and_path_cell(src)
    assert "at_root(" in paths and "%cd" not in paths
    defaults: dict = {}
    exec(params, defaults)
    path_names = [k for k, v in defaults.items() if k.endswith("_dir") or k == "checkpoint"]
    assert "work_dir" in path_names and "corpus_dir" in path_names
    monkeypatch.chdir(ROOT / "book")
    ns = dict(defaults)
    exec(paths, ns)
    for k in path_names:
        if k == "results_dir":  # an interactive run: the same path under runs/lab/, never the committed one
            assert ns[k] == os.path.relpath(ROOT / "runs" / "lab" / defaults[k], ROOT / "book")
            continue
        want = os.path.relpath(ROOT / defaults[k], ROOT / "book") if defaults[k] else ""
        assert ns[k] == want, k
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(RUN_ENV, "reference")  # as the book runner sets it for its kernels
    ns = dict(defaults)
    exec(paths, ns)
    assert all(ns[k] == defaults[k] for k in path_names)


def test_interactive_results_never_touch_the_committed_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            no_book_env: None) -> None:
    """Without the runner's RUN_ENV, results_for sends a results directory inside the repository to runs/lab/;
    save_results writes there, the committed file keeps its bytes, and load_results reads this session's result
    where there is one and the committed one otherwise."""
    from drc_core.book.paths import committed_counterpart, results_for
    from drc_core.book.workspace import load_results, save_results

    repo = tmp_path / "repo"
    committed = repo / "papermill_runs" / "p" / "results"
    committed.mkdir(parents=True)
    (repo / "book").mkdir()
    (repo / "_config.yml").write_text("title: t\n")
    (committed / "03_x.json").write_text('{"value": 1}\n')
    (committed / "01_y.json").write_text('{"value": 2}\n')
    before = (committed / "03_x.json").read_bytes()
    monkeypatch.chdir(repo / "book")
    lab = results_for("papermill_runs/p/results")
    assert lab == "../runs/lab/papermill_runs/p/results"
    assert committed_counterpart(lab) == committed.resolve()
    save_results(lab, "03_x", {"value": 3})
    assert (committed / "03_x.json").read_bytes() == before
    assert load_results(lab, "03_x") == {"value": 3} and load_results(lab, "01_y") == {"value": 2}
    with pytest.raises(DrcError, match="run notebook 02_z"):
        load_results(lab, "02_z")
    assert results_for("runs/mine") == "../runs/mine"  # already untracked: kept
    assert results_for(str(tmp_path / "elsewhere")) == str(tmp_path / "elsewhere")  # outside the repository: kept
    monkeypatch.setenv(RUN_ENV, "p")  # the book runner: the committed directory itself
    assert results_for("papermill_runs/p/results") == "../papermill_runs/p/results"
    assert committed_counterpart("../papermill_runs/p/results") is None
