"""A notebook's path parameters, relative to the repository root, resolved from any working directory (papermill
runs at the root, JupyterLab in ``book/``). Only the book runner (``$DRC_BOOK_RUN``) writes the committed results; an
interactive run writes under ``runs/lab/`` and reads the committed results it has not written yet.
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


def repo_root(start: str | Path | None = None) -> Path:
    """``$DRC_BOOK_ROOT``, else the nearest directory with ``_config.yml`` and ``book/`` at or above ``start``."""
    env = os.environ.get(ROOT_ENV)
    if env:
        root = Path(env).expanduser().resolve()
        if not root.is_dir():
            raise DrcError(f"${ROOT_ENV}={env!r} is not a directory: point it at the repository root or unset it")
        return root
    here = Path(start if start is not None else os.getcwd()).resolve()
    for path in (here, *here.parents):
        if (path / "_config.yml").is_file() and (path / "book").is_dir():
            return path
    raise DrcError(f"no repository root (a directory with _config.yml and book/) at or above {here}: start from "
                   f"inside the repository or set ${ROOT_ENV}")


def _relative(path: Path) -> str:
    """``path`` relative to the working directory (absolute when on another drive, Windows)."""
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def at_root(*paths: str | Path) -> str | tuple[str, ...]:
    """Each relative path resolved against :func:`repo_root`, relative to the working directory; absolute and empty
    ("none") paths as they are. One argument gives one string, several a tuple."""
    out = [str(p or "") if not p or Path(p).is_absolute() else _relative(repo_root() / p) for p in paths]
    return out[0] if len(out) == 1 else tuple(out)


def book_run() -> str | None:
    """The profile the book runner is executing (``$DRC_BOOK_RUN``), or None in an interactive session."""
    return os.environ.get(RUN_ENV) or None


def results_for(results_dir: str | Path) -> str:
    """``results_dir`` as :func:`at_root` resolves it, moved under ``runs/lab/`` in an interactive run when it lies
    in the repository outside ``runs/``."""
    resolved = at_root(results_dir)
    if book_run() is not None or not resolved:
        return resolved
    root = repo_root()
    path = Path(resolved).resolve()
    if not path.is_relative_to(root) or path.is_relative_to(root / "runs"):
        return resolved
    return _relative(root / LAB_RESULTS / path.relative_to(root))


def committed_counterpart(results_dir: str | Path) -> Path | None:
    """The committed results directory an interactive one (under ``runs/lab/``) stands for, else None."""
    try:
        lab = repo_root() / LAB_RESULTS
    except DrcError:
        return None
    path = Path(results_dir).resolve()
    return lab.parent.parent / path.relative_to(lab) if path.is_relative_to(lab) else None
