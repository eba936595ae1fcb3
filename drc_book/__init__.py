"""drc_book: the study's machinery beside the notebooks in ``book/`` (the library is :mod:`drc_core`).

- running the book: ``runner`` (``python -m drc_book``), ``rollback``, ``workspace``, ``paths``;
- figures: ``viz``; records the notebooks pass on: ``handoff``; the reproduction report: ``report``;
- measurements: ``cost`` (FLOP model, timer), ``speed`` (timing harness), ``speed_checks``, ``fixed_point``,
  ``guarantee``, ``convergence``, ``known_depth`` (the controlled-depth experiment).
"""
