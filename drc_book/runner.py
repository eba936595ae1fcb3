"""Run the book at a profile's scale, and render it.

``run --profile P`` executes each notebook ``book/profiles.toml`` lists with papermill, with the parameters it
declares, into ``OUT/<profile>/<name>.ipynb``. A failing cell: one ``error:`` line, exit 1, the partial notebook and
kernel log in ``OUT/<profile>/failed/``, and what it wrote undone (:class:`~drc_book.rollback.Rollback`), as after
Ctrl-C or SIGTERM. One runner per profile. ``build --profile P`` renders the executed notebooks with Jupyter Book v1.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drc_book.paths import RUN_ENV
from drc_book.rollback import Rollback, Terminated, raise_terminated
from drc_core import (
    ArgumentParser,
    DrcError,
    Interrupted,
    exclusive,
    first_line,
    machine_kind,
    parse_json,
    read_json,
    read_regular,
    refuse_links,
    write_file,
)

__all__ = ["BookSpec", "NotebookFailed", "Profile", "build_book", "declared_parameters", "find_browser",
           "load_profiles", "present", "read_timings", "render_png", "reproduction_markdown", "run_book",
           "slowest_cells", "toc_for"]

DEFAULT_PROFILES = Path("book") / "profiles.toml"
DEFAULT_OUT = Path("papermill_runs")
DEFAULT_RENDERER = "plotly_mimetype+notebook_connected"
PLOTLY_STATIC = Path("_static") / "plotly.min.js"  # copied in by `build`; _config.yml lists it in html_js_files
BOOK_CSS = "drc-book.css"  # beside the sources; copied into _static/ by `build` (_config.yml: html_css_files)
REPRODUCTION_MD = Path("_static") / "reproduction.md"  # written by `build`; the root page includes it
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OUTPUT_PARAMETERS = ("results_dir", "work_dir")  # where a notebook writes: its results, figures and frames
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a profile's or a notebook's name: one plain path component
PROFILE_KEYS = frozenset({"description", "plotly_renderer", "parameters", "notebooks", "env", "skip"})


def _need_name(kind: str, name: object, path: Path) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise DrcError(f"{path}: {kind} name {name!r} is not a plain name (letters, digits, '_', '.', '-'; no '/' or "
                       "'..'): it becomes a file name under --out; rename it")
    return name


def _need_table(value: object, where: str, path: Path) -> dict:
    if not isinstance(value, dict):
        raise DrcError(f"{path}: {where} is a {type(value).__name__}, not a table: fix the profiles file")
    return value


class NotebookFailed(DrcError):
    """A cell of a notebook raised: the message names the notebook, the cell and the exception."""


@dataclass(frozen=True)
class Profile:
    """One scale of the book: ``parameters`` for every notebook that declares them, ``notebooks[name]`` for one;
    ``env`` for the kernels."""

    name: str
    description: str = ""
    plotly_renderer: str = DEFAULT_RENDERER
    parameters: dict[str, Any] = field(default_factory=dict)
    notebooks: dict[str, dict[str, Any]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    skip: dict[str, str] = field(default_factory=dict)  # notebook -> why this profile does not run it

    def parameters_for(self, notebook: str) -> dict[str, Any]:
        return {"profile": self.name, **self.parameters, **self.notebooks.get(notebook, {})}


@dataclass(frozen=True)
class BookSpec:
    """The profiles file: where the sources are, their order, the root page, and the profiles."""

    source_dir: Path
    root: str
    notebooks: tuple[str, ...]
    profiles: dict[str, Profile]

    def profile(self, name: str) -> Profile:
        if name not in self.profiles:
            raise DrcError(f"unknown profile '{name}': choose from {', '.join(self.profiles)}")
        return self.profiles[name]


def load_profiles(path: str | Path = DEFAULT_PROFILES) -> BookSpec:
    """Read a profiles file (see ``book/profiles.toml`` for the format)."""
    path = Path(path)
    if not path.exists():
        raise DrcError(f"profiles file '{path}' not found: run from the repository root or pass --profiles")
    try:
        raw = tomllib.loads(read_regular(path, "a profiles file", 16 << 20).decode("utf-8"))  # at most 16 MB
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise DrcError(f"profiles file '{path}' is not valid TOML ({first_line(exc, 120)}): fix the line it names") \
            from None
    book = _need_table(raw.get("book", {}), "[book]", path)
    if unknown_book := set(book) - {"source_dir", "root", "notebooks"}:
        raise DrcError(f"{path}: unknown key(s) {sorted(unknown_book)} in [book]: use source_dir, root, notebooks")
    listed = book.get("notebooks", ())
    if not isinstance(listed, list | tuple):
        raise DrcError(f"{path}: [book] notebooks is not a list: list the notebook sources in order")
    notebooks = tuple(_need_name("notebook", nb, path) for nb in listed)
    if len(set(notebooks)) != len(notebooks):
        raise DrcError(f"{path}: [book] notebooks lists a notebook twice: list each once")
    if not notebooks:
        raise DrcError(f"{path}: [book] notebooks is empty: list the notebook sources in order")
    if not isinstance(book.get("source_dir", "."), str) or not isinstance(book.get("root", ""), str):
        raise DrcError(f"{path}: [book] source_dir and root must be strings")
    source_dir = (path.parent / book.get("source_dir", ".")).resolve()
    for nb in notebooks:
        if not (source_dir / f"{nb}.py").is_file():
            raise DrcError(f"{path}: notebook '{nb}' has no source {source_dir / (nb + '.py')}")
    profiles = {}
    for name, table in _need_table(raw.get("profiles", {}), "[profiles]", path).items():
        _need_name("profile", name, path)
        table = _need_table(table, f"[profiles.{name}]", path)
        for key in ("parameters", "notebooks", "env"):
            _need_table(table.get(key, {}), f"[profiles.{name}.{key}]", path)
        for nb, values in table.get("notebooks", {}).items():
            _need_table(values, f"[profiles.{name}.notebooks.{nb}]", path)
        if extra := set(table) - PROFILE_KEYS:
            raise DrcError(f"{path}: profile '{name}' has unknown key(s) {sorted(extra)}: use {sorted(PROFILE_KEYS)}")
        if stray := set(table.get("notebooks", {})) - set(notebooks):
            raise DrcError(f"{path}: profile '{name}' sets parameters of unlisted notebook(s) {sorted(stray)}")
        if not all(isinstance(table.get(k, ""), str) for k in ("description", "plotly_renderer")):
            raise DrcError(f"{path}: profile '{name}': description and plotly_renderer must be strings")
        if not all(isinstance(v, str | int | float | bool) for v in table.get("env", {}).values()):
            raise DrcError(f"{path}: [profiles.{name}.env] values must be strings or numbers (environment variables)")
        skip = _need_table(table.get("skip", {}), f"[profiles.{name}.skip]", path)
        if set(skip) - set(notebooks) or not all(isinstance(v, str) and v for v in skip.values()):
            raise DrcError(f"{path}: [profiles.{name}.skip] must map listed notebooks to a reason (a string)")
        profiles[name] = Profile(name=name, description=table.get("description", ""),
                                 plotly_renderer=table.get("plotly_renderer", DEFAULT_RENDERER),
                                 parameters=dict(table.get("parameters", {})),
                                 notebooks={k: dict(v) for k, v in table.get("notebooks", {}).items()},
                                 env={k: str(v) for k, v in table.get("env", {}).items()},
                                 skip={str(k): str(v) for k, v in skip.items()})
    if not profiles:
        raise DrcError(f"{path}: no [profiles.<name>] table: define at least one profile")
    return BookSpec(source_dir=source_dir, root=str(book.get("root", "")), notebooks=notebooks, profiles=profiles)


def declared_parameters(nb) -> set[str]:
    """The names a notebook's ``parameters``-tagged cell assigns (plain or annotated assignments)."""
    names: set[str] = set()
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            for node in ast.parse(cell.source).body:
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, ast.AnnAssign) else [])
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _tags(cell) -> list[str]:
    return list(cell.metadata.get("tags", []))


