"""Each notebook's results as a typed :class:`Record`, the whole JSON file: the notebook builds it, writes it once
and states its findings from it; notebook 07, the README and the docs tables read it back by its fields' types (a
missing field is a one-line :class:`~drc_core.DrcError` naming the notebook to re-run)."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import MISSING, asdict, astuple, dataclass, fields, is_dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any, ClassVar, get_args, get_origin, get_type_hints

import numpy as np
import pandas as pd

from drc_book.workspace import load_results, save_results
from drc_core import DrcError, family_title

__all__ = ["RECORDS", "ClassDepth", "Compute", "Convergence", "Cycles", "Halting", "Interval", "KnownDepth",
           "Record", "Reproduction", "TokenTypes", "Training"]


def _num(x: Any) -> float:
    """A JSON number; null (how save_results writes NaN) is NaN."""
    return math.nan if x is None else float(x)


def _parse(tp: Any, value: Any) -> Any:
    """``value`` read from JSON as the type ``tp``: a float's null is NaN, an optional's null None; a dataclass from
    an object of its fields (or a list of them in order); dict keys and values, list items by their own types."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is types.UnionType:  # X | None
        return None if value is None else _parse(args[0], value)
    if tp is float:
        return _num(value)
    if tp in (int, str, bool):
        return tp(value)
    if is_dataclass(tp):
        if isinstance(value, tp):
            return value
        hints = get_type_hints(tp)
        if isinstance(value, list):
            return tp(*(_parse(hints[f.name], v) for f, v in zip(fields(tp), value, strict=True)))
        # a field with a default that the file lacks (written by an older run) takes its default
        return tp(**{f.name: _parse(hints[f.name], value[f.name]) for f in fields(tp) if f.name in value})
    if origin is dict:
        return {_parse(args[0], k): _parse(args[1], v) for k, v in value.items()}
    if origin is list:
        return [_parse(args[0], v) for v in value]
    return value  # Any


