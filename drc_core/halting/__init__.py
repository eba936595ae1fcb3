"""Layer 4, halting: rules and the masked reference forward (``rules``), the compute-skipping forward
(``skipping``), KV-cached generation with per-token exits (``generate``), learned routers (``router``),
quality-vs-depth sweeps and calibration (``sweep``). Imports the layers below only."""
