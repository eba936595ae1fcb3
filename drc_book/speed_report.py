"""Everything of :mod:`drc_book.speed` and :mod:`drc_book.speed_checks` in one call
(:func:`run_speed`), as ``bench/adaptive_speed.py`` runs it, and its record (:class:`SpeedReport`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pandas as pd
from torch import Tensor

from drc_book.cost import Log
from drc_book.decode_speed import time_generation
from drc_book.speed import (
    Matched,
    SpeedConfig,
    matched_rules,
    on_device,
    preset_specs,
    speed_targets,
    speedup_table,
    time_batched,
)
from drc_book.speed_checks import measurement_cost, profile_batched
from drc_core import DepthRecurrentLM, DrcError

__all__ = ["SpeedReport", "run_speed"]


@dataclass
class SpeedReport:
    """What :func:`run_speed` returns: the config, the matching (:class:`Matched`), the batched frame (matched
    rules, then Huginn's presets if asked), the generation frame (one block of rows per batch size), the
    measurement pass, the speed targets (:func:`speed_targets`) and, if asked, the profile
    (:func:`profile_batched`: ``profile_kinds``, ``profile_ops``)."""

    config: SpeedConfig
    matched: Matched
    batched: pd.DataFrame
    generation: pd.DataFrame
    measurement: pd.DataFrame
    targets: pd.DataFrame | None = None
    profile_kinds: pd.DataFrame | None = None
    profile_ops: pd.DataFrame | None = None

    def table(self) -> pd.DataFrame:
        """:func:`speedup_table` of the batched and generation frames."""
        return speedup_table(self.batched, self.generation)

    def to_dict(self) -> dict:
        """JSON-ready content (frames as lists of records)."""
        out = {"config": asdict(self.config), "matched": self.matched.table.to_dict("records"),
               "batched": self.batched.to_dict("records"), "generation": self.generation.to_dict("records"),
               "measurement": self.measurement.to_dict("records"), "table": self.table().to_dict("records")}
        for name in ("targets", "profile_kinds", "profile_ops"):
            frame = getattr(self, name)
            if frame is not None:
                out[name] = frame.to_dict("records")
        return out


def run_speed(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig | None = None, *,
              log: Log = None) -> SpeedReport:
    """:func:`matched_rules`, then :func:`time_batched` with the matched rules (and Huginn's presets,
    :func:`preset_specs`, with ``presets``), :func:`time_generation` with the matched rules for ``gen_rows`` and
    each of ``more_gen_rows`` prompts (the first ``prompt_len`` tokens of the first windows), then
    :func:`measurement_cost`, :func:`speed_targets` and, with ``profile``, :func:`profile_batched`."""
    cfg = cfg or SpeedConfig()
    windows = on_device(model, windows)
    most = max((cfg.gen_rows, *cfg.more_gen_rows))
    if cfg.prompt_len > windows.shape[1] or most > len(windows):
        raise DrcError(f"prompt_len={cfg.prompt_len} / gen_rows={most} exceed the windows "
                       f"({len(windows)} of {windows.shape[1]} tokens): lower them")
    matched = matched_rules(model, windows, cfg, log=log)
    extra = preset_specs(cfg, matched.specs) if cfg.presets else []
    batched = time_batched(model, windows, [*matched.specs, *extra], cfg, log=log)
    generation = pd.concat([time_generation(model, windows[:rows, : cfg.prompt_len], matched.specs, cfg, log=log)
                            for rows in dict.fromkeys((cfg.gen_rows, *cfg.more_gen_rows))], ignore_index=True)
    measurement = measurement_cost(model, windows, cfg, log=log)
    targets = speed_targets(batched[batched.family != "huginn"], generation)
    kinds = ops = None
    if cfg.profile:
        kinds, ops = profile_batched(model, windows, matched.specs, cfg)
    return SpeedReport(cfg, matched, batched, generation, measurement, targets, kinds, ops)
