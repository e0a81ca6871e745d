"""GEMM backends the CPU tests register: the emulated oracle behind another capability."""

from __future__ import annotations

from typing import Any


class Aligned16:
    """A CPU backend that, like CUTLASS, refuses K or N not divisible by 16 (the emulated GEMM
    behind it)."""

    name = "aligned16"

    def supports(self, problem: Any) -> tuple[bool, str]:
        ok = problem.device_type == "cpu" and problem.k % 16 == 0 and problem.n % 16 == 0
        return ok, "" if ok else "K and N must be multiples of 16"

    def __call__(self, a_q: Any, b_q: Any, *, out_dtype: Any, bias: Any = None, fast_accum: bool = False) -> Any:
        from loka_train.kernels.registry import get_backend

        return get_backend("emulated")(a_q, b_q, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum)
