"""drc_core: depth-recurrent transformers and per-token convergence measurements.

The public API, importable from here (each name is loaded on first use, so ``python -m drc_core.training.train``
does not import the analysis and plotting layers):

- :func:`load` a run or shipped directory -> :class:`Model` (model, tokenizer, training config), with
  :meth:`Model.trace` and :meth:`Model.generate`;
- :func:`trace` a text or ids through L loops -> :class:`Trace` (per token x loop successive KL, KL to the
  deepest loop, state change, entropy, CE; token strings; convergence depth at any eps; ``to_frame``,
  ``explorer``);
- :func:`generate` from a prompt string with per-token halting -> :class:`Generation`;
- halting rules by short name (:func:`make_rule`, :data:`RULE_FAMILIES`) and the rule classes;
- :class:`DepthRecurrentLM`, :class:`ModelConfig`, :func:`open_run`, :class:`DrcError`;
- :class:`RecurrentModel`, the protocol a model of your own implements to use the analysis and halting code,
  and :func:`iterate`, the loop they all run.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load": "drc_core.api",
    "trace": "drc_core.api",
    "generate": "drc_core.api",
    "Model": "drc_core.api",
    "Trace": "drc_core.api",
    "Generation": "drc_core.api",
    "make_rule": "drc_core.halting.rules",
    "RULE_FAMILIES": "drc_core.halting.rules",
    "HaltingRule": "drc_core.halting.rules",
    "KLThreshold": "drc_core.halting.rules",
    "StateDelta": "drc_core.halting.rules",
    "EntropyDelta": "drc_core.halting.rules",
    "Cosine": "drc_core.halting.rules",
    "ArgmaxPatience": "drc_core.halting.rules",
    "SoftmaxConfidence": "drc_core.halting.rules",
    "Uniform": "drc_core.halting.rules",
    "Never": "drc_core.halting.rules",
    "masked_forward": "drc_core.halting.rules",
    "skip_forward": "drc_core.halting.skipping",
    "DepthRecurrentLM": "drc_core.model.lm",
    "ModelConfig": "drc_core.model.lm",
    "RecurrentModel": "drc_core.model.lm",
    "iterate": "drc_core.model.lm",
    "open_run": "drc_core.training.rundir",
    "DrcError": "drc_core.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'drc_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
