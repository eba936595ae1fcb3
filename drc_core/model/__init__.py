"""The model layer: :class:`DepthRecurrentLM`, the :class:`RecurrentModel` protocol and :func:`iterate` (``lm``), its
config, blocks and input checks, the training depth (``recurrence``), the numeric path (``precision``), evaluation
passes (``passes``) and Anderson acceleration (``anderson``). Imports only from ``drc_core.errors`` below it."""

from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM, RecurrentModel, iterate, load_state
from drc_core.model.recurrence import RecurrenceConfig

__all__ = ["DepthRecurrentLM", "ModelConfig", "RecurrenceConfig", "RecurrentModel", "iterate", "load_state"]