class Record:
    """A notebook's whole results: a frozen dataclass whose fields are the JSON file's keys."""

    NOTEBOOK: ClassVar[str]

    @classmethod
    def from_results(cls, r: Mapping[str, Any]) -> Any:
        """The record from a results file's content, each field parsed by its type."""
        missing = [f.name for f in fields(cls) if f.name not in r and f.default is MISSING]  # type: ignore[arg-type]
        if missing:
            raise DrcError(f"the results of {cls.NOTEBOOK} lack {', '.join(missing)}: re-run notebook {cls.NOTEBOOK} "
                           "of this profile")
        return _parse(cls, r)

    @classmethod
    def load(cls, results_dir: str | Path) -> Any:
        """The record a run of its notebook wrote to ``results_dir``."""
        return cls.from_results(load_results(results_dir, cls.NOTEBOOK))

    def save(self, results_dir: str | Path) -> Path:
        """Write the record as ``results_dir/<NOTEBOOK>.json``."""
        return save_results(results_dir, self.NOTEBOOK, self._json())

    def _json(self) -> dict[str, Any]:
        """The file's content; an optional field (default None) left None is not written, so a file from before it
        was added reads and writes back the same."""
        unset = {f.name for f in fields(self) if f.default is None and getattr(self, f.name) is None}  # type: ignore[arg-type]
        return {k: v for k, v in asdict(self).items() if k not in unset}  # type: ignore[call-overload]

    def findings(self) -> str:
        """What the notebook found, in a few sentences of Markdown with the record's numbers."""
        raise NotImplementedError


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval (``{"value", "lo", "hi"}`` in the JSON; null is NaN);
    ``f"{iv:.2f}"`` writes ``value [lo, hi]``."""

    value: float
    lo: float
    hi: float

    def __format__(self, spec: str) -> str:
        if not spec:
            return str(self)
        return f"{self.value:{spec}} [{self.lo:{spec}}, {self.hi:{spec}}]"


@dataclass(frozen=True)
class Cycles:
    """The tokens in a 2-cycle at the deepest loop (:func:`drc_core.oscillating_tokens`): how many, the share of the
    mean successive KL they carry at some loops (loop -> share), and the largest of them (``tokens``: rows)."""

    count: int
    share_of_mean_kl: dict[int, float]
    tokens: list[dict[str, Any]]


@dataclass(frozen=True)
class Training(Record):
    """Notebook 01's results: where the model came from (``model_source``: ``kind``, ``path``), its size and
    training, and the validation CE at uniform depths (``ce_by_loops``: loops -> nats, overall and per source) with
    the unigram entropy for scale; ``gain_by_step``: CE(1) - CE(8) at each evaluation during training."""

    NOTEBOOK: ClassVar[str] = "01_training"
    profile: str
    model_source: dict[str, str]
    n_params: int
    train_minutes: float
    train_tokens: int
    ce_by_loops: dict[int, float]
    unigram: float
    n_windows: int
    ce_by_source: dict[str, dict[int, float]]
    ce_gain_1_to_8: float
    gain_by_step: dict[int, float]
    notebook_seconds: float

    @classmethod
    def build(cls, *, profile: str, model_source: dict[str, str], n_params: int, cfg: Any, metrics: pd.DataFrame,
              ce_by_loops: Mapping[int, float], by_source: pd.DataFrame, unigram: float, n_windows: int,
              gain: pd.DataFrame, seconds: float) -> Training:
        """The record from what the notebook measured: the run's training config ``cfg`` and ``metrics``, the CE by
        loops overall and per source (:func:`drc_core.loss_by_depth`, :func:`drc_core.loss_by_source`), and the
        gain from depth by training step (:func:`drc_core.depth_gain_by_step`)."""
        ce = {int(lp): float(v) for lp, v in ce_by_loops.items()}
        return cls(profile=profile, model_source=model_source, n_params=n_params,
                   train_minutes=float(metrics["seconds"].dropna().max()) / 60,
                   train_tokens=cfg.max_steps * cfg.batch_size * cfg.seq_len, ce_by_loops=ce, unigram=unigram,
                   n_windows=n_windows,
                   ce_by_source={str(src): dict(zip(g.loops, g.loss, strict=True))
                                 for src, g in by_source.groupby("source")},
                   ce_gain_1_to_8=ce.get(1, math.nan) - ce.get(8, math.nan),
                   gain_by_step=dict(zip(gain.step.astype(int), gain.gain, strict=True)), notebook_seconds=seconds)

    @property
    def scale(self) -> str:
        """e.g. ``1.4M-parameter, 12M-token``."""
        return f"{self.n_params / 1e6:.1f}M-parameter, {self.train_tokens / 1e6:.0f}M-token"

    def findings(self) -> str:
        ce = self.ce_by_loops
        deepest = max(ce)
        at = min(ce, key=lambda lp: (ce[lp] - min(ce.values()) > 0.005, lp))  # fewest loops within 0.005 of the best
        steps = sorted(self.gain_by_step)
        growing = len(steps) > 1 and self.gain_by_step[steps[-1]] > self.gain_by_step[steps[-2]]
        at8 = ce.get(8, ce[deepest])
        return (f"**Found.** One {self.scale} checkpoint ({self.train_minutes:.0f} minutes of training) runs at every "
                f"depth: validation CE falls from {ce[min(ce)]:.3f} nats at {min(ce)} loop to {at8:.3f} at 8 "
                f"(a gain of {self.ce_gain_1_to_8:.3f} nats from depth), and {ce[deepest]:.3f} at {deepest}; "
                f"{at} loops already come within 0.005 nats of the best. For scale, the unigram entropy is "
                f"{self.unigram:.2f} nats. The gain from depth was "
                f"{'still growing' if growing else 'no longer growing'} at the last evaluation of training.")


def _interval(row: Mapping[str, Any], value: str, lo: str, hi: str) -> Interval:
    return Interval(_num(row[value]), _num(row[lo]), _num(row[hi]))


@dataclass(frozen=True)
class Convergence(Record):
    """Notebook 02's results, per loop l: ``kl_by_loop`` (mean KL(p_l || p_{l-1}), l >= 2), ``state_delta_by_loop``,
    ``kl_final_by_loop`` (mean KL(p_L || p_l), l < L), ``ce_by_loop``; the depth summaries at ``eps``; what the
    mean KL is made of (``kl_concentration``, loop -> statistic), the tokens in a 2-cycle (``oscillating``), the
    depth statistics at other eps (``eps_sensitivity``), the per-token ``dynamics`` tables (as record lists), and
    ``n_tokens`` / ``n_docs``, what these were measured on."""

    NOTEBOOK: ClassVar[str] = "02_convergence"
    profile: str
    eps: float
    train_mean_depth: float
    n_tokens: int
    n_docs: int
    kl_by_loop: dict[int, Interval]
    state_delta_by_loop: dict[int, float]
    kl_final_by_loop: dict[int, float]
    ce_by_loop: dict[int, Interval]
    median_depth: Interval
    mean_depth: Interval
    frac_updating: Interval
    frac_unconverged: Interval
    kl_concentration: dict[int, dict[str, float]]
    oscillating: Cycles
    eps_sensitivity: dict[str, dict[str, float]]
    dynamics: dict[str, Any]
    notebook_seconds: float

    @classmethod
    def build(cls, *, profile: str, eps: float, train_mean_depth: float, summary: pd.DataFrame,
              headline: pd.DataFrame, concentration: pd.DataFrame, cycling: pd.DataFrame,
              cycle_share: Mapping[int, float], sensitivity: pd.DataFrame, dynamics: dict[str, Any],
              seconds: float) -> Convergence:
        """The record from notebook 02's tables: :func:`drc_core.per_loop_summary` (``summary``),
        :func:`drc_core.depth_summary` (``headline``), :func:`drc_core.kl_concentration`,
        :func:`drc_core.oscillating_tokens` (``cycling``, ``cycle_share``), :func:`drc_core.eps_sensitivity`."""
        s = summary.set_index("loop")
        last = int(s.index.max())
        stats = headline.set_index("stat")
        return cls(
            profile=profile, eps=eps, train_mean_depth=train_mean_depth,
            n_tokens=int(headline.n_tokens.iloc[0]), n_docs=int(headline.n_clusters.iloc[0]),
            kl_by_loop={int(lp): _interval(r, "kl", "kl_ci_low", "kl_ci_high") for lp, r in s.iterrows() if lp >= 2},
            state_delta_by_loop={int(lp): float(r.state_delta) for lp, r in s.iterrows() if lp >= 2},
            kl_final_by_loop={int(lp): float(r.kl_final) for lp, r in s.iterrows() if lp < last},
            ce_by_loop={int(lp): _interval(r, "ce", "ce_ci_low", "ce_ci_high") for lp, r in s.iterrows()},
            **{name: _interval(stats.loc[name], "value", "ci_low", "ci_high")
               for name in ("median_depth", "mean_depth", "frac_updating", "frac_unconverged")},
            kl_concentration={int(lp): {str(k): float(v) for k, v in row.items()}
                              for lp, row in concentration.set_index("loop").to_dict("index").items()},
            oscillating=Cycles(count=len(cycling), share_of_mean_kl={int(k): float(v) for k, v in cycle_share.items()},
                               tokens=cycling.head(20).to_dict("records")),
            eps_sensitivity={f"{e:g}": dict(zip(g.stat, g.value, strict=True)) for e, g in sensitivity.groupby("eps")},
            dynamics=dynamics, notebook_seconds=seconds)

    def findings(self) -> str:
        kl, R = self.kl_by_loop, round(self.train_mean_depth)
        first, deep = min(kl), max(kl)
        verdict = ("Tokens do converge" if kl[deep].value < self.eps
                   else f"The mean does not fall below ε = {self.eps:g} within the pass")
        top = max(self.oscillating.share_of_mean_kl, default=None)
        cycles = ("" if top is None or self.oscillating.count == 0 else
                  f" The mean's floor is not every token decaying slowly: {self.oscillating.count} tokens in a "
                  f"2-cycle carry {self.oscillating.share_of_mean_kl[top]:.0%} of the mean successive KL at loop "
                  f"{top}.")
        return (f"**Found.** {verdict}: the mean successive KL falls from {kl[first].value:.3g} at loop "
                f"{first} to {kl[deep].value:.3g} at loop {deep}. Half the tokens settle (KL below {self.eps:g} for "
                f"good) by loop {self.median_depth:.0f}, and {self.frac_updating:.1%} are still updating at the "
                f"training mean depth {R}; {self.frac_unconverged.value:.2%} never settle within the pass "
                f"({self.n_tokens:,} tokens from {self.n_docs} documents).{cycles}")


@dataclass(frozen=True)
class ClassDepth:
    """One token class's mean convergence depth with its bootstrap interval over documents, and its share of
    the tokens."""

    mean_depth: float
    lo: float
    hi: float
    share: float


@dataclass(frozen=True)
class TokenTypes(Record):
    """Notebook 03's results: per token class (whitespace, punctuation, number, function, content, continuation),
    the mean convergence depth at ``eps``, ordered from the shallowest class to the deepest."""

    NOTEBOOK: ClassVar[str] = "03_token_types"
    profile: str
    eps: float
    order_shallow_to_deep: list[str]
    by_class: dict[str, ClassDepth]
    notebook_seconds: float

    @classmethod
    def from_table(cls, by_class: pd.DataFrame, *, profile: str, eps: float, seconds: float) -> TokenTypes:
        """From :func:`drc_core.class_depth_summary`'s table (sorted shallow to deep)."""
        return cls(profile=profile, eps=eps, order_shallow_to_deep=by_class["class"].tolist(),
                   by_class={r["class"]: ClassDepth(r["mean_depth"], r["ci_low"], r["ci_high"], r["share"])
                             for r in by_class.to_dict("records")},
                   notebook_seconds=seconds)

    def findings(self) -> str:
        first, last = self.order_shallow_to_deep[0], self.order_shallow_to_deep[-1]

        def depth(c: str) -> str:
            d = self.by_class[c]
            return f"{d.mean_depth:.2f} loops [{d.lo:.2f}, {d.hi:.2f}], {d.share:.0%} of the tokens"

        paper = ("as the paper found" if (first, last) == ("whitespace", "content")
                 else "where the paper found whitespace first and content words last")
        return (f"**Found.** At ε = {self.eps:g}, {first} tokens converge first ({depth(first)}) and {last} tokens "
                f"last ({depth(last)}), {paper}. From shallow to deep: {' < '.join(self.order_shallow_to_deep)}.")


