"""drc_book: the study beside the notebooks in ``book/``: the runner (``python -m drc_book``) and workspaces, the
figures, the records the notebooks pass on, the reproduction report, and the measurements (one module each)."""
