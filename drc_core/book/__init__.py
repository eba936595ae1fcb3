"""Layer 6, the book: the papermill runner and Jupyter Book build (``runner``; ``python -m drc_core.book``),
how a failed, interrupted or killed notebook's outputs are undone (``rollback``), where a profile's corpus,
model and results live (``workspace``), how the notebooks' path parameters resolve from any working directory
and where interactive runs write (``paths``), figures and the depth explorer (``viz``)."""
