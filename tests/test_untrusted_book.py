"""The book runner with untrusted files (docs/bad-input.md, "Untrusted files"): a planted rollback record is
followed only inside the profile's own outputs and with the copies it recorded, outputs stay under --out whatever a
parameter or a profile name says, two profiles sharing a results directory never undo each other's results, and
damaged book files (timings, results, executed notebooks) are one line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import replace_path

from drc_book.rollback import Rollback
from drc_book.runner import load_profiles, output_dirs, read_timings, reproduction_markdown, run_book, under_out
from drc_book.workspace import load_results, save_results
from drc_core.errors import DrcError
from drc_core.guard import exclusive

REPO = Path(__file__).resolve().parents[1]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): sha(p) for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture()
def outputs(tmp_path) -> tuple[Path, Path, Path]:
    """A results directory and a work directory with files, and the backup place of a rollback."""
    results, work = tmp_path / "results", tmp_path / "work"
    (results / "figs").mkdir(parents=True)
    (results / "01.json").write_text('{"a": 1}')
    (results / "figs" / "f.json").write_text("{}")
    work.mkdir()
    (work / "frame.parquet").write_text("frame")
    return results, work, tmp_path / "backup"


# ------------------------------------------------------------------------------------------- rollback records


def test_a_taken_rollback_recovers_when_its_directories_are_allowed(outputs):
    results, work, backup = outputs
    before = {**tree(results), **tree(work)}
    Rollback.take([(results, True), (work, False)], backup, "04_x")
    (results / "01.json").write_text("changed")
    (results / "new.json").write_text("added")
    (work / "frame.parquet").unlink()
    assert Rollback.recover(backup, [results, work]) == "04_x"
    assert {**tree(results), **tree(work)} == before and not backup.exists()


def test_a_record_naming_another_directory_is_refused_and_nothing_is_touched(outputs, tmp_path):
    results, work, backup = outputs
    victim = tmp_path / "home"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    Rollback.take([(victim, True)], backup, "04_x")  # a record a killed run could not have written for this profile
    (victim / "thesis.tex").write_text("years of work, revised")
    with pytest.raises(DrcError, match=r"names .*home, which is not an output directory .* nothing was undone"):
        Rollback.recover(backup, [results, work])
    assert (victim / "thesis.tex").read_text() == "years of work, revised"
    assert (backup / Rollback.MANIFEST).is_file()  # kept for the user to look at


@pytest.mark.parametrize("damage", ["dotdot", "absolute", "hash", "copy-link", "not-json", "a-list", "nested"])
def test_a_damaged_or_crafted_record_is_refused(outputs, tmp_path, damage):
    results, work, backup = outputs
    Rollback.take([(results, True), (work, False)], backup, "04_x")
    manifest = backup / Rollback.MANIFEST
    record = json.loads(manifest.read_text())
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    if damage == "dotdot":
        record["kept"].append([0, "../outside.txt", record["kept"][0][2]])
    elif damage == "absolute":
        record["kept"].append([0, str(outside), record["kept"][0][2]])
    elif damage == "hash":
        (backup / "0" / "01.json").write_text("tampered")
    elif damage == "copy-link":
        (backup / "0" / "01.json").unlink()
        (backup / "0" / "01.json").symlink_to(outside)
    if damage in ("not-json", "a-list", "nested"):
        manifest.write_text({"not-json": "{", "a-list": "[]", "nested": "[" * 100000 + "]" * 100000}[damage])
    else:
        manifest.write_text(json.dumps(record))
    (results / "01.json").write_text("changed by the notebook")
    before = {**tree(results), **tree(work), "outside": sha(outside)}
    with pytest.raises(DrcError, match="nothing was undone"):
        Rollback.recover(backup, [results, work])
    assert {**tree(results), **tree(work), "outside": sha(outside)} == before


def test_a_record_of_the_earlier_format_still_recovers(outputs):
    results, work, backup = outputs
    before = tree(results)
    Rollback.take([(results, True)], backup, "04_x")
    kept = {str(results / "01.json"): str(backup / "0" / "01.json"),
            str(results / "figs" / "f.json"): str(backup / "0" / "figs" / "f.json")}
    (backup / Rollback.MANIFEST).write_text(json.dumps({"notebook": "04_x", "dirs": [[str(results), True]],
                                                        "kept": kept}))
    (results / "01.json").write_text("changed")
    assert Rollback.recover(backup, [results]) == "04_x"
    assert tree(results) == before


def test_undo_leaves_links_and_lock_files_alone(outputs, tmp_path):
    results, work, backup = outputs
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    rb = Rollback.take([(results, True), (work, False)], backup, "x")
    (work / "link.txt").symlink_to(victim)
    (work / ".train.lock").write_text("123")
    rb.undo()
    assert victim.read_text() == "keep" and (work / "link.txt").is_symlink() and (work / ".train.lock").exists()


# ------------------------------------------------------------------------------------- outputs stay under --out


def test_profile_and_notebook_names_are_plain(tmp_path):
    book = tmp_path / "book"
    book.mkdir()
    (book / "a.py").write_text("# %%\n")
    profiles = book / "profiles.toml"
    profiles.write_text('[book]\nnotebooks = ["a"]\n[profiles."../../escape"]\ndescription = "x"\n')
    with pytest.raises(DrcError, match=r"profile name '../../escape' is not a plain name"):
        load_profiles(profiles)
    profiles.write_text('[book]\nnotebooks = ["../a"]\n[profiles.p]\ndescription = "x"\n')
    with pytest.raises(DrcError, match=r"notebook name '../a' is not a plain name"):
        load_profiles(profiles)
    profiles.write_text('[book]\nnotebooks = ["a"]\nprofiles = 3\n[profiles]\np = 5\n')
    with pytest.raises(DrcError):
        load_profiles(profiles)


@pytest.mark.parametrize("value", ["papermill_runs/../../x", "../x", "a/../../b"])
def test_output_parameters_never_climb_out(tmp_path, value):
    with pytest.raises(DrcError, match="climbs out"):
        output_dirs({"results_dir": under_out(value, tmp_path / "out")}, tmp_path, "01")
    assert output_dirs({"results_dir": "papermill_runs/p/results", "work_dir": "runs/w"}, tmp_path, "01") == [
        (tmp_path / "papermill_runs/p/results", True), (tmp_path / "runs/w", False)]


# ----------------------------------------------------------------------------------------- the runner itself


@pytest.fixture()
def book_site(tmp_path) -> Path:
    """A repository-shaped directory with the fixture notebooks; two profiles share one results directory."""
    shutil.copytree(REPO / "tests" / "book_fixtures", tmp_path / "book")
    shutil.copy(REPO / "_config.yml", tmp_path / "_config.yml")
    (tmp_path / "book" / "profiles.toml").write_text(
        '[book]\nroot = "00_overview"\nnotebooks = ["01_pass", "04_write_then_fail"]\n\n'
        '[profiles.p]\ndescription = "fixture"\n[profiles.p.parameters]\nresults_dir = "shared/results"\n'
        'work_dir = "work"\n\n'
        '[profiles.q]\ndescription = "fixture"\n[profiles.q.parameters]\nresults_dir = "shared/results"\n'
        'work_dir = "work-q"\n')
    return tmp_path


def _book(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DRC_BOOK_ROOT": str(site)}
    env.pop("DRC_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "drc_book", *args], cwd=site, env=env, capture_output=True,
                          text=True, timeout=300)


def _one_line(proc: subprocess.CompletedProcess, code: int, *words: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_book_run_refuses_a_planted_rollback_record(book_site, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    backup = book_site / "papermill_runs" / "p" / ".running" / "rollback"
    Rollback.take([(victim, True)], backup, "01_pass")
    (victim / "notes.txt").write_text("mine, edited since")
    (victim / "more.txt").write_text("new")
    before = tree(victim)
    proc = _book(book_site, "run", "--profile", "p", "--only", "01_pass", "--quiet")
    _one_line(proc, 2, "rollback record", "not an output directory", "nothing was undone")
    assert tree(victim) == before
    assert not (book_site / "shared").exists()  # nothing ran


def test_the_runners_own_directories_are_never_links(book_site, tmp_path):
    victim = tmp_path / "victim"
    (victim / "rollback").mkdir(parents=True)
    (victim / "keep.txt").write_text("mine")
    (book_site / "papermill_runs" / "p").mkdir(parents=True)
    (book_site / "papermill_runs" / "p" / ".running").symlink_to(victim)
    before = tree(victim)
    proc = _book(book_site, "run", "--profile", "p", "--only", "01_pass", "--quiet")
    _one_line(proc, 2, ".running is a symbolic link")
    assert tree(victim) == before and (victim / "rollback").is_dir()


def test_a_second_profile_writing_the_shared_results_is_refused_not_undone(book_site):
    """Profile q's notebook would undo files profile p writes to the same results directory: it waits its turn."""
    import jupytext  # noqa: F401  (the runner's dependency: skip cleanly where the book extras are missing)

    results = book_site / "shared" / "results"
    results.mkdir(parents=True)
    (results / "p.json").write_text("written by profile p's running notebook")
    spec = load_profiles(book_site / "book" / "profiles.toml")
    cwd = os.getcwd()
    os.chdir(book_site)
    try:
        with exclusive(results.resolve(), "notebook output directory"), pytest.raises(
                DrcError, match="notebook output directory .* is being written by another process"):
            run_book(spec, "q", book_site / "papermill_runs", only=["04_write_then_fail"], cwd=book_site,
                     progress=False)
    finally:
        os.chdir(cwd)
    assert (results / "p.json").read_text() == "written by profile p's running notebook"


