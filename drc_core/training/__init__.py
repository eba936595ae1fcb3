"""The training layer: :mod:`~drc_core.training.config` (configs, presets, ``--set``), :mod:`~.rundir` (the run
directory format), :mod:`~.state` (checkpoint training state), :mod:`~.train` and :mod:`~.evaluate` (the CLIs)."""