_GAP_STATS = ("family_depth", "uniform_depth", "saved", "saved_frac")


def gap_intervals(rows: list[Mapping[str, Any]]) -> dict[str, dict[str, Interval]]:
    """:func:`drc_core.gap_table` rows (family, ``<stat>``, ``<stat>_lo``, ``<stat>_hi``) as family -> stat ->
    :class:`Interval`."""
    return {str(g["family"]): {k: _interval(g, k, f"{k}_lo", f"{k}_hi") for k in _GAP_STATS} for g in rows}


def gap_rows(gaps: Mapping[str, Mapping[str, Interval]]) -> list[dict[str, Any]]:
    """The inverse of :func:`gap_intervals`: family -> stat -> :class:`Interval` as :func:`drc_core.gap_table` rows."""
    rows = []
    for family, by_stat in gaps.items():
        row: dict[str, Any] = {"family": family}
        for stat, iv in by_stat.items():
            row.update({stat: iv.value, f"{stat}_lo": iv.lo, f"{stat}_hi": iv.hi})
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Halting(Record):
    """Notebook 04's results, tables as lists of rows: per family the depth matching uniform depth
    ``reference_loops``'s CE (``matching``, :func:`drc_core.matching_table`) and the loops it saves against the
    uniform depth of equal quality (``gaps``, :func:`drc_core.gap_table`); the calibration, held-out points, online
    check and the guarantee's certificates and validity (``risk_control``)."""

    NOTEBOOK: ClassVar[str] = "04_halting_and_routers"
    profile: str
    reference_loops: int
    rule_max_loops: int
    ce_tolerance: float
    kl_target: float
    ce_uniform_ref: float
    matching: list[dict[str, Any]]
    gaps: list[dict[str, Any]]
    calibration: list[dict[str, Any]]
    held_out_points: list[dict[str, Any]]
    n_windows: dict[str, int]
    online_check: list[dict[str, Any]]
    risk_control: dict[str, Any]
    notebook_seconds: float

    def depth(self, family: str) -> float:
        """The family's matching depth (CE within the tolerance of uniform depth R), NaN when it is not in the
        table or never matches."""
        return next((_num(m["ce_depth_interp"]) for m in self.matching if m["family"] == family), math.nan)

    @property
    def gap_intervals(self) -> dict[str, dict[str, Interval]]:
        """Family -> loops saved against the uniform depth of equal quality, with intervals (see
        :func:`gap_intervals`)."""
        return gap_intervals(self.gaps)

    def findings(self) -> str:
        gaps, R = self.gap_intervals, self.reference_loops
        saved = {f: g["saved_frac"] for f, g in gaps.items()}
        ranked = sorted((f for f in saved if f != "oracle"), key=lambda f: -saved[f].value)
        best = f"{family_title(ranked[0])}, {saved[ranked[0]]:.0%}" if ranked else "none"
        beats = [family_title(f) for f in ranked if saved[f].lo > 0]
        return (f"**Found.** Uniform depth already matches depth {R}'s loss (within {self.ce_tolerance:g} nats) at "
                f"{self.depth('uniform'):.2f} loops. Against that depth, the per-token oracle saves "
                f"{format(saved['oracle'], '.0%') if 'oracle' in saved else 'n/a'} of the loops (an offline bound), "
                f"and the best rule or router, {best}; those whose interval lies above zero: "
                f"{', '.join(beats) or 'none'}.")


