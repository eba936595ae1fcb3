"""drc_book: the study's machinery beside the notebooks in ``book/`` (not the library; that is :mod:`drc_core`).

- running the book: ``runner`` (papermill + Jupyter Book; ``python -m drc_book``), ``rollback`` (undoing a failed
  notebook's outputs), ``workspace`` (where a profile's corpus, model and results live), ``paths`` (notebook path
  parameters from any working directory);
- figures: ``viz`` (on :mod:`drc_core.plotting`'s look);
- measurements of the study: ``cost`` (FLOP model), ``speed`` / ``decode_speed`` / ``continuous_speed`` /
  ``speed_checks`` / ``speed_report`` (timing harnesses and tables), ``fixed_point``, ``known_depth`` (the
  controlled-depth experiment), ``handoff`` (records the notebooks pass on) and ``report`` (the reproduction report).
"""