# ---------------------------------------------------------------------------------------- damaged book files


def test_timings_carry_the_machine_kind_and_old_files_still_read(tmp_path):
    path = tmp_path / "timings.json"
    path.write_text('{"01": 12.5, "02": {"seconds": 3, "cpu": "AMD EPYC", "bf16": "none", "cores": 2}}')
    read = read_timings(path)
    assert read["01"] == {"seconds": 12.5, "cpu": "unknown", "bf16": "unknown", "cores": None}
    assert read["02"]["cpu"] == "AMD EPYC" and read["02"]["seconds"] == 3
    for bad in ('{"01": {"seconds": -1, "cpu": "x", "bf16": "y"}}', '{"01": {"cpu": "x", "bf16": "y"}}',
                '{"01": {"seconds": 1, "cpu": 3, "bf16": "y"}}'):
        path.write_text(bad)
        with pytest.raises(DrcError, match="timings file .* damaged"):
            read_timings(path)


@pytest.mark.parametrize("content", ["{", "[1]", '{"01": "slow"}', "[" * 100000])
def test_damaged_book_files_are_one_line(tmp_path, content):
    (tmp_path / "timings.json").write_text(content)
    with pytest.raises(DrcError, match="timings file .* damaged"):
        read_timings(tmp_path / "timings.json")
    (tmp_path / "07_reproduction.json").write_text(content if content != '{"01": "slow"}' else '{"table": 3}')
    with pytest.raises(DrcError, match="results file .* damaged"):
        reproduction_markdown(tmp_path)
    (tmp_path / "02_x.json").write_text(content if content != '{"01": "slow"}' else "[]")
    with pytest.raises(DrcError, match="results file .* damaged"):
        load_results(tmp_path, "02_x")