def _merge_parameters(source: str, injected: str) -> str:
    """``source`` (a ``parameters`` cell) with each assigned value replaced by the one in ``injected`` (papermill's
    cell) where the two differ, comments and layout kept; a first comment line says so when any was replaced."""
    new_values = {node.targets[0].id: node.value for node in ast.parse(injected).body
                  if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)}
    lines = [ln.encode() for ln in source.split("\n")]
    edits = []
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
            node.target if isinstance(node, ast.AnnAssign) else None)
        if not isinstance(target, ast.Name) or node.value is None or target.id not in new_values:
            continue
        old, new = node.value, new_values[target.id]
        try:
            same = ast.literal_eval(old) == ast.literal_eval(new)
        except ValueError:
            same = ast.dump(old) == ast.dump(new)
        if not same:
            edits.append((old, ast.get_source_segment(injected, new) or ast.unparse(new)))
    for old, text in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        first, last = old.lineno - 1, old.end_lineno - 1  # byte offsets within the UTF-8 lines
        lines[first:last + 1] = [lines[first][:old.col_offset] + text.encode() + lines[last][old.end_col_offset:]]
    out = "\n".join(ln.decode() for ln in lines)
    if edits:
        profile = new_values.get("profile")
        who = f"the {ast.literal_eval(profile)!r} profile" if isinstance(profile, ast.Constant) else "this run"
        out = f"# the values of {who} (book/profiles.toml), as papermill injected them\n" + out
    return out


