"""drc_core: depth-recurrent transformers and per-token convergence measurements."""

__version__ = "0.1.0"
