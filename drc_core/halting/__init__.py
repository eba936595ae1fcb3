"""The halting layer: the rules (``rules``), the masked reference forward, offline replay and the oracle
(``reference``), the compute-skipping forward
(``skipping``, built from ``kvlayout``, ``loopstats`` and ``work``), KV-cached generation with per-token exits
(``generate``) and with continuous depth batching (``continuous``), learned routers (``router``),
quality-vs-depth sweeps and calibration (``sweep``). Imports the layers below only."""
