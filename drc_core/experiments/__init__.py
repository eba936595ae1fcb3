"""Layer 5, experiments: FLOP proxy vs wall-clock (``speed``), the reproduction report (``report``).
Imports the layers below only."""
