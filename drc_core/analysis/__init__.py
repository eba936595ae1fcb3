"""The analysis layer: per-loop statistics (``loops``), per-token x loop measurements, convergence
depth and bootstrap intervals (``measure``), token types (``tokens``). Imports data, model and training
only."""
