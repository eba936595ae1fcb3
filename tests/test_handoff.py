"""The typed records between notebooks: every field is a key its producing notebook writes, the reference book's
results parse, and notebook 07's numbers come out of them unchanged."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path

import pytest

from drc_book.handoff import RECORDS, Compute, Convergence, Halting, KnownDepth, TokenTypes, Training
from drc_book.report import ours_from
from drc_core.errors import DrcError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "papermill_runs" / "reference" / "results"


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.NOTEBOOK)
def test_a_whole_record_is_what_its_notebook_writes(cls, tmp_path):
    """The notebook writes the record itself (one call), and the reference results are exactly a record: read and
    written again, the file comes back the same."""
    source = (ROOT / "book" / f"{cls.NOTEBOOK}.py").read_text()
    assert cls.__name__ in source and "record.save(results_dir)" in source and "results = {" not in source
    record = cls.load(RESULTS)
    again = json.loads(record.save(tmp_path).read_text())
    assert again == json.loads((RESULTS / f"{cls.NOTEBOOK}.json").read_text())
    assert cls.load(tmp_path) == record or math.isnan(record.notebook_seconds)


def test_token_types_findings_come_from_the_record():
    record = TokenTypes.load(RESULTS)
    text = record.findings()
    first, last = record.order_shallow_to_deep[0], record.order_shallow_to_deep[-1]
    assert f"{first} tokens converge first ({record.by_class[first].mean_depth:.2f} loops" in text
    assert f"{last} tokens last ({record.by_class[last].mean_depth:.2f} loops" in text
    flipped = dataclasses.replace(record, order_shallow_to_deep=["whitespace", "content"])
    assert "as the paper found" in flipped.findings() and "as the paper found" not in text


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.NOTEBOOK)
def test_reference_results_parse(cls):
    record = cls.from_results(json.loads((RESULTS / f"{cls.NOTEBOOK}.json").read_text()))
    assert isinstance(record, cls)


def test_a_missing_key_names_the_notebook():
    with pytest.raises(DrcError, match="02_convergence lack .*kl_by_loop.*re-run notebook 02_convergence"):
        Convergence.from_results({"kl_final_by_loop": {}, "ce_by_loop": {}, "median_depth": {},
                                  "frac_updating": {}})


def test_notebook_06_numbers_come_out_unchanged():
    """ours_from on the reference results of 01-04 gives what the reference 06 recorded."""
    records = [c.from_results(json.loads((RESULTS / f"{c.NOTEBOOK}.json").read_text()))
               for c in (Training, Convergence, TokenTypes, Halting)]
    profiles = tomllib.loads((ROOT / "book" / "profiles.toml").read_text())
    max_loops = profiles["profiles"]["reference"]["parameters"]["max_loops"]
    ours, intervals, scale = ours_from(*records, max_loops=max_loops)
    saved = json.loads((RESULTS / "07_reproduction.json").read_text())
    assert set(ours) == set(saved["ours"]) and scale == saved["scale"]
    for key, value in saved["ours"].items():
        if isinstance(value, list):
            assert ours[key] == value
        else:
            assert (math.isnan(ours[key]) and value is None) or ours[key] == value, key
    assert {k: list(v) for k, v in intervals.items()} == saved["intervals"]


def test_convergence_findings_follow_the_record():
    record = Convergence.load(RESULTS)
    text = record.findings()
    assert f"by loop {record.median_depth.value:.0f}" in text and f"{record.oscillating.count} tokens" in text
    deep = max(record.kl_by_loop)
    stuck = dataclasses.replace(record, eps=record.kl_by_loop[deep].value / 10,
                                oscillating=dataclasses.replace(record.oscillating, count=0))
    assert "does not fall below" in stuck.findings() and "2-cycle" not in stuck.findings()


def test_compute_findings_follow_the_record():
    record = Compute.load(RESULTS)
    text = record.findings()
    rules = [e for e in record.batched if not e["baseline"] and e["family"] not in ("uniform", "huginn")]
    best = max(rules, key=lambda e: e["wallclock_speedup"])
    assert f"the fastest, {best['rule']}, runs {best['wallclock_speedup']:.2f}x" in text
    assert f"{sum(e['wallclock_speedup'] > 1 for e in rules)} of the {len(rules)} rules" in text
    said = [t.get("verdict", "met" if t["met"] else "missed") for t in record.speed_targets]  # older records: met
    assert f"Of the {len(said)} speed targets, {said.count('met')} are met, {said.count('missed')} missed" in text
    for rows in {e["rows"] for e in record.generation}:
        assert f"with {rows} row" in text
    assert f"{record.measurement_x_forward:.2f}x one forward" in text
    verdicts = [t["verdict"] for t in record.decoder_targets]
    assert f"continuous decoder's {len(verdicts)} targets, {verdicts.count('met')} are met" in text
    # a ceiling in the record says how many are out of reach; none in it, nothing is said
    rows = [{**t, "reachable": i != 0} for i, t in enumerate(record.decoder_targets)]
    assert "1 are out of reach of any" in dataclasses.replace(record, decoder_targets=rows).findings()
    bare = [{k: v for k, v in t.items() if k != "reachable"} for t in record.decoder_targets]
    assert "targets" in (said := dataclasses.replace(record, decoder_targets=bare)._decoder_sentence())
    assert "out of reach" not in said


def test_known_depth_findings_follow_the_record():
    record = KnownDepth.load(RESULTS)
    text = record.findings()
    k, acc = record.lowest_accuracy()
    assert acc.value == record.min_accuracy_at_R and f"k = {k}, {acc.value:.1%}" in text
    rho = record.spearman_depth
    assert f"Spearman(k, convergence depth) {rho.value:.2f} [{rho.lo:.2f}, {rho.hi:.2f}]" in text
    assert f"{record.lever['trained_k']} links" in text
    assert "links" not in dataclasses.replace(record, lever=None).findings()


def test_known_depth_findings_read_a_saved_nan(tmp_path):
    """NaN is saved as null: a level no k reaches and a missing cost read back as NaN, not as a TypeError (a
    small run's record, where no k reaches the accuracy level)."""
    data = json.loads((RESULTS / f"{KnownDepth.NOTEBOOK}.json").read_text())
    for row in data["growth"]:
        row["loops_needed"] = None
    for row in data["natural_cost_bpb"]:
        row["difference"] = None
    text = KnownDepth.from_results(data).findings()
    assert "The first loop at the accuracy level is nan" in text and "+nan bits per byte" in text