def test_results_are_replaced_never_written_through_a_link(tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "01_x.json").symlink_to(victim)
    save_results(tmp_path / "r", "01_x", {"a": 1})
    assert victim.read_text() == "keep" and not (tmp_path / "r" / "01_x.json").is_symlink()


def test_a_damaged_executed_notebook_is_one_line_in_build(book_site):
    out = book_site / "papermill_runs" / "p"
    out.mkdir(parents=True)
    (out / "01_pass.ipynb").write_text('{"cells": 3}')
    (out / "04_write_then_fail.ipynb").write_text("not json")
    from drc_book.runner import _present_executed

    spec = load_profiles(book_site / "book" / "profiles.toml")
    with pytest.raises(DrcError, match=r"executed notebook .*01_pass.ipynb' is damaged .* --only 01_pass"):
        _present_executed(spec, "p", book_site / "papermill_runs")


# ------------------------------------------------------------------- every book record, damaged every way
# One parametrized case per row (docs/bad-input.md lists them by class): the one DrcError line, and nothing changed.


def _entry(record: dict, *entry) -> None:
    record["kept"].append(list(entry))


RECORD_DAMAGE = {  # what is done to a rollback record (record dict, manifest, backup) -> words of the line
    "kept-an-int": (lambda r, m, b: r.update(kept=5), "keeps no list of [directory, path, sha256] entries"),
    "kept-a-string": (lambda r, m, b: r.update(kept="abc"), "keeps no list of"),
    "kept-an-object": (lambda r, m, b: r.update(kept={"a": "b"}), "keeps no list of"),
    "dirs-missing": (lambda r, m, b: r.pop("dirs"), "is not a rollback record"),
    "dirs-an-object": (lambda r, m, b: r.update(dirs={"a": 1}), "is not a rollback record"),
    "dir-with-a-nul": (lambda r, m, b: r["dirs"].append(["/tmp/a\x00b", True]), "not [path, recursive]"),
    "dir-empty": (lambda r, m, b: r["dirs"].append(["", True]), "not [path, recursive]"),
    "dir-recursive-an-int": (lambda r, m, b: r["dirs"][0].__setitem__(1, 1), "not [path, recursive]"),
    "index-a-bool": (lambda r, m, b: _entry(r, True, "01.json", r["kept"][0][2]), "not [directory, path, sha256]"),
    "index-negative": (lambda r, m, b: _entry(r, -1, "01.json", r["kept"][0][2]), "not a path inside"),
    "index-huge": (lambda r, m, b: _entry(r, 10**30, "01.json", r["kept"][0][2]), "not a path inside"),
    "index-a-float": (lambda r, m, b: _entry(r, 0.0, "01.json", r["kept"][0][2]), "not [directory, path, sha256]"),
    "path-with-a-nul": (lambda r, m, b: _entry(r, 0, "a\x00b", r["kept"][0][2]), "not [directory, path, sha256]"),
    "path-empty": (lambda r, m, b: _entry(r, 0, "", r["kept"][0][2]), "not a path inside"),
    "path-dot": (lambda r, m, b: _entry(r, 0, ".", r["kept"][0][2]), "whose copy is missing or not a file"),
    "path-below-a-flat-dir": (lambda r, m, b: _entry(r, 1, "sub/x", r["kept"][0][2]), "only its own files"),
    "hash-an-int": (lambda r, m, b: r["kept"][0].__setitem__(2, 5), "not [directory, path, sha256]"),
    "entry-too-short": (lambda r, m, b: _entry(r, 0, "01.json"), "not [directory, path, sha256]"),
    "format-3": (lambda r, m, b: r.update(format=3), "not a rollback record this version writes"),
    "format-a-string": (lambda r, m, b: r.update(format="2"), "not a rollback record this version writes"),
    "format-missing": (lambda r, m, b: r.pop("format"), "not a rollback record this version writes"),
    "old-format-keeps-outside": (lambda r, m, b: (r.pop("format"), r.update(kept={"/etc/passwd": str(
        b / "0" / "passwd")})), "lies in none of its directories"),
    "old-format-copy-an-int": (lambda r, m, b: (r.pop("format"), r.update(kept={"x": 5})),
                               "lies in none of its directories"),
    "manifest-empty": (lambda r, m, b: replace_path(m, b""), "is damaged (not JSON"),
    "manifest-not-utf8": (lambda r, m, b: replace_path(m, b"\xff\xfe"), "not UTF-8"),
    "manifest-null": (lambda r, m, b: replace_path(m, b"null"), "is not a rollback record"),
    "manifest-nan": (lambda r, m, b: replace_path(m, b"NaN"), "is not a rollback record"),
    "manifest-directory": (lambda r, m, b: replace_path(m, "DIR"), "is a directory, not a regular file"),
    "manifest-fifo": (lambda r, m, b: replace_path(m, "FIFO"), "is a FIFO, not a regular file"),
    "manifest-dev-zero": (lambda r, m, b: replace_path(m, "DEVZERO"), "is a symbolic link"),
    "manifest-huge": (lambda r, m, b: replace_path(m, "HUGE"), "larger than the 64 MB"),
    "copy-a-directory": (lambda r, m, b: replace_path(b / "0" / "01.json", "DIR"),
                         "whose copy is missing or not a file"),
    "copy-a-fifo": (lambda r, m, b: replace_path(b / "0" / "01.json", "FIFO"), "whose copy is missing or not a file"),
    "copy-missing": (lambda r, m, b: (b / "0" / "01.json").unlink(), "whose copy is missing or not a file"),
    "copies-dir-a-link": (lambda r, m, b: (shutil.move(str(b / "0"), str(b.parent / "elsewhere")), (b / "0").symlink_to(
        b.parent / "elsewhere")), "whose copy is missing or not a file"),
}
_RAW = ("manifest-",)  # rows that replace the manifest itself (the record is not written back)


