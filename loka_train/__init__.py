"""loka_train: FP8 that is measured safe and fast, for TorchRec DLRM training.

The plugin follows LoKA (Probe, Mods, Dispatch): it measures per-GEMM statistics while the
job runs, applies FP8 only where it is safe and fast, and re-decides as statistics drift.
"""

__version__ = "0.1.0"
