"""Where a notebook's path parameters point, from any working directory, and where its results may go.

The notebooks' path parameters (``work_dir``, ``corpus_dir``, ``results_dir``, ``checkpoint``, ...) are relative
to the repository root. papermill starts the kernel at the root, JupyterLab in ``book/``; every notebook's first
code cell after its parameters therefore passes them through :func:`at_root`, which resolves them against the
root and returns them relative to the working directory (so a papermill run prints and records the very same
strings as before, and ``book/`` in JupyterLab gets ``../data/...``).

The root is ``$DRC_BOOK_ROOT`` when set (tests point it at a repository-shaped tmp dir), else the nearest directory
at or above the working directory that holds ``_config.yml`` and ``book/``. It is never derived from where the
``drc_core`` package is installed: an editable install would otherwise tie every copy of the book to one tree.

Results: the committed ``papermill_runs/<profile>/results/`` is written only when the book runner executes a
profile (it sets ``$DRC_BOOK_RUN`` to the profile's name for the kernels). In an interactive run
:func:`results_for` sends a results directory inside the repository to the same path under ``runs/lab/``
(untracked), and :func:`committed_counterpart` maps it back, so that reading a result that this interactive
session has not written yet falls back to the committed one (:func:`drc_book.workspace.load_results`).
"""

from __future__ import annotations

import os
from pathlib import Path

from drc_core import DrcError

__all__ = ["LAB_RESULTS", "ROOT_ENV", "RUN_ENV", "at_root", "book_run", "committed_counterpart", "repo_root",
           "results_for"]

ROOT_ENV = "DRC_BOOK_ROOT"  # overrides the search for the repository root
RUN_ENV = "DRC_BOOK_RUN"  # set by the book runner (to the profile) for the kernels it starts
LAB_RESULTS = Path("runs") / "lab"  # interactive runs' results, relative to the root (runs/ is gitignored)


def _is_root(path: Path) -> bool:
    return (path / "_config.yml").is_file() and (path / "book").is_dir()


def repo_root(start: str | Path | None = None) -> Path:
    """The repository root: ``$DRC_BOOK_ROOT`` if set, else the nearest directory at or above ``start`` (default:
    the working directory) holding ``_config.yml`` and ``book/``. Absolute; a one-line error when none is found."""
    env = os.environ.get(ROOT_ENV)
    if env:
        root = Path(env).expanduser().resolve()
        if not root.is_dir():
            raise DrcError(f"${ROOT_ENV}={env!r} is not a directory: point it at the repository root or unset it")
        return root
    here = Path(start if start is not None else os.getcwd()).resolve()
    for path in (here, *here.parents):
        if _is_root(path):
            return path
    raise DrcError(f"no repository root (a directory with _config.yml and book/) at or above {here}: start from "
                   f"inside the repository or set ${ROOT_ENV}")


def _relative(path: Path) -> str:
    """``path`` relative to the working directory (absolute when that is shorter to state or on another drive)."""
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)


def at_root(*paths: str | Path) -> str | tuple[str, ...]:
    """Each relative path resolved against :func:`repo_root` and given back relative to the working directory;
    absolute paths are returned as they are, and an empty string stays empty (it means "none" in the
    parameters). One argument gives one string, several a tuple in the same order."""
    root = None
    out = []
    for p in paths:
        if p is None or str(p) == "":
            out.append("")
            continue
        if Path(p).is_absolute():
            out.append(str(p))
            continue
        root = root or repo_root()
        out.append(_relative(root / p))
    return out[0] if len(out) == 1 else tuple(out)


def book_run() -> str | None:
    """The profile the book runner is executing (``$DRC_BOOK_RUN``), or None in an interactive session."""
    return os.environ.get(RUN_ENV) or None


def results_for(results_dir: str | Path) -> str:
    """Where this run writes its results: ``results_dir`` (resolved as by :func:`at_root`) when the book runner
    executes a profile; in an interactive run the same path under ``runs/lab/`` when it lies inside the
    repository and outside ``runs/``, so that tracked files are never touched. A directory outside the
    repository is used as given either way."""
    resolved = at_root(results_dir)
    if book_run() is not None or not resolved:
        return resolved
    root = repo_root()
    path = Path(resolved).resolve()
    if not path.is_relative_to(root) or path.is_relative_to(root / "runs"):
        return resolved
    return _relative(root / LAB_RESULTS / path.relative_to(root))


def committed_counterpart(results_dir: str | Path) -> Path | None:
    """For an interactive results directory (under ``runs/lab/`` of the root), the committed one it stands for;
    None for any other directory."""
    try:
        lab = repo_root() / LAB_RESULTS
    except DrcError:
        return None
    path = Path(results_dir).resolve()
    return lab.parent.parent / path.relative_to(lab) if path.is_relative_to(lab) else None
