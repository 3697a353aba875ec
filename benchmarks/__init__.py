"""recsys benchmarks: one module per topic, run from the repository root as
``python -m benchmarks.<topic>`` (``make bench`` runs them all), each appending its rows to
``benchmarks/results/<topic>.csv`` through the shared harness :mod:`benchmarks._harness`.

The ``_``-prefixed modules are helpers of the topic modules, not benchmarks. This package is
not installed with recsys (``pyproject.toml`` packages only ``recsys*``); it imports recsys
like any user code does.
"""