@pytest.mark.parametrize("case", RECORD_DAMAGE)
def test_every_damage_to_a_rollback_record_is_refused(outputs, tmp_path, case):
    results, work, backup = outputs
    Rollback.take([(results, True), (work, False)], backup, "04_x")
    manifest = backup / Rollback.MANIFEST
    record = json.loads(manifest.read_text())
    damage, words = RECORD_DAMAGE[case]
    damage(record, manifest, backup)
    if not case.startswith(_RAW):
        manifest.write_text(json.dumps(record))
    (results / "01.json").write_text("changed by the notebook")
    (work / "added.parquet").write_text("added by the notebook")
    before = {**tree(results), **tree(work)}
    with pytest.raises(DrcError) as info:
        Rollback.recover(backup, [results, work])
    line = str(info.value)
    assert "\n" not in line and words in line, line
    assert {**tree(results), **tree(work)} == before  # nothing undone, nothing removed
    assert manifest.exists() or manifest.is_symlink()  # kept for the user to look at


TIMINGS_DAMAGE = {
    "nan": (b'{"01": NaN}', "not an object of seconds"), "negative": (b'{"01": -5}', "not an object of seconds"),
    "infinity": (b'{"01": Infinity}', "not an object of seconds"), "overflow": (b'{"01": 1e400}', "not an object of"),
    "a-bool": (b'{"01": true}', "not an object of seconds"), "null-value": (b'{"01": null}', "not an object of"),
    "a-list-value": (b'{"01": [1]}', "not an object of seconds"), "a-string": (b'"x"', "not an object of seconds"),
    "null": (b"null", "not an object of seconds"), "empty": (b"", "is damaged (not JSON"),
    "not-utf8": (b"\xff", "not UTF-8"), "directory": ("DIR", "is a directory, not a regular file"),
    "fifo": ("FIFO", "is a FIFO, not a regular file"), "dev-zero": ("DEVZERO", "is a device, not a regular file"),
    "dangling-link": ("DANGLING", "is a link to a missing file"), "huge": ("HUGE", "larger than the 64 MB"),
}


