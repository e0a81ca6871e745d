"""Shared pytest setup: Triton kernels run in the interpreter on CPU machines."""

import os

import torch

# Triton kernels run on the CPU only through the interpreter; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
