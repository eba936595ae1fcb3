"""The training layer: configs and presets, the run directory, training and evaluation.

- :mod:`~drc_core.training.config`: :class:`TrainConfig`, the presets and typed ``--set`` overrides;
- :mod:`~drc_core.training.rundir`: the one owner of the run-directory format (:func:`open_run`);
- :mod:`~drc_core.training.train`: ``python -m drc_core.training.train`` (resumable, exact resume);
- :mod:`~drc_core.training.evaluate`: ``python -m drc_core.training.evaluate`` (CE and successive KL by depth).

Imports only from the model, data and base layers.
"""
