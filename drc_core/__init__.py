"""drc_core: depth-recurrent transformers and per-token convergence measurements.

The public API, importable from here (each name is loaded on first use, so ``python -m drc_core.training.train``
does not import the analysis and plotting layers):

- :func:`load` a run or shipped directory -> :class:`Model` (model, tokenizer, training config), with
  :meth:`Model.trace` and :meth:`Model.generate`;
- :func:`trace` a text or ids through L loops -> :class:`Trace` (per token x loop successive KL, KL to the
  deepest loop, state change, entropy, CE; token strings; convergence depth at any eps; ``to_frame``,
  ``explorer``);
- :func:`generate` from a prompt string with per-token halting -> :class:`Generation`;
- :func:`calibrate` a halting rule's threshold on documents with a stated guarantee (Learn then Test) ->
  :class:`CalibratedRule` (the rule and its printable :class:`Certificate`);
- halting rules by short name (:func:`make_rule`, :data:`RULE_FAMILIES`) and the rule classes: every class of
  the registry in :mod:`drc_core.halting.rules` (:func:`~drc_core.halting.rules.rule_classes`, the oracle
  included), looked up there on each use, so a rule defined later is exported too;
- the per-token depth explorer: :class:`DepthExplorer` (live, ipywidgets), :func:`depth_slider_figure` (static,
  a plotly slider) and :func:`token_strip_html` (one loop as coloured text), and :mod:`plotting`, the look it
  shares with the book's figures;
- :class:`DepthRecurrentLM`, :class:`ModelConfig`, :func:`open_run`, :class:`DrcError`;
- :class:`RecurrentModel`, the protocol a model of your own implements to use the analysis and halting code,
  and :func:`iterate`, the loop they all run.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

__version__ = "0.1.0"

# The public API: every name a user (and the book) imports from drc_core, in one place, grouped by what it is for.
# "module" exports the module's attribute of the same name; "module:attr" exports another attribute under this name.
_EXPORTS = {
    # load a model, trace text through its loops, generate with halting, calibrate a rule
    "load": "drc_core.api",
    "trace": "drc_core.api",
    "generate": "drc_core.api",
    "calibrate": "drc_core.api",
    "document_windows": "drc_core.api",
    "Model": "drc_core.api",
    "Trace": "drc_core.api",
    "Generation": "drc_core.api",
    # the model and its loop
    "DepthRecurrentLM": "drc_core.model.lm",
    "HuginnLM": "drc_core.model.huginn",
    "ModelConfig": "drc_core.model.config",
    "RecurrenceConfig": "drc_core.model.recurrence",
    "RecurrentModel": "drc_core.model.lm",
    "iterate": "drc_core.model.lm",
    "logits_at": "drc_core.model.lm",
    "bf16_support": "drc_core.model.precision",
    "machine_kind": "drc_core.model.precision",
    "check_token_ids": "drc_core.model.checks",
    "eval_batches": "drc_core.model.passes",
    "EVAL_STATE_SEED": "drc_core.model.passes",
    "kl_successive": "drc_core.model.passes",
    "AndersonConfig": "drc_core.model.anderson",
    "PLAIN_ITERATION": "drc_core.model.anderson:PLAIN",
    "anderson_iterate": "drc_core.model.anderson",
    "evals_to_converge": "drc_core.model.anderson",
    # data: prepared corpora, their validation windows, the generated known-depth documents
    "Corpus": "drc_core.data.sampler",
    "eot_id": "drc_core.data.tokenizer",
    "val_windows_with_docs": "drc_core.analysis.measure",
    "DepthTaskConfig": "drc_core.data.depth_tasks",
    "generate_document": "drc_core.data.depth_tasks",
    "DEPTH_TASK_SOURCE": "drc_core.data.depth_tasks:SOURCE_NAME",
    "token_labels": "drc_core.data.depth_tasks",
    "read_labels": "drc_core.data.labels",
    "SourceSpec": "drc_core.data.sources",
    "PrepareConfig": "drc_core.data.prepare",
    "prepare": "drc_core.data.prepare",
    # training runs and their evaluation
    "open_run": "drc_core.training.rundir",
    "WEIGHTS_FILE": "drc_core.model.lm",  # a run directory's layout: the file and folder names open_run reads
    "METRICS_FILE": "drc_core.training.rundir",
    "SHIPPED_TRAIN_CONFIG": "drc_core.training.rundir",
    "FINAL_DIR": "drc_core.training.rundir",
    "CHECKPOINTS_DIR": "drc_core.training.rundir",
    "TrainConfig": "drc_core.training.config",
    "train": "drc_core.training.train",
    "preset_for": "drc_core.training.train",
    "loss_by_depth": "drc_core.training.evaluate",
    "loss_by_source": "drc_core.training.evaluate",
    "unigram_loss": "drc_core.training.evaluate",
    "depth_gain_by_step": "drc_core.training.evaluate",
    # per-token x loop measurement and its summaries
    "DEFAULT_EPS": "drc_core.analysis.measure",
    "Measurement": "drc_core.analysis.measure",
    "measure_windows": "drc_core.analysis.measure",
    "convergence_depth": "drc_core.analysis.measure",
    "per_loop_summary": "drc_core.analysis.measure",
    "depth_summary": "drc_core.analysis.measure",
    "eps_sensitivity": "drc_core.analysis.measure",
    "kl_concentration": "drc_core.analysis.measure",
    "oscillating_tokens": "drc_core.analysis.measure",
    "classify_sequence": "drc_core.analysis.tokens",
    "class_depth_summary": "drc_core.analysis.tokens",
    "iterate_stats": "drc_core.analysis.loops",
    "bootstrap_ci": "drc_core.analysis.intervals",
    "cluster_draws": "drc_core.analysis.intervals",
    # what each token's state does (dynamics classes, commit loop, overthinking)
    "Dynamics": "drc_core.analysis.dynamics",
    "classify": "drc_core.analysis.dynamics",
    "class_shares": "drc_core.analysis.dynamics",
    "group_shares": "drc_core.analysis.dynamics",
    "norm_percentiles": "drc_core.analysis.dynamics",
    "commit_loop": "drc_core.analysis.dynamics",
    "overthinks": "drc_core.analysis.dynamics",
    # halting rules and the paths that run them
    "make_rule": "drc_core.halting.rules",
    "RULE_FAMILIES": "drc_core.halting.rules",
    "HaltingRule": "drc_core.halting.rules",
    "masked_forward": "drc_core.halting.reference",
    "measured_exits": "drc_core.halting.reference",
    "skip_forward": "drc_core.halting.skipping",
    "generate_continuous": "drc_core.halting.continuous",
    "ContinuousResult": "drc_core.halting.continuous",
    "generate_ids": "drc_core.halting.generate:generate",
    "generate_fixed": "drc_core.halting.generate",
    "GenerationResult": "drc_core.halting.generate",
    "huginn_presets": "drc_core.halting.rules",
    # sweeps: quality against depth per rule family, matched quality, loops saved
    "RuleSpec": "drc_core.halting.sweep",
    "default_rules": "drc_core.halting.sweep",
    "default_families": "drc_core.halting.sweep",
    "state_families": "drc_core.halting.sweep",
    "ROUTER_FAMILIES": "drc_core.halting.sweep",
    "family_title": "drc_core.halting.router",
    "sweep": "drc_core.halting.sweep",
    "summarize": "drc_core.halting.sweep",
    "OfflinePass": "drc_core.halting.sweep",
    "offline_pass": "drc_core.halting.sweep",
    "token_exits": "drc_core.halting.sweep",
    "uniform_ce": "drc_core.halting.sweep",
    "window_clusters": "drc_core.halting.sweep",
    "matching_table": "drc_core.halting.sweep",
    "gap_table": "drc_core.halting.sweep",
    "online_vs_offline": "drc_core.halting.sweep",
    "calibration_table": "drc_core.halting.sweep",
    "matching_depth": "drc_core.halting.sweep",
    # learned routers
    "trained_router_specs": "drc_core.halting.router",
    "split_windows": "drc_core.halting.router",
    # thresholds with a guarantee (Learn then Test) and whether it holds
    "CalibratedRule": "drc_core.halting.calibrate",
    "Certificate": "drc_core.halting.calibrate",
    "min_units": "drc_core.halting.calibrate",
    "learn_then_test": "drc_core.halting.calibrate",
    "unit_risks": "drc_core.halting.calibrate",
    "loss_tables": "drc_core.halting.calibrate",
    "pass_loss_tables": "drc_core.halting.calibrate",
    "validity": "drc_core.halting.calibrate",
    "validity_summary": "drc_core.halting.calibrate",
    # the allocator policy of a process: bounded memory (what trace applies) or freed buffers kept (for timing)
    "KEEP_FREED_BYTES": "drc_core.heap",
    "keep_freed_memory": "drc_core.heap",
    "bound_freed_memory": "drc_core.heap",
    # errors: one-line messages, the validators, the CLI wrapper and parser every command uses
    "DrcError": "drc_core.errors",
    "Interrupted": "drc_core.errors",
    "need_int": "drc_core.errors",
    "need_float": "drc_core.errors",
    "run_cli": "drc_core.errors",
    "ArgumentParser": "drc_core.errors",
    "first_line": "drc_core.errors",
    # files: atomic writes, size-bounded reads, no writing through links, one writer at a time
    "write_file": "drc_core.guard",
    "read_regular": "drc_core.guard",
    "read_json": "drc_core.guard",
    "parse_json": "drc_core.guard",
    "refuse_links": "drc_core.guard",
    "exclusive": "drc_core.guard",
    # the depth explorer
    "DepthExplorer": "drc_core.explorer",
    "depth_slider_figure": "drc_core.explorer",
    "token_strip_html": "drc_core.explorer",
}
# public modules: ``from drc_core import plotting`` (the look the explorer and the book's figures share)
_MODULES = {"plotting": "drc_core.plotting"}

_RULES = "drc_core.halting.rules"  # its rule_classes(): the registered rule classes, exported under their names


def _rule_classes() -> dict[str, type]:
    return importlib.import_module(_RULES).rule_classes()


def _submodules() -> set[str]:
    return {m.name for m in pkgutil.iter_modules(__path__)}


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
    if not name.startswith("__") and name not in _submodules() and name in (classes := _rule_classes()):
        return classes[name]  # not cached: unregister_rule takes it back
    raise AttributeError(f"module 'drc_core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_MODULES, *_rule_classes()})