@pytest.mark.parametrize("case", TIMINGS_DAMAGE)
def test_every_damage_to_the_timings_file_is_one_line(tmp_path, case):
    content, words = TIMINGS_DAMAGE[case]
    replace_path(tmp_path / "timings.json", content)
    with pytest.raises(DrcError) as info:
        read_timings(tmp_path / "timings.json")
    line = str(info.value)
    assert "\n" not in line and words in line, line


_G = '[book]\nnotebooks = ["a"]\n'
PROFILES_DAMAGE = {  # the content of a profiles file -> words of the line
    "not-utf8": (b"\xff\xfe", "is not valid TOML"), "not-toml": ("[book\n", "is not valid TOML"),
    "nested-too-deep": (_G + "x = " + "[" * 5000 + "]" * 5000 + "\n", "is not valid TOML"),
    "empty": ("", "[book] notebooks is empty"), "no-profile": (_G, "no [profiles.<name>] table"),
    "book-an-int": ("book = 5\n[profiles.p]\n", "[book] is a int, not a table"),
    "notebooks-a-string": ('[book]\nnotebooks = "a"\n[profiles.p]\n', "notebooks is not a list"),
    "notebooks-empty": ("[book]\nnotebooks = []\n[profiles.p]\n", "notebooks is empty"),
    "notebook-an-int": ("[book]\nnotebooks = [5]\n[profiles.p]\n", "notebook name 5 is not a plain name"),
    "notebook-twice": ('[book]\nnotebooks = ["a", "a"]\n[profiles.p]\n', "lists a notebook twice"),
    "notebook-without-source": ('[book]\nnotebooks = ["nope"]\n[profiles.p]\n', "has no source"),
    "source-dir-an-int": (_G + "source_dir = 5\n[profiles.p]\n", "source_dir and root must be strings"),
    "source-dir-elsewhere": (_G + 'source_dir = "../../.."\n[profiles.p]\n', "has no source"),
    "root-a-list": (_G + 'root = ["x"]\n[profiles.p]\n', "source_dir and root must be strings"),
    "book-unknown-key": (_G + "evil = 1\n[profiles.p]\n", "unknown key(s) ['evil'] in [book]"),
    "profiles-a-list": ('profiles = []\n[book]\nnotebooks = ["a"]\n', "[profiles] is a list, not a table"),
    "profile-unknown-key": (_G + "[profiles.p]\nevil = 1\n", "profile 'p' has unknown key(s) ['evil']"),
    "profile-name-a-path": (_G + '[profiles."a/b"]\n', "profile name 'a/b' is not a plain name"),
    "profile-name-dotdot": (_G + '[profiles.".."]\n', "profile name '..' is not a plain name"),
    "description-an-int": (_G + "[profiles.p]\ndescription = 5\n", "description and plotly_renderer must be strings"),
    "renderer-an-int": (_G + "[profiles.p]\nplotly_renderer = 5\n", "must be strings"),
    "env-value-a-list": (_G + "[profiles.p]\nenv = {X = [1, 2]}\n", "values must be strings or numbers"),
    "env-value-a-table": (_G + "[profiles.p]\nenv = {X = {a = 1}}\n", "values must be strings or numbers"),
    "skip-reason-an-int": (_G + "[profiles.p]\nskip = {a = 5}\n", "must map listed notebooks to a reason"),
    "skip-unlisted": (_G + '[profiles.p]\nskip = {b = "x"}\n', "must map listed notebooks to a reason"),
    "parameters-an-int": (_G + "[profiles.p]\nparameters = 5\n", "[profiles.p.parameters] is a int, not a table"),
    "notebook-parameters-an-int": (_G + "[profiles.p]\nnotebooks = {a = 5}\n", "[profiles.p.notebooks.a] is a int"),
    "parameters-of-unlisted": (_G + "[profiles.p]\nnotebooks = {zz = {}}\n", "unlisted notebook(s) ['zz']"),
    "directory": ("DIR", "is a directory, not a regular file"), "fifo": ("FIFO", "is a FIFO, not a regular file"),
    "dev-zero": ("DEVZERO", "is a device, not a regular file"), "missing": ("DANGLING", "not found"),
}


@pytest.mark.parametrize("case", PROFILES_DAMAGE)
def test_every_damage_to_a_profiles_file_is_one_line(tmp_path, case):
    (tmp_path / "a.py").write_text("# %%\n")
    content, words = PROFILES_DAMAGE[case]
    replace_path(tmp_path / "profiles.toml", content if content in ("DIR", "FIFO", "DEVZERO", "DANGLING") or
         isinstance(content, bytes) else content.encode())
    with pytest.raises(DrcError) as info:
        load_profiles(tmp_path / "profiles.toml")
    line = str(info.value)
    assert "\n" not in line and words in line, line