def present(nb) -> bool:
    """Merge papermill's injected values into the notebook's own ``parameters`` cell (tagged ``hide-input``) and tag
    the injected cell ``remove-cell``; True when anything changed. Idempotent."""
    changed = False
    params = [c for c in nb.cells if c.cell_type == "code" and "parameters" in _tags(c)]
    for cell in nb.cells:
        if "injected-parameters" in _tags(cell) and "remove-cell" not in _tags(cell):
            for own in params:
                own.source = _merge_parameters(own.source, cell.source)
            cell.metadata["tags"] = [*_tags(cell), "remove-cell"]
            changed = True
    for own in params:
        if "hide-input" not in _tags(own):
            own.metadata["tags"] = [*_tags(own), "hide-input"]
            changed = True
    return changed


def _failure_line(name: str, exc: Any) -> str:
    """A papermill execution error on one line: the notebook, the cell (and its In [n]), the exception."""
    where = f"cell {exc.cell_index}" + (f" (In [{exc.exec_count}])" if exc.exec_count is not None else "")
    return f"notebook {name} failed at {where}: {exc.ename}: {' '.join(str(exc.evalue).split())}"


def under_out(value: Any, out: str | Path) -> Any:
    """A parameter value naming a path under ``papermill_runs/`` moved under ``out`` (``--out`` governs every
    output); anything else as is."""
    if not isinstance(value, str) or Path(out) == DEFAULT_OUT:
        return value
    parts = Path(value).parts
    if Path(value).is_absolute() or not parts or parts[0] != DEFAULT_OUT.name:
        return value
    if ".." in parts:
        raise DrcError(f"parameter value {value!r} climbs out of {DEFAULT_OUT}/ with '..': outputs stay under --out; "
                       "name the directory without '..'")
    return str(Path(out).joinpath(*parts[1:]))


def output_dirs(params: dict[str, Any], cwd: str | Path, notebook: str) -> list[tuple[Path, bool]]:
    """``(directory, recursive)`` that ``notebook`` writes with ``params``: its ``results_dir`` (every file below)
    and ``work_dir`` (the files directly in it); relative ones without ``..``."""
    dirs: dict[Path, tuple[Path, bool]] = {}  # by the resolved path: one directory named twice is one
    for k in OUTPUT_PARAMETERS:
        v = params.get(k)
        if v is None or v == "":
            continue
        if not isinstance(v, str):
            raise DrcError(f"notebook {notebook}: parameter {k}={v!r} is not a path: pass a directory name")
        if ".." in Path(v).parts:
            raise DrcError(f"notebook {notebook}: parameter {k}={v!r} climbs out of its directory with '..': "
                           "outputs stay under --out and the working directory; name the directory without '..'")
        d = Path(cwd) / v
        d, recursive = dirs.get(d.resolve(), (d, False))
        dirs[d.resolve()] = (d, recursive or k == "results_dir")
    return list(dirs.values())


