"""The model layer: the depth-recurrent network and what a forward pass needs.

- :mod:`~drc_core.model.lm`: :class:`DepthRecurrentLM`, the :class:`RecurrentModel` protocol a model of your own
  implements, :func:`iterate` (the loop everything runs) and :func:`load_state`;
- :mod:`~drc_core.model.config`: :class:`ModelConfig`, the model's hyper-parameters, checked when built;
- :mod:`~drc_core.model.blocks`: the transformer block (RoPE attention, SwiGLU) and :class:`FrozenKV`;
- :mod:`~drc_core.model.checks`: the one-line checks of token ids and initial states every pass starts with;
- :mod:`~drc_core.model.recurrence`: the random training depth (:class:`RecurrenceConfig`, its sampler);
- :mod:`~drc_core.model.precision`: bf16 autocast and compiled blocks, chosen per device;
- :mod:`~drc_core.model.passes`: evaluation batches with a fixed initial state and the successive KL;
- :mod:`~drc_core.model.anderson`: Anderson acceleration and damping of the core iteration (a fixed-point solver
  beside :func:`iterate`).

Imports only from ``drc_core.errors`` and ``drc_core.data`` below it.
"""

from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM, RecurrentModel, iterate, load_state
from drc_core.model.recurrence import RecurrenceConfig

__all__ = ["DepthRecurrentLM", "ModelConfig", "RecurrenceConfig", "RecurrentModel", "iterate", "load_state"]
