"""drc_core: depth-recurrent transformers and per-token convergence measurements.

The public API is :data:`_EXPORTS` below, grouped by use, plus every rule class of the registry in
:mod:`drc_core.halting.rules` (looked up on each use, so a rule registered later is exported too). Each name loads
on first use, so ``python -m drc_core.training.train`` does not import the analysis and plotting layers.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

__version__ = "0.1.0"

# (module, its exported names) by use; "NAME=attr" exports the module's ``attr`` under NAME.
_GROUPS: tuple[tuple[str, str], ...] = (
    # load a model, trace text through its loops, generate with halting, calibrate a rule
    ("drc_core.api", "load trace generate calibrate document_windows Model Trace Generation"),
    # the model and its loop
    ("drc_core.model.lm", "DepthRecurrentLM RecurrentModel iterate logits_at"),
    ("drc_core.model.huginn", "HuginnLM"),
    ("drc_core.model.config", "ModelConfig"),
    ("drc_core.model.recurrence", "RecurrenceConfig"),
    ("drc_core.model.precision", "bf16_support machine_kind"),
    ("drc_core.model.checks", "check_token_ids"),
    ("drc_core.model.passes", "eval_batches EVAL_STATE_SEED kl_successive"),
    ("drc_core.model.anderson", "AndersonConfig PLAIN_ITERATION=PLAIN anderson_iterate evals_to_converge"),
    # data: prepared corpora, their validation windows, the generated known-depth documents
    ("drc_core.data.sampler", "Corpus"),
    ("drc_core.data.tokenizer", "eot_id"),
    ("drc_core.analysis.measure", "val_windows_with_docs"),
    ("drc_core.data.depth_tasks", "DepthTaskConfig generate_document DEPTH_TASK_SOURCE=SOURCE_NAME token_labels"),
    ("drc_core.data.labels", "read_labels"),
    ("drc_core.data.sources", "SourceSpec"),
    ("drc_core.data.prepare", "PrepareConfig prepare"),
    # training runs and their evaluation; a run directory's layout: the file and folder names open_run reads
    ("drc_core.training.rundir", "open_run METRICS_FILE SHIPPED_TRAIN_CONFIG FINAL_DIR CHECKPOINTS_DIR"),
    ("drc_core.model.lm", "WEIGHTS_FILE"),
    ("drc_core.training.config", "TrainConfig"),
    ("drc_core.training.train", "train preset_for"),
    ("drc_core.training.evaluate", "loss_by_depth loss_by_source unigram_loss depth_gain_by_step"),
    # per-token x loop measurement and its summaries
    ("drc_core.analysis.measure", "DEFAULT_EPS Measurement measure_windows convergence_depth per_loop_summary "
                                  "depth_summary eps_sensitivity kl_concentration oscillating_tokens"),
    ("drc_core.analysis.tokens", "classify_sequence class_depth_summary"),
    ("drc_core.analysis.loops", "iterate_stats"),
    ("drc_core.analysis.intervals", "bootstrap_ci cluster_draws"),
    # what each token's state does (dynamics classes, commit loop, overthinking)
    ("drc_core.analysis.dynamics", "Dynamics classify class_shares group_shares norm_percentiles commit_loop "
                                   "overthinks"),
    # halting rules and the paths that run them
    ("drc_core.halting.rules", "make_rule RULE_FAMILIES HaltingRule huginn_presets"),
    ("drc_core.halting.reference", "masked_forward measured_exits"),
    ("drc_core.halting.skipping", "skip_forward"),
    ("drc_core.halting.continuous", "generate_continuous ContinuousResult"),
    ("drc_core.halting.generate", "generate_ids=generate generate_fixed GenerationResult"),
    # sweeps: quality against depth per rule family, matched quality, loops saved
    ("drc_core.halting.sweep", "RuleSpec default_rules default_families state_families ROUTER_FAMILIES sweep "
                               "summarize OfflinePass offline_pass offline_pass_and_measure token_exits uniform_ce "
                               "window_clusters matching_table gap_table online_vs_offline calibration_table "
                               "matching_depth"),
    # learned routers
    ("drc_core.halting.router", "family_title trained_router_specs split_windows"),
    # thresholds with a guarantee (Learn then Test) and whether it holds
    ("drc_core.halting.calibrate", "CalibratedRule Certificate min_units learn_then_test unit_risks loss_tables "
                                   "pass_loss_tables validity validity_summary"),
    # the allocator policy of a process: bounded memory (what trace applies) or freed buffers kept (for timing)
    ("drc_core.heap", "KEEP_FREED_BYTES keep_freed_memory bound_freed_memory"),
    # errors: one-line messages, the validators, the CLI wrapper and parser every command uses
    ("drc_core.errors", "DrcError Interrupted need_int need_float run_cli ArgumentParser first_line"),
    # files: atomic writes, size-bounded reads, no writing through links, one writer at a time
    ("drc_core.guard", "write_file read_regular read_json parse_json refuse_links exclusive"),
    # the depth explorer
    ("drc_core.explorer", "DepthExplorer depth_slider_figure token_strip_html"),
)
# the public API: name -> "module" (its attribute of the same name) or "module:attr"
_EXPORTS = {name: module + (f":{attr}" if attr else "") for module, names in _GROUPS
            for name, _, attr in (item.partition("=") for item in names.split())}
# public modules: ``from drc_core import plotting`` (the look the explorer and the book's figures share)
_MODULES = {"plotting": "drc_core.plotting"}


def _rule_classes() -> dict[str, type]:
    """The registered rule classes, exported under their names."""
    return importlib.import_module("drc_core.halting.rules").rule_classes()


def __getattr__(name: str) -> Any:
    if name == "__all__":  # computed on use: the registry may grow (and importing it here would load torch)
        return sorted({*_EXPORTS, *_MODULES, *_rule_classes()})
    if name in _MODULES or name in _EXPORTS:
        where, _, attr = (_MODULES.get(name) or _EXPORTS[name]).partition(":")
        try:
            module = importlib.import_module(where)
        except ImportError as exc:  # the explorer and plotting need the book extras (plotly, ipywidgets)
            from drc_core.errors import DrcError

            raise DrcError(f"drc_core.{name} needs the book extras ({exc}): pip install 'drc-book[book]'") from None
        if name in _MODULES:
            return module
        value = getattr(module, attr or name)
        globals()[name] = value
        return value
    # a dunder or a submodule (``from drc_core import errors`` asks here first) is not looked up in the registry,
    # which would load torch and the halting layer
    submodules = {m.name for m in pkgutil.iter_modules(__path__)}
    if not name.startswith("__") and name not in submodules and name in (classes := _rule_classes()):
        return classes[name]  # not cached: unregister_rule takes it back
    raise AttributeError(f"module 'drc_core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_MODULES, *_rule_classes()})