def _kernel_log_manager(log: Path) -> type:
    """A kernel manager whose kernel writes its stderr to ``log``, out of the runner's one-line error."""
    from jupyter_client.manager import AsyncKernelManager

    class KernelLogManager(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
            with open(log, "ab") as f:  # the kernel keeps its own copy of the descriptor
                kw["stderr"] = f
                await super()._async_launch_kernel(kernel_cmd, **kw)

    return KernelLogManager


def run_book(spec: BookSpec, profile: str, out: str | Path = DEFAULT_OUT, *, only: list[str] | None = None,
             overrides: dict[str, Any] | None = None, cwd: str | Path = ".", progress: bool = True,
             kernel: str = "python3") -> dict[str, float]:
    """Execute the notebooks of ``spec`` (all, or ``only``) at ``profile``'s parameters plus ``overrides`` into
    ``out/<profile>/``; returns (and writes to ``timings.json``) seconds per notebook."""
    import jupytext

    prof, overrides = spec.profile(profile), overrides or {}
    names = list(spec.notebooks)
    if only:
        if unknown := [n for n in only if n not in names]:
            raise DrcError(f"unknown notebook(s) {unknown}: choose from {', '.join(names)}")
        names = [n for n in names if n in only]
    for name in [n for n in names if n in prof.skip]:
        print(f"[{profile}] {name}: skipped ({prof.skip[name]})", flush=True)
    names = [n for n in names if n not in prof.skip]
    notebooks = {name: jupytext.read(spec.source_dir / f"{name}.py") for name in names}
    declared = {name: declared_parameters(nb) for name, nb in notebooks.items()}
    for name in names:  # check every parameter against the notebooks before running any of them
        if own := set(prof.notebooks.get(name, {})) - declared[name]:
            raise DrcError(f"profile '{profile}' sets {sorted(own)} for notebook {name}, whose parameters cell "
                           f"does not assign them: declare them there or fix the profiles file")
    if stray := set(overrides) - set().union(*declared.values()):
        raise DrcError(f"--set {sorted(stray)}: no notebook run here declares it; see their parameters cells")
    # every directory any notebook of the profile may write (with these --set values): the only ones a rollback
    # record left by a killed run may name
    allowed = {d for nb in spec.notebooks for d, _ in output_dirs(
        {k: under_out(v, out) for k, v in {**prof.parameters_for(nb), **overrides}.items()
         if k in OUTPUT_PARAMETERS}, cwd, nb)}
    dest = Path(out) / profile
    with exclusive(dest, "book profile"):  # one runner per profile: they would share .running/ and the results
        return _run(notebooks, declared, prof, out, overrides, cwd, progress, kernel, sorted(allowed))


def _run(notebooks: dict, declared: dict[str, set[str]], prof: Profile, out: str | Path, overrides: dict[str, Any],
         cwd: str | Path, progress: bool, kernel: str, allowed: list[Path]) -> dict[str, float]:
    """:func:`run_book`'s execution of ``notebooks`` (in order), under the profile's lock."""
    import jupytext
    import nbformat
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    profile, dest = prof.name, Path(out) / prof.name
    dest.mkdir(parents=True, exist_ok=True)
    failed_dir, work = dest / "failed", dest / ".running"
    # the runner's own directories: written, emptied and removed, so never through a link planted there
    refuse_links([work, work / "rollback", failed_dir], f"book profile directory '{dest}'")
    # RUN_ENV tells the notebooks that the runner executes them: only then do results go to the committed
    # results_dir (drc_book.paths.results_for); interactive runs write under runs/lab/
    env = {"PLOTLY_RENDERER": prof.plotly_renderer, **prof.env, RUN_ENV: profile}
    timings_path = dest / "timings.json"
    timings = read_timings(timings_path)
    with ExitStack() as locks:  # before anything else, under the output directories' locks; a doubtful record: one line
        if (work / "rollback" / Rollback.MANIFEST).exists():
            for d in {d.resolve() for d in allowed} - {dest.resolve()}:
                locks.enter_context(exclusive(d, "notebook output directory"))
        killed = Rollback.recover(work / "rollback", allowed)
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the environment of this process
    if killed:
        print(f"[{profile}] the previous run was killed during notebook {killed}: what it had written was undone",
              flush=True)
    in_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, raise_terminated) if in_main else None
    try:
        for name, nb in notebooks.items():
            nb.metadata["kernelspec"] = {"name": kernel, "display_name": "Python 3", "language": "python"}
            work.mkdir(exist_ok=True)
            src, partial = work / f"{name}.src.ipynb", work / f"{name}.ipynb"
            kernel_log = work / f"{name}.kernel.log"
            jupytext.write(nb, src)
            params = {k: under_out(v, out) for k, v in {**prof.parameters_for(name), **overrides}.items()
                      if k in declared[name]}
            dirs = output_dirs(params, cwd, name)
            with ExitStack() as locks:
                for d, _ in dirs:  # another runner writing the same results directory (another profile): refused
                    if d.resolve() != dest.resolve():
                        locks.enter_context(exclusive(d.resolve(), "notebook output directory"))
                rollback = Rollback.take(dirs, work / "rollback", name)
                print(f"[{profile}] {name}: {', '.join(f'{k}={v!r}' for k, v in params.items()) or 'no parameters'}",
                      flush=True)
                t0 = time.perf_counter()
                try:
                    pm.execute_notebook(str(src), str(partial), parameters=params, kernel_name=kernel,
                                        cwd=str(cwd), progress_bar=progress, log_output=False,
                                        kernel_manager_class=_kernel_log_manager(kernel_log))
                except (KeyboardInterrupt, PapermillExecutionError) as exc:
                    rollback.undo()
                    rollback.close()
                    # (a PapermillExecutionError of a KeyboardInterrupt: the kernel got the Ctrl-C first)
                    if isinstance(exc, KeyboardInterrupt) or getattr(exc, "ename", "") == "KeyboardInterrupt":
                        how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"
                        raise Interrupted(f"{how} during notebook {name}: what it wrote was undone and the notebooks "
                                          "before it are kept; rerun the command (with --only to continue)") from None
                    failed_dir.mkdir(exist_ok=True)
                    kept = failed_dir / f"{name}.ipynb"
                    shutil.move(str(partial), kept)
                    if kernel_log.is_file() and kernel_log.stat().st_size:
                        shutil.move(str(kernel_log), failed_dir / kernel_log.name)
                    raise NotebookFailed(f"{_failure_line(name, exc)}; partial output kept at {kept} (its results "
                                         "and frames were undone)") from None
            rollback.close()
            seconds = time.perf_counter() - t0
            executed = nbformat.read(partial, as_version=4)
            if present(executed):
                nbformat.write(executed, partial)
            os.replace(partial, dest / f"{name}.ipynb")
            src.unlink()
            (failed_dir / f"{name}.ipynb").unlink(missing_ok=True)
            timings[name] = {"seconds": round(seconds, 1), **machine_kind()}  # each notebook with its machine's kind
            write_file(timings_path, json.dumps(timings, indent=2) + "\n")
            print(f"[{profile}] {name}: done in {seconds:.1f} s -> {dest / (name + '.ipynb')}; slowest cells: "
                  + "; ".join(f"#{i} {sec:.0f} s ({line})" for i, sec, line in slowest_cells(executed)), flush=True)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if (work / "rollback" / Rollback.MANIFEST).is_file():  # an undo cut short (SIGTERM): the next run redoes it
            for f in work.iterdir():
                if f.is_dir() and f.name != "rollback":
                    shutil.rmtree(f)
                elif f.is_file():
                    f.unlink()
        else:
            shutil.rmtree(work, ignore_errors=True)
        if failed_dir.is_dir() and not any(failed_dir.iterdir()):
            failed_dir.rmdir()
    return {n: timings[n]["seconds"] for n in notebooks}


