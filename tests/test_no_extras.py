"""The library without the book extras: ``drc_core.load``, ``trace``, ``generate`` with a rule and a small sweep work
where plotly, ipywidgets, IPython, papermill (and the rest of the ``[book]`` extra) cannot be imported -- in this
environment with an import blocker, and (slow) in a fresh venv that installs only the base dependencies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "data" / "reference"
BOOK_EXTRAS = ("plotly", "ipywidgets", "IPython", "papermill", "nbformat", "jupytext", "ipykernel", "jupyterlab",
               "jupyter_book", "jupyter")

# every import of a book extra raises ImportError, as where none is installed (installed first, via -c)
BLOCKER = f"""
import sys
BLOCKED = {BOOK_EXTRAS!r}

class _NoBookExtras:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {{name!r}} (blocked: not a base dependency)")
        return None

sys.meta_path.insert(0, _NoBookExtras())
"""

# the library's entry points, kept small (few tokens, few loops); argv: the reference model's directory, the extras
CALLS = """
import sys
import torch
import drc_core
from drc_core.halting.sweep import default_rules, summarize, sweep

torch.set_num_threads(1)
lm = drc_core.load(sys.argv[1])
text = "The Congress shall have power to lay and collect taxes."
tr = lm.trace(text, max_loops=4)
assert len(tr.convergence_depth(1e-3)) == len(tr.ids) and tr.to_frame().shape[0] == 4 * len(tr.ids)
gen = lm.generate("The President said", max_new_tokens=3, rule=drc_core.make_rule("kl", 1e-3, max_loops=6))
assert len(gen.ids) == 3 and gen.exit_loops.max() <= 6
ids = torch.tensor([lm.tokenizer.encode(text).ids[:9]])
specs = [s for s in default_rules(max_loops=4) if s.family == "kl"][:2]
frame = sweep(lm.model, ids, specs, reference_loops=4, oracle_eps=(1e-2,))
assert set(frame.family) == {"kl", "uniform", "oracle"} and len(summarize(frame, n_boot=10)) == 2 + 4 + 1
for name in drc_core.__all__:  # every public name, but the explorer's, works without the book extras
    try:
        assert getattr(drc_core, name) is not None
    except drc_core.DrcError as exc:
        assert name in ("DepthExplorer", "depth_slider_figure", "token_strip_html", "plotting"), name
        assert "book extras" in str(exc), exc
try:
    tr.explorer()
except drc_core.DrcError as exc:
    assert "book extras" in str(exc), exc
else:
    raise AssertionError("the explorer was made without plotly/ipywidgets")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[2].split(","))
assert not loaded, loaded
print("library OK from", drc_core.__file__)
"""


def _run(python: str | Path, code: str, cwd: Path, timeout: int, reference: Path = REFERENCE
         ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["OMP_NUM_THREADS"] = "1"
    argv = [str(python), "-c", code, str(reference), ",".join(BOOK_EXTRAS)]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_library_works_without_the_book_extras():
    out = _run(sys.executable, BLOCKER + CALLS, ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "library OK" in out.stdout


def test_the_blocker_blocks():
    out = _run(sys.executable, BLOCKER + "import plotly.graph_objects\n", ROOT, timeout=60)
    assert out.returncode != 0 and "blocked" in out.stderr


@pytest.mark.slow
def test_pip_install_without_extras_in_a_fresh_venv(tmp_path: Path):
    """A fresh venv, torch==2.13.0 (the CPU wheel on local disk; unpinned, pip would pull a CUDA build), then
    ``pip install .`` (base dependencies only) from a copy of the repository: the same calls work there."""
    src = tmp_path / "repo"
    heavy = {".git", ".venv", "runs", "data", "papermill_runs", "_build", "node_modules", "build", "dist"}
    shutil.copytree(ROOT, src, ignore=lambda d, names: [
        n for n in names if (Path(d) == ROOT and n in heavy) or n == "__pycache__" or n.endswith(".egg-info")])
    reference = shutil.copytree(REFERENCE, tmp_path / "reference")  # the model of the same moment as the code
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    py = env_dir / "bin" / "python"
    for args in (["torch==2.13.0"], ["."]):
        done = subprocess.run([str(py), "-m", "pip", "install", "--quiet", *args], cwd=src, capture_output=True,
                              text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout.lower()
    assert "drc-book==" in listed
    for extra in ("plotly", "ipywidgets", "ipython", "papermill"):
        assert f"\n{extra}==" not in f"\n{listed}", f"{extra} was installed without the [book] extra"
    work = tmp_path / "elsewhere"  # not the repository: drc_core must come from the venv
    work.mkdir()
    out = _run(py, CALLS, work, timeout=600, reference=reference)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"library OK from {env_dir}" in out.stdout
