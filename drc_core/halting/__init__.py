"""Layer 4, halting: rules and the masked reference forward (``rules``), the compute-skipping forward
(``skipping``, built from ``kvlayout``, ``loopstats`` and ``work``), KV-cached generation with per-token exits
(``generate``) and with continuous depth batching (``continuous``), learned routers (``router``),
quality-vs-depth sweeps and calibration (``sweep``). Imports the layers below only."""
