"""GPU benchmarks of loka_train that write machine-readable results.

Each benchmark is a module run from the repository root, e.g. ``python -m bench.e2e --help``;
most have a ``--dry-run`` that checks them on a CPU in seconds. ``e2e`` trains the real jobs
against bf16, FP8 everywhere and torchao; ``gemm``, ``dispatch``, ``mods``, ``comm`` and
``probe_overhead`` measure one part each; ``device_h100.sh`` and ``device_x2.sh`` run them on
the lent GPU machines. What was run, and what it gave, is under ``bench/results/``.
"""
