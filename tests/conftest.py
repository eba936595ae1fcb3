"""Shared fixtures."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: tiny models run much faster that way on 2 busy cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_model_factory() -> Callable[..., DepthRecurrentLM]:
    """Build the tiny test model (d=32, 2 heads, P/R/C = 1/1/1); ``core_scale`` > 1 multiplies the core's
    weights so that outputs keep moving for a few loops."""

    def make(vocab_size: int, core_scale: float = 1.0, seed: int = 0) -> DepthRecurrentLM:
        torch.manual_seed(seed)
        cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_heads=2, n_prelude=1, n_core=1, n_coda=1,
                          max_seq_len=32)
        m = DepthRecurrentLM(cfg)
        with torch.no_grad():
            for p in m.core.parameters():
                p.mul_(core_scale)
        return m

    return make


@pytest.fixture(scope="module")
def moving_model(one_thread) -> DepthRecurrentLM:
    """The halting paths' test model: vocabulary 64, two core and two coda blocks, the core scaled up so that
    tokens keep changing for several loops (so rules exit tokens at different loops)."""
    torch.manual_seed(0)
    m = DepthRecurrentLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_prelude=1, n_core=2, n_coda=2,
                                     max_seq_len=32, injection="add"))
    with torch.no_grad():
        for p in m.core.parameters():
            p.mul_(4.0)
    return m.eval()


@pytest.fixture(scope="session")
def local_corpus(tmp_path_factory) -> Path:
    """A small prepared corpus (12 local text documents, BPE vocab 300, seq_len 32) for CLI and config tests."""
    from drc_core.data import PrepareConfig, SourceSpec, prepare

    src = tmp_path_factory.mktemp("texts")
    for i in range(12):
        (src / f"doc{i}.txt").write_text(" ".join(f"w{(i * 13 + j * 7) % 90}" for j in range(600)) + ".")
    out = tmp_path_factory.mktemp("corpus") / "corpus"
    prepare(PrepareConfig(source=SourceSpec("local", paths=(str(src),)), out=str(out), vocab_size=300, seq_len=32),
            progress=False)
    return out


@pytest.fixture(scope="session")
def script() -> Callable[[str], ModuleType]:
    """``script("readme_tables")``: ``scripts/readme_tables.py`` loaded as a module (the scripts are no package)."""

    def load(name: str) -> ModuleType:
        if name not in sys.modules:
            path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses and typing look the module up by name
            spec.loader.exec_module(module)
        return sys.modules[name]

    return load


def assert_notebooks_ran(executed: Path, names: list[str] | tuple[str, ...], results_dir: Path) -> None:
    """Each notebook of ``names`` executed into ``executed/<name>.ipynb`` without an error output, and wrote its
    results file into ``results_dir``."""
    import nbformat

    for name in names:
        nb = nbformat.read(executed / f"{name}.ipynb", as_version=4)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        assert not errors, name
        assert (results_dir / f"{name}.json").is_file(), name


def replace_path(path: Path, content: bytes | str) -> None:
    """Replace ``path`` by ``content``: bytes, or one of DIR, FIFO, DEVZERO (a link to /dev/zero), DANGLING (a link
    to nothing), HUGE (a sparse file above the 64 MB JSON limit)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if content == "DIR":
        path.mkdir()
    elif content == "FIFO":
        os.mkfifo(path)
    elif content == "DEVZERO":
        path.symlink_to("/dev/zero")
    elif content == "DANGLING":
        path.symlink_to(path.parent / "no-such-file")
    elif content == "HUGE":
        with open(path, "wb") as f:
            f.truncate(65 << 20)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