def read_timings(path: Path) -> dict[str, dict[str, Any]]:
    """``timings.json`` of a profile: notebook -> ``{"seconds", "cpu", "bf16", "cores"}`` (the kind of machine that
    ran it, :func:`~drc_core.model.precision.machine_kind`); a bare number of seconds (files written before the kind
    was recorded) reads as seconds of an unknown machine. {} when there is no file."""
    if not path.exists() and not path.is_symlink():
        return {}
    fix = f"delete {path} (it only records how long each notebook took) and rerun"
    try:
        data = read_json(path, "the timings file", fix)
    except FileNotFoundError:  # a symbolic link to nothing
        raise DrcError(f"the timings file '{path}' is a link to a missing file: {fix}") from None

    def seconds(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    if isinstance(data, dict):
        data = {k: {"seconds": v, "cpu": "unknown", "bf16": "unknown", "cores": None} if seconds(v) else v
                for k, v in data.items()}
    if not (isinstance(data, dict) and all(isinstance(e, dict) and seconds(e.get("seconds"))
                                           and all(isinstance(e.get(k), str) for k in ("cpu", "bf16"))
                                           for e in data.values())):
        raise DrcError(f"the timings file '{path}' is damaged (not an object of seconds): {fix}")
    return data


def slowest_cells(nb: Any, top: int = 3) -> list[tuple[int, float, str]]:
    """``(cell index, seconds, first source line)`` of the ``top`` slowest code cells of an executed notebook."""
    cells = [(i, float(c.metadata.get("papermill", {}).get("duration") or 0.0), c.source.strip().split("\n")[0][:60])
             for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    return sorted(cells, key=lambda c: -c[1])[:top]


def toc_for(spec: BookSpec, profile: str, out: str | Path = DEFAULT_OUT, root_dir: str | Path = ".") -> str:
    """The Jupyter Book ``_toc.yml`` of ``profile``'s executed notebooks, paths relative to ``root_dir``."""
    root_dir = Path(root_dir).resolve()
    root = (spec.source_dir / spec.root).resolve().relative_to(root_dir).as_posix() if spec.root else None
    skipped = spec.profile(profile).skip if profile in spec.profiles else {}
    chapters = [(Path(out) / profile / name).resolve().relative_to(root_dir).as_posix() for name in spec.notebooks
                if name not in skipped]
    if root is None:
        root, chapters = chapters[0], chapters[1:]
    lines = ["# Generated by drc_book from the profiles file: the executed notebooks of one profile.",
             "format: jb-book", f"root: {root}", "chapters:"]
    lines += [f"  - file: {c}" for c in chapters]
    return "\n".join(lines) + "\n"


def _copy_static(spec: BookSpec, root_dir: Path) -> None:
    """plotly's ``plotly.min.js`` and the book's stylesheet into ``_static/``, where ``_config.yml`` loads them."""
    import plotly

    css = spec.source_dir / BOOK_CSS
    if not css.is_file():
        raise DrcError(f"{css} not found: the book's stylesheet belongs beside the notebook sources")
    js, dst = Path(plotly.__file__).parent / "package_data" / "plotly.min.js", root_dir / PLOTLY_STATIC
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.is_file() or dst.stat().st_size != js.stat().st_size:
        shutil.copy2(js, dst)
    shutil.copyfile(css, root_dir / "_static" / BOOK_CSS)


def _md_cell(value: object) -> str:
    return " ".join(str("" if value is None else value).split()).replace("|", "\\|")


def reproduction_markdown(results_dir: str | Path) -> str:
    """``results_dir/07_reproduction.json``'s table in Markdown, or a sentence naming the notebook to run."""
    path = Path(results_dir) / "07_reproduction.json"
    if not path.is_file():
        return f"*No reproduction table yet: {path} is written by notebook 07_reproduction of this profile.*\n"
    data = read_json(path, "the results file", "rerun notebook 07_reproduction of this profile")
    rows = data.get("table") if isinstance(data, dict) else 0
    if rows is not None and not (isinstance(rows, list) and all(isinstance(r, dict) for r in rows)):
        raise DrcError(f"the results file '{path}' is damaged (its table is not a list of rows): rerun notebook "
                       "07_reproduction of this profile")
    if not rows:
        return f"*{path} holds no reproduction table.*\n"
    columns = [("claim", "claim"), ("paper", "paper"), ("ours", "ours [95% CI]"),
               ("across seeds (small preset)", "across seeds (small preset)"), ("verdict", "verdict")]
    columns = [(k, label) for k, label in columns if any(k in r for r in rows)]
    lines = ["| " + " | ".join(label for _, label in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_md_cell(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _write_landing(spec: BookSpec, profile: str, root_dir: Path, out: str | Path) -> None:
    """_static/reproduction.md: the profile's reproduction table, included by the root page."""
    results_dir = root_dir / under_out(spec.profile(profile).parameters_for("07_reproduction").get(
        "results_dir", f"{DEFAULT_OUT.as_posix()}/{profile}/results"), out)  # an absolute one stays as it is
    dst = root_dir / REPRODUCTION_MD
    dst.parent.mkdir(parents=True, exist_ok=True)
    shown = results_dir.relative_to(root_dir) if results_dir.is_relative_to(root_dir) else results_dir
    dst.write_text(f"<!-- written by `python -m drc_book build --profile {profile}` -->\n\n"
                   + reproduction_markdown(results_dir)
                   + f"\n*The `{profile}` profile's table, from `{shown.as_posix()}/07_reproduction.json`.*\n")


def _present_executed(spec: BookSpec, profile: str, out: str | Path) -> None:
    """:func:`present` on executed notebooks made before the runner did it."""
    import nbformat

    for name in spec.notebooks:
        path = Path(out) / profile / f"{name}.ipynb"
        try:
            nb = nbformat.reads(read_regular(path, "an executed notebook", 1 << 30).decode("utf-8"), as_version=4)
            changed = present(nb)
        except DrcError:
            raise
        except Exception as exc:  # nbformat's and json's errors, a notebook of the wrong shape
            raise DrcError(f"the executed notebook '{path}' is damaged ({first_line(exc, 120)}): run it again, "
                           f"`python -m drc_book run --profile {profile} --only {name}`") from None
        if changed:
            text = nbformat.writes(nb)
            write_file(path, text if text.endswith("\n") else text + "\n")  # as nbformat.write writes it
            print(f"presented {path} for readers (injected parameters merged and hidden)", flush=True)


def build_book(spec: BookSpec, profile: str, out: str | Path = DEFAULT_OUT, root_dir: str | Path = ".",
               config: str | Path | None = None, toc: str | Path | None = None) -> Path:
    """Render ``profile``'s executed notebooks with Jupyter Book v1 (``toc``, else a generated one); returns the
    ``index.html`` path."""
    root_dir = Path(root_dir).resolve()
    if missing := [n for n in spec.notebooks if not (Path(out) / profile / f"{n}.ipynb").is_file()]:
        raise DrcError(f"no executed notebook(s) {missing} in {Path(out) / profile}: run "
                       f"`python -m drc_book run --profile {profile}` first")
    build_root = root_dir / "_build" if profile == "reference" else root_dir / "_build" / profile
    build_root.mkdir(parents=True, exist_ok=True)
    if toc is None:
        toc = build_root / "_toc.yml"
        Path(toc).write_text(toc_for(spec, profile, out, root_dir))
    _present_executed(spec, profile, out)
    _copy_static(spec, root_dir)
    _write_landing(spec, profile, root_dir, out)
    exe = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(exe) if exe.is_file() else "jupyter-book", "build", str(root_dir), "--toc", str(toc),
           "--config", str(config or root_dir / "_config.yml"), "--all", "-q"]
    if profile != "reference":
        cmd += ["--path-output", str(build_root)]
    print(" ".join(cmd), flush=True)
    res = subprocess.run(cmd, cwd=root_dir)
    index = (root_dir if profile == "reference" else build_root) / "_build" / "html" / "index.html"
    if res.returncode != 0 or not index.is_file():
        raise DrcError(f"jupyter-book build failed (exit {res.returncode}): see its output above")
    return index


def find_browser() -> str | None:
    """Path of a headless-capable Chromium on PATH (Debian ``chromium``), or None."""
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def render_png(figure_json: str | Path, png: str | Path, width: int = 900, height: int = 500) -> Path:
    """Draw a plotly figure saved as JSON (``fig.write_json``) to a PNG with headless Chromium."""
    import plotly.io as pio

    out = Path(png)
    if out.is_dir() or (out.exists() and out.read_bytes()[:8] != PNG_SIGNATURE):  # replace only a PNG image
        raise DrcError(f"'{out}' exists and is not a PNG image: it is left as it is; choose a new file name")
    browser = find_browser()
    if browser is None:
        raise DrcError("no Chromium on PATH: install it (apt-get install chromium) to render PNG figures")
    if not Path(figure_json).is_file():
        raise DrcError(f"{figure_json} not found: run the notebook that saves it first")
    fig = pio.read_json(figure_json)
    fig.update_layout(width=width, height=height)
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "figure.html"
        fig.write_html(html, include_plotlyjs=True, full_html=True, config={"staticPlot": True})
        res = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                              f"--window-size={width},{height}", "--virtual-time-budget=10000",
                              f"--screenshot={png}", html.as_uri()], capture_output=True, text=True, timeout=120)
    if res.returncode != 0 or not png.is_file():
        raise DrcError(f"Chromium could not render {figure_json} (exit {res.returncode}): {res.stderr[-300:]}")
    return png


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m drc_book", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", default=str(DEFAULT_PROFILES), help="profiles file (default: book/profiles.toml)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="executed notebooks go to OUT/<profile>/")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute the notebooks with papermill")
    r.add_argument("--profile", required=True)
    r.add_argument("--only", nargs="+", metavar="NOTEBOOK", help="run only these notebooks (names without .py)")
    r.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a parameter for every notebook that declares it; VALUE is JSON or a string")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    b = sub.add_parser("build", help="render the executed notebooks to HTML (Jupyter Book v1)")
    b.add_argument("--profile", required=True)
    b.add_argument("--toc", help="table of contents (default: _toc.yml for reference, generated otherwise)")
    f = sub.add_parser("figure", help="draw a figure a notebook saved as JSON to a PNG (headless Chromium)")
    f.add_argument("figure_json")
    f.add_argument("png")
    f.add_argument("--width", type=int, default=900)
    f.add_argument("--height", type=int, default=500)
    sub.add_parser("list", help="list the profiles and notebooks")
    return ap


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DrcError(f"--set {pair!r} is not KEY=VALUE: e.g. --set n_windows=8")
        try:
            pair.encode("utf-8")
        except UnicodeEncodeError:
            raise DrcError(f"--set {key!r}: the value is not valid UTF-8 text: pass it in UTF-8") from None
        try:
            out[key] = parse_json(value.encode("utf-8", "surrogatepass"))
        except ValueError:  # not JSON (nor UTF-8): a string
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "figure":
        print(f"wrote {render_png(args.figure_json, args.png, args.width, args.height)}")
        return 0
    spec = load_profiles(args.profiles)
    if args.cmd == "list":
        for p in spec.profiles.values():
            print(f"{p.name}: {p.description}")
        print("notebooks:", ", ".join(spec.notebooks))
        return 0
    if args.cmd == "run":
        try:
            timings = run_book(spec, args.profile, args.out, only=args.only, overrides=_parse_sets(args.sets),
                               progress=not args.quiet)
        except NotebookFailed as exc:  # exit 1; bad input (DrcError) exits 2 through run_cli
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"[{args.profile}] {len(timings)} notebook(s) in {sum(timings.values()):.0f} s: " +
              ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
        return 0
    toc = args.toc or ("_toc.yml" if args.profile == "reference" else None)
    index = build_book(spec, args.profile, args.out, toc=toc)
    print(f"built {index}")
    return 0