def _verdicts(targets: list[dict[str, Any]]) -> list[str]:
    """Each target row's verdict on its interval; rows written before verdicts: met or missed on the median."""
    return [t.get("verdict", "met" if t["met"] else "missed") for t in targets]


@dataclass(frozen=True)
class Compute(Record):
    """Notebook 05's results: the setting, then every timing table as a list of rows (None for a skipped section;
    ``decode_op_calls``, the halting decoders' operator calls per generated token, and ``timing_checks`` are None in
    results written before them) and the measurement pass's cost ratios."""

    NOTEBOOK: ClassVar[str] = "05_compute"
    profile: str
    reference_loops: int
    rule_max_loops: int
    ce_tolerance: float
    n_windows: int
    seq_len: int
    rounds: int
    threads: int
    matched: list[dict[str, Any]]
    batched: list[dict[str, Any]]
    generation: list[dict[str, Any]]
    measurement: list[dict[str, Any]]
    table: list[dict[str, Any]]
    skip_overhead_at_equal_depth: float
    speed_targets: list[dict[str, Any]]
    anderson: list[dict[str, Any]] | None
    decode_loop_cost: list[dict[str, Any]]
    decode_prediction: list[dict[str, Any]]
    decoders: list[dict[str, Any]]
    decoder_targets: list[dict[str, Any]]
    serving: list[dict[str, Any]] | None
    bf16: list[dict[str, Any]] | None
    measurement_x_forward: float
    measurement_x_readout_pass: float
    readout_pass_x_forward: float
    notebook_seconds: float
    decode_op_calls: list[dict[str, Any]] | None = None
    timing_checks: list[dict[str, Any]] | None = None  # how each interleaved timing ended, and its warm-up check

    @classmethod
    def build(cls, **values: Any) -> Compute:
        """The record from the notebook's values, its frames (and None for a skipped section) as lists of rows."""
        return cls(**_rows(values))

    def findings(self) -> str:
        def matched(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:  # not a baseline, uniform depth or Huginn
            return [e for e in rows if not e["baseline"] and e["family"] not in ("uniform", "huginn")]

        speedup = itemgetter("wallclock_speedup")
        rules = matched(self.batched)
        best = max(rules, key=speedup)
        faster = [e for e in rules if e["wallclock_speedup"] > 1]
        gen = "; ".join(
            f"with {b} row{'s' * (b > 1)} {g['rule']} at {g['wallclock_speedup']:.2f}x"
            for b in sorted({e["rows"] for e in self.generation})
            for g in [max(matched([e for e in self.generation if e["rows"] == b]), key=speedup)])
        verdicts = _verdicts(self.speed_targets)
        missed = [t for t, v in zip(self.speed_targets, verdicts, strict=True) if v != "met"]
        r = self.reference_loops
        return (f"**Found.** At matched quality (CE within {self.ce_tolerance:g} nats of uniform depth {r}), "
                f"{len(faster)} of the {len(rules)} rules beat uniform depth {r} on the clock in batched evaluation; "
                f"the fastest, {best['rule']}, runs {best['wallclock_speedup']:.2f}x against a FLOP proxy of "
                f"{best['proxy_speedup']:.2f}x. In generation the best rule against the dense decoder: {gen}. The "
                f"skipping path at equal depth runs at {self.skip_overhead_at_equal_depth:.2f}x the dense forward. "
                f"Of the {len(self.speed_targets)} speed targets, {verdicts.count('met')} are met, "
                f"{verdicts.count('missed')} missed and {verdicts.count('unresolved')} unresolved on their "
                f"intervals; {sum(not t['reachable'] for t in missed)} of those not met are out of reach of any "
                "implementation of the same work. "
                f"The measurement pass costs {self.measurement_x_forward:.2f}x one forward at its depth and "
                f"{self.measurement_x_readout_pass:.2f}x the bare every-loop readout pass (itself "
                f"{self.readout_pass_x_forward:.2f}x the forward).{self._decoder_sentence()}{self._timing_sentence()}")

    def _decoder_sentence(self) -> str:
        """The continuous decoder's targets by verdict (out of reach: from results written with a ``ceiling``)."""
        checks = self.decoder_targets or []
        if not checks:
            return ""
        verdicts = _verdicts(checks)
        reach = (f"; {sum(c['reachable'] is False for c in checks)} are out of reach of any implementation of the "
                 "same work" if all("reachable" in c for c in checks) else "")
        return (f" Of the continuous decoder's {len(checks)} targets, {verdicts.count('met')} are met, "
                f"{verdicts.count('missed')} missed and {verdicts.count('unresolved')} unresolved on their "
                f"intervals{reach}.")

    def _timing_sentence(self) -> str:
        """How the timings ended, from ``timing_checks`` (empty in results written before them)."""
        checks = self.timing_checks or []
        if not checks:
            return ""
        settled = sum(c["stopped"] == "interval" for c in checks)
        warm = [c["timing"] for c in checks if c["warmup_ok"] is False]
        verdict = ("needs two rounds or more" if all(c["warmup_ok"] is None for c in checks)
                   else f"fails for {', '.join(warm)}" if warm else "passes for every timing")
        return (f" Of the {len(checks)} timings, {settled} stopped once every median was within the asked precision "
                f"and the others at their time budget or round limit; the warm-up check {verdict}.")


def _rows(value: Any) -> Any:
    """As the JSON holds it: a frame as a list of rows, a series as a dict, a tuple as a list, inside dicts too."""
    if isinstance(value, dict):
        return {k: _rows(v) for k, v in value.items()}
    if isinstance(value, pd.DataFrame):
        return value.to_dict("records")
    if isinstance(value, pd.Series):
        return value.to_dict()
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class KnownDepth(Record):
    """Notebook 06's results on the model trained on natural text mixed with depth tasks (training-mean depth
    ``reference_loops``, lookups ``k_range``). Tables are lists of rows; ``gaps`` is window set -> family -> stat
    (:func:`drc_core.gap_table` rows in the file); ``lever`` and ``second_law`` are
    :func:`drc_book.known_depth.lever_study` records (None when skipped); the correlations are ``[value, lo, hi]`` in
    the file."""

    NOTEBOOK: ClassVar[str] = "06_known_depth"
    profile: str
    model_source: dict[str, Any]
    n_params: int
    reference_loops: int
    task_share: float
    k_range: list[int]
    n_answers: int
    n_documents: int
    accuracy: list[dict[str, Any]]
    accuracy_by_family: list[dict[str, Any]]
    accuracy_at_R: dict[int, float]
    accuracy_at_1: dict[int, float]
    min_accuracy_at_R: float
    growth: list[dict[str, Any]]
    growth_fit: dict[str, float]
    spearman_depth: Interval
    spearman_commit: Interval
    depth_by_k: list[dict[str, Any]]
    overthinking: list[dict[str, Any]]
    answer_dynamics: list[dict[str, Any]]
    risk_validity: list[dict[str, Any]]
    risk_shift: list[dict[str, Any]]
    norm_growth_by_k: dict[int, float]
    gaps: dict[str, dict[str, dict[str, Interval]]]
    exits_by_k: list[dict[str, Any]]
    routers: dict[str, Any]
    extrapolation: list[dict[str, Any]]
    lever: dict[str, Any] | None
    natural_cost_bpb: list[dict[str, Any]]
    copying: list[dict[str, Any]]
    notebook_seconds: float
    second_law: dict[str, Any] | None = None

    @classmethod
    def build(cls, *, accuracy: pd.DataFrame, growth: pd.DataFrame, gaps: Mapping[str, pd.DataFrame],
              **values: Any) -> KnownDepth:
        """The record from the notebook's values (frames as lists of rows, the correlations as ``(value, lo, hi)``,
        ``gaps`` as :func:`drc_core.gap_table` frames per window set); the accuracy at 1 and ``reference_loops``
        loops and the fits of ``growth`` (its ``attrs``) are read from the tables."""
        at = {lp: accuracy[accuracy.loop == lp].set_index("k").acc for lp in (1, values["reference_loops"])}
        return cls.from_results({**_rows(values), "accuracy": _rows(accuracy), "growth": _rows(growth),
                                 "growth_fit": dict(growth.attrs), "accuracy_at_1": at[1].to_dict(),
                                 "accuracy_at_R": at[values["reference_loops"]].to_dict(),
                                 "min_accuracy_at_R": float(at[values["reference_loops"]].min()),
                                 "gaps": {name: g.reset_index().to_dict("records") for name, g in gaps.items()}})

    @classmethod
    def from_results(cls, r: Mapping[str, Any]) -> KnownDepth:
        """As :meth:`Record.from_results`, with ``gaps`` given as :func:`drc_core.gap_table` rows per window set."""
        if "gaps" in r:
            r = {**r, "gaps": {name: gap_intervals(rows) for name, rows in r["gaps"].items()}}
        return super().from_results(r)

    def _json(self) -> dict[str, Any]:
        """In the file the correlations are ``[value, lo, hi]`` and ``gaps`` rows."""
        return {**super()._json(), "spearman_depth": list(astuple(self.spearman_depth)),
                "spearman_commit": list(astuple(self.spearman_commit)),
                "gaps": {name: gap_rows(g) for name, g in self.gaps.items()}}

    def lowest_accuracy(self) -> tuple[int, Interval]:
        """The ``k`` whose answers are least accurate at ``reference_loops`` loops, and that accuracy."""
        k = min(self.accuracy_at_R, key=self.accuracy_at_R.__getitem__)
        row = next(a for a in self.accuracy if int(a["k"]) == k and a["loop"] == self.reference_loops)
        return k, _interval(row, "acc", "acc_lo", "acc_hi")

    def findings(self) -> str:
        lo_k, hi_k = self.k_range
        k, acc = self.lowest_accuracy()
        deep = max(self.accuracy_at_1)
        needed = ", ".join(f"{_num(g['loops_needed']):g}" for g in self.growth)
        depth = {int(d["k"]): d["value"] for d in self.depth_by_k if d["series"] == "depth"}
        tasks = self.gaps.get("task documents", {})
        nan = Interval(math.nan, math.nan, math.nan)

        def saved(family: str) -> str:
            return f"{family_title(family)} {tasks.get(family, {}).get('saved_frac', nan):.0%}"

        lever = ("" if self.lever is None else
                 f" A model trained on chains of up to {self.lever['trained_k']} links gives Spearman(k, convergence "
                 f"depth) {Interval(*self.lever['spearman_depth']):.2f} on chains of up to twice that.")
        if self.lever is not None and "trained_range" in self.lever:
            inside = [c["spearman"] for c in self.lever["cells"] if c["chain"] <= self.lever["trained_k"]
                      and not math.isnan(_num(c["spearman"]))]
            trained = Interval(*self.lever["trained_range"]["spearman_depth"])
            lever += (f" On its training range Spearman is {trained:.2f}"
                      + (f", and {min(inside):.2f} to {max(inside):.2f} inside cells of one chain length and "
                         "question position." if inside else "."))
        for study in (self.lever, self.second_law):
            if study is not None and "depth_law" in study:
                r2 = {r["law"]: _interval(r, "r2", "r2_lo", "r2_hi") for r in study["depth_law"]}
                best = max(r2, key=lambda name: r2[name].value)
                other, law = r2["linear" if best == "log" else "log"], "log2 k" if best == "log" else "k"
                verdict = (f"follows a line in {law} better" if r2[best].lo > other.hi else
                           f"does not tell a line in {law} from the other law (their intervals overlap)")
                lever += (f" On {study.get('family', 'links')} (trained k <= {study['trained_k']}) the mean "
                          f"convergence depth {verdict}: r² {r2[best]:.2f} against {other:.2f}.")
            if study is not None and "savings" in study:
                rows = study["savings"]
                lever += (f" On the {study.get('family', 'links')} model's documents, loops saved against the "
                          f"uniform depth of equal CE ({rows[0]['uniform_depth']:.2f} loops): ") + "; ".join(
                    "{} {:.0%} [{:.0%}, {:.0%}] with {:+.1f} points of answer accuracy".format(
                        family_title(r["family"]), r["saved_frac"], r["saved_frac_lo"], r["saved_frac_hi"],
                        0.0 - r["acc_lost"]) for r in rows) + "."  # 0.0 - x: no "-0.0" for no loss
        cost = [_num(c["difference"]) for c in self.natural_cost_bpb]
        return (f"**Found.** Answers needing k = {lo_k}..{hi_k} lookups: at {self.reference_loops} loops the least "
                f"accurate are those of k = {k}, {acc:.1%}; at one loop those of "
                f"k = {deep} are {self.accuracy_at_1[deep]:.1%} accurate. The first loop at the accuracy level is "
                f"{needed} for k = {', '.join(str(g['k']) for g in self.growth)}. The mean convergence depth goes "
                f"{' → '.join(f'{v:.2f}' for v in depth.values())} loops over k, Spearman(k, convergence depth) "
                f"{self.spearman_depth:.2f}. On the task documents, loops saved against the uniform depth of equal "
                f"quality: {saved('oracle')}, {saved('kl')}, {saved('state_delta')}.{lever} "
                f"Mixing in the tasks costs the natural text {np.mean(cost):+.3f} bits per byte (mean over sources).")


@dataclass(frozen=True)
class Reproduction(Record):
    """Notebook 07's results, tables as lists of rows: our numbers on the reference (``ours``, ``intervals``,
    ``scale``), the reproduction ``table`` (one row per claim of :data:`drc_book.report.PAPER`) and the tables beside
    it, and how many claims agree."""

    NOTEBOOK: ClassVar[str] = "07_reproduction"
    profile: str
    ours: dict[str, Any]
    intervals: dict[str, list[float]]
    scale: str
    table: list[dict[str, Any]]
    side_by_side: list[dict[str, Any]]
    known_depth_targets: list[dict[str, Any]]
    seeds: dict[str, Any]
    plateau: list[dict[str, Any]]
    levers: list[dict[str, Any]]
    scales: list[dict[str, Any]]
    targets: list[dict[str, Any]]
    scale_grid: list[dict[str, Any]]
    lever_effects: list[dict[str, Any]]
    damping: list[dict[str, Any]]
    agree: int
    claims: int
    notebook_seconds: float

    def findings(self) -> str:
        met = [t["target"] for t in self.targets if t.get("met") == "yes"]
        judged = [t for t in self.targets if t.get("met") in ("yes", "no")]
        plateaus = ", ".join(f"mean {p['train_mean_depth']:g}: {p['plateau_depth']}" for p in self.plateau)
        return (f"**Found.** {self.agree} of the paper's {self.claims} claims agree with ours by the criteria stated "
                f"in advance (the table says which and why the others differ; this is a {self.scale} model). "
                f"{len(met)} of the {len(judged)} judged reference targets are met ({', '.join(met) or 'none'}). "
                f"Where the loss stops improving, by "
                f"training-mean depth: {plateaus} loops.")


RECORDS = (Training, Convergence, TokenTypes, Halting, Compute, KnownDepth, Reproduction)
