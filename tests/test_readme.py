"""README.md stays a short page: its headline block is what scripts/readme_tables.py generates from the executed
reference book's results, it has at most 250 lines, and its links to docs/ resolve."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250


@pytest.fixture(scope="module")
def tables(script):
    return script("readme_tables")


def test_readme_headline_block_is_generated(tables):
    block = tables.readme_block(README.read_text())
    assert block == tables.render(), (
        "README.md's headline block differs from what scripts/readme_tables.py generates from "
        "papermill_runs/reference/results: run `.venv/bin/python scripts/readme_tables.py --write`"
    )


def test_docs_generated_blocks_are_fresh(tables):
    pages = tables.doc_pages()
    assert pages, "no docs page holds a generated block"
    for path, text in pages.items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} holds a stale generated table: run `make docs`")


def test_a_changed_result_changes_the_docs_table(tables, tmp_path):
    for f in tables.RESULTS.glob("*.json"):
        shutil.copy(f, tmp_path / f.name)
    speed = json.loads((tmp_path / "05_compute.json").read_text())
    speed["batched"][2]["wallclock_speedup"] = 9.87
    (tmp_path / "05_compute.json").write_text(json.dumps(speed))
    page = tables.doc_pages(tmp_path)[tables.DOCS / "measurements.md"]
    assert "9.87x" in page and "9.87x" not in (tables.DOCS / "measurements.md").read_text()


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (at most {MAX_LINES})"


def test_readme_keeps_its_sections():
    headings = re.findall(r"^## (.+)$", README.read_text(), re.M)
    for heading in ("Headline results", "From Python", "What is where", "What happens on bad input"):
        assert heading in headings


def test_readme_and_docs_links_resolve():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_headline_numbers_come_from_the_results(tables):
    """A changed results file changes the table (the block is not typed in by hand)."""
    block = tables.render()
    train = json.loads((tables.RESULTS / "01_training.json").read_text())
    assert f"{train['ce_gain_1_to_8']:.3f} nats" in block
    assert f"{train['ce_by_loops']['1']:.3f} / {train['ce_by_loops']['8']:.3f}" in block


def test_a_section_whose_results_are_missing_is_left_out(tables, tmp_path):
    for f in tables.RESULTS.glob("*.json"):
        shutil.copy2(f, tmp_path / f.name)
    (tmp_path / "07_known_depth.json").unlink(missing_ok=True)
    res = tables.Results(tmp_path)

    def absent(res):
        data = res.get("07_known_depth")
        return None if data is None else "| known depth |"

    block = tables.render(res, [*tables.SECTIONS, absent])
    assert block == tables.render(tmp_path)  # the extra section adds nothing without its file
    (tmp_path / "07_known_depth.json").write_text("{}")
    assert "| known depth |" in tables.render(tmp_path, [*tables.SECTIONS, absent])


def test_a_required_results_file_is_named_when_missing(tables, tmp_path):
    with pytest.raises(FileNotFoundError, match="01_training.json"):
        tables.render(tmp_path)


def test_the_script_rewrites_only_the_block(tables):
    text = "before\n" + tables.START + "\nold\n" + tables.END + "\nafter\n"
    out = tables.rewrite(text, "\nnew\n")
    assert out == "before\n" + tables.START + "\nnew\n" + tables.END + "\nafter\n"
    assert tables.readme_block(out) == "\nnew\n"


def test_a_speed_up_carries_its_interval_where_the_record_has_one(tables):
    assert tables.xi({"wallclock_speedup": 1.234, "speedup_lo": 1.1, "speedup_hi": 1.5}) == "1.23x [1.10, 1.50]"
    assert tables.xi({"wallclock_speedup": 1.234}) == "1.23x"  # a record written before the intervals
