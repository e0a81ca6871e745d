"""FP8 GEMM benchmark for recommendation-model shapes (issue 3).

Measures, for M in {2048, 8192, 32768} and (K, N) in {(256,256), (512,512), (1024,1024),
(2048,2048), (4096,4096), (1024,256), (512,2048)}:

  (a) each GEMM role of a linear layer (forward y = x W^T, grad-input dX = dY W, grad-weight
      dW = dY^T X) in bf16 (cuBLAS) and with every FP8 backend, operands pre-quantized;
  (b) each quantizer alone (eager reference, fused Triton, FBGEMM), and the fused
      LayerNorm + quantize kernel next to a plain bf16 LayerNorm;
  (c) the block LayerNorm -> Linear -> ReLU, forward + backward, in bf16 and in FP8 with
      quantization fused into the LayerNorm / ReLU-backward kernels and the bias + ReLU in the
      FP8 GEMM epilogue.

Writes ``gemm.json`` (every measurement, device, versions, command) and ``gemm.md`` (tables) to
``--out``. Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between
repetitions), in microseconds.

Usage:
    python -m bench.gemm --out bench/results/h100         # full run (~7-8 min on an H100)
    python -m bench.gemm --out /tmp/b --quick             # M = 8192, 3 shapes
    python -m bench.gemm --out /tmp/b --dry-run           # CPU, tiny shapes, interpreter

The full grid autotunes the Triton GEMM for ~170 shape keys (10 configs each, ~0.13 s per
config), compiles ~60 kernel variants and takes ~950 timed measurements (~0.13 s each): too
long for one ~3 min device call. Run it in parts into one ``--out`` with ``--append`` (each call
merges its rows into the existing gemm.json and rewrites gemm.md; results are also rewritten
after every (part, M), so a call stopped by a time limit keeps what it measured). Each of
these takes ~1.5-2.5 min on an H100 (the first one compiles most kernels):
    python -m bench.gemm --out R --parts a --ms 2048
    python -m bench.gemm --out R --parts a --ms 8192 --append
    python -m bench.gemm --out R --parts a --ms 32768 --append
    python -m bench.gemm --out R --parts b --append
    python -m bench.gemm --out R --parts c --append
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.gemm_report import Row, environment, load_previous, merge_previous, write_report

logger = logging.getLogger("bench.gemm")

FULL_MS = (2048, 8192, 32768)
FULL_KN = ((256, 256), (512, 512), (1024, 1024), (2048, 2048), (4096, 4096), (1024, 256), (512, 2048))
QUICK_MS = (8192,)
QUICK_KN = ((512, 512), (1024, 1024), (4096, 4096))
DRY_MS = (64,)
DRY_KN = ((32, 32), (64, 32))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="directory for gemm.json and gemm.md")
    p.add_argument("--quick", action="store_true", help="M=8192 and 3 (K, N) shapes")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter: checks the script")
    p.add_argument("--parts", default="abc", help="which parts to run, subset of 'abc'")
    p.add_argument("--ms", type=str, default=None, help="comma-separated M values (overrides)")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench rep time per measurement (ms)")
    p.add_argument("--append", action="store_true",
                   help="merge into the gemm.json already in --out (rows of other parts / M values are "
                        "kept, re-measured ones replaced): runs the full grid in several calls")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing, profile the (c) block variants (torch.profiler) into profile.txt")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------ timing


class Timer:
    """do_bench on CUDA; a plain wall clock on CPU (dry runs only)."""

    def __init__(self, device: str, rep_ms: int):
        self.device = device
        self.rep_ms = rep_ms

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()  # compile / autotune outside the timed region
        if self.device == "cuda":
            import torch
            import triton.testing

            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=25, rep=self.rep_ms, return_mode="median")
            return 1000.0 * ms
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)


def _measure(rows: list[Row], timer: Timer, row: Row, fn: Callable[[], object]) -> None:
    try:
        row.us = timer(fn)
    except Exception as e:  # record and continue: one broken variant must not lose the run
        logger.exception("failed: %s", row)
        row.skipped = f"error: {type(e).__name__}: {e}"[:300]
    rows.append(row)


# ------------------------------------------------------------------------------------ (a)

GEMM_VARIANTS = (
    # (label, backend, scaling, fast_accum)
    ("scaled_mm/tensorwise+fast", "torch_scaled_mm", "tensorwise", True),
    ("scaled_mm/rowwise", "torch_scaled_mm", "rowwise", False),
    ("scaled_mm/rowwise+fast", "torch_scaled_mm", "rowwise", True),
    ("scaled_mm/block", "torch_scaled_mm", "block", False),
    ("fbgemm/rowwise+fast", "fbgemm_rowwise", "rowwise", True),
    ("triton/rowwise", "triton", "rowwise", False),
    ("triton/rowwise+fast", "triton", "rowwise", True),
)


def _bench_gemm_role(rows, timer, m, k, n, role, a_hp, b_hp, bf16_fn):
    """One role at one shape: the bf16 baseline and every FP8 variant (``a @ b^T``)."""
    import torch

    from loka_train.kernels.formats import Fp8Format, Scaling, quantize
    from loka_train.kernels.gemm import GemmProblem
    from loka_train.kernels.registry import get_backend

    bf16 = torch.bfloat16
    gemm = [a_hp.shape[0], a_hp.shape[1], b_hp.shape[0]]
    _measure(rows, timer, Row("a", "bf16", m, k, n, role, extra={"gemm": gemm}), bf16_fn)
    a_hp, b_hp = a_hp.contiguous(), b_hp.contiguous()
    for label, backend_name, scaling_name, fast in GEMM_VARIANTS:
        scaling = Scaling(scaling_name)
        # Hybrid recipe: gradients in e5m2; FBGEMM takes e4m3 only.
        fmt_a = Fp8Format.E4M3
        if role != "forward" and backend_name != "fbgemm_rowwise":
            fmt_a = Fp8Format.E5M2
        row = Row("a", label, m, k, n, role, extra={"fmt": f"{fmt_a.value}xe4m3", "gemm": gemm})
        a_q = quantize(a_hp, fmt_a, scaling)
        # Weights (forward, grad-input) in 128x128 tiles under block scaling.
        b_q = quantize(b_hp, Fp8Format.E4M3, scaling,
                       block_2d=scaling is Scaling.BLOCK and role != "grad_weight")
        backend = get_backend(backend_name)
        prob = GemmProblem.from_operands(a_q, b_q, out_dtype=bf16, role=role, fast_accum=fast)
        ok, why = backend.supports(prob)
        if not ok:
            row.skipped = why
            rows.append(row)
            continue

        def run(backend=backend, a_q=a_q, b_q=b_q, fast=fast):
            return backend(a_q, b_q, out_dtype=bf16, fast_accum=fast)

        _measure(rows, timer, row, run)


def _bench_gemm_shape(rows, timer, device, m, k, n):
    import torch

    bf16 = torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=bf16)
    w = torch.randn(n, k, device=device, dtype=bf16) / k**0.5
    dy = torch.randn(m, n, device=device, dtype=bf16)
    _bench_gemm_role(rows, timer, m, k, n, "forward", x, w, lambda: torch.mm(x, w.t()))
    _bench_gemm_role(rows, timer, m, k, n, "grad_input", dy, w.t(), lambda: torch.mm(dy, w))
    _bench_gemm_role(rows, timer, m, k, n, "grad_weight", dy.t(), x.t(), lambda: torch.mm(dy.t(), x))


def bench_gemms(ms, kns, device, timer, rows):
    for m in ms:
        for k, n in kns:
            _bench_gemm_shape(rows, timer, device, m, k, n)


# ------------------------------------------------------------------------------------ (b)


def _bench_quant_shape(rows, timer, device, m, k, fbgemm):
    import torch
    import torch.nn.functional as F

    from loka_train.kernels import triton_block as tb
    from loka_train.kernels import triton_kernels as tk
    from loka_train.kernels import triton_layernorm as tln
    from loka_train.kernels import triton_tensorwise as tt
    from loka_train.kernels.formats import Fp8Format, Scaling, quantize

    e4m3 = Fp8Format.E4M3
    fbgemm_ok, fbgemm_why = fbgemm
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    lnw = torch.ones(k, device=device, dtype=torch.bfloat16)
    lnb = torch.zeros(k, device=device, dtype=torch.bfloat16)
    nbytes = {"read": x.numel() * 2, "write_fp8": x.numel()}
    amax = x.float().abs().amax().reshape(1)
    dy = torch.randn_like(x)
    _, a_mean, a_rstd = torch.native_layer_norm(x, [k], lnw, lnb, 1e-5)
    # The kernel takes fp32 (M,) statistics (CPU LayerNorm keeps them in x's dtype).
    mean, rstd = a_mean.float().reshape(-1), a_rstd.float().reshape(-1)
    cases: list[tuple[str, Callable[[], object] | None, str | None]] = [
        ("eager/tensorwise", lambda: quantize(x, e4m3, Scaling.TENSORWISE), None),
        ("eager/rowwise", lambda: quantize(x, e4m3, Scaling.ROWWISE), None),
        ("eager/block1x128", lambda: quantize(x, e4m3, Scaling.BLOCK), None),
        ("eager/mx", lambda: quantize(x, e4m3, Scaling.MX), None),
        ("triton/rowwise", lambda: tk.fused_rowwise_quant(x, fmt=e4m3), None),
        ("triton/tensorwise", lambda: tt.tensorwise_quant(x, fmt=e4m3), None),
        # Also writes x^T (FP8, contiguous) for the backward GEMM that takes the payload over.
        ("triton/tensorwise, both layouts", lambda: tt.tensorwise_quant_both(x, fmt=e4m3), None),
        ("fbgemm/rowwise",
         (lambda: torch.ops.fbgemm.quantize_fp8_per_row(x)) if fbgemm_ok else None,
         None if fbgemm_ok else fbgemm_why),
        ("bf16 layernorm (reference)", lambda: F.layer_norm(x, (k,), lnw, lnb), None),
        ("triton/layernorm+rowwise (+bf16 out)",
         lambda: tk.fused_rowwise_quant(x, fmt=e4m3, layernorm=True, ln_weight=lnw, ln_bias=lnb,
                                        return_hp=True), None),
        ("eager layernorm then rowwise",
         lambda: quantize(F.layer_norm(x, (k,), lnw, lnb), e4m3, Scaling.ROWWISE), None),
        # x^T quantized (the grad-weight / grad-input operands): from a transposed copy, as the
        # path before triton_block did, or straight from x.
        ("copy x^T then triton/rowwise",
         (lambda: tk.fused_rowwise_quant(x.t().contiguous(), fmt=e4m3)) if m <= tk.MAX_QUANT_ROW else None,
         None if m <= tk.MAX_QUANT_ROW else f"rows of x^T (M={m}) exceed the row kernel's {tk.MAX_QUANT_ROW}"),
        ("triton/transposed rowwise", lambda: tb.transposed_quant(x, fmt=e4m3, per_column=True), None),
        ("triton/transposed tensorwise (amax given)", lambda: tb.transposed_quant(x, fmt=e4m3, amax=amax), None),
        ("triton/transposed tensorwise + colsum",
         lambda: tb.transposed_quant(x, fmt=e4m3, amax=amax, return_colsum=True), None),
        ("bf16 colsum (reference)", lambda: x.sum(0), None),
        # LayerNorm's backward (dx, dw, db), which the block runs next to the quantizers.
        ("aten layernorm backward (reference)",
         lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [k], a_mean, a_rstd, lnw, lnb, [True] * 3), None),
        ("triton/layernorm backward", lambda: tln.layernorm_backward(dy, x, mean, rstd, lnw), None),
    ]
    for name, fn, why in cases:
        row = Row("b", name, m, k, 0, extra=dict(nbytes))
        if fn is None:
            row.skipped = why
            rows.append(row)
            continue
        _measure(rows, timer, row, fn)


def bench_quantizers(ms, kns, device, timer, rows):
    from loka_train.kernels.backends import _fbgemm_genai_ops

    fbgemm = (False, "CUDA only") if device != "cuda" else _fbgemm_genai_ops()
    for m in ms:
        for k in sorted({k for k, _ in kns}):
            _bench_quant_shape(rows, timer, device, m, k, fbgemm)


# ------------------------------------------------------------------------------------ (c)


def block_plans() -> dict:
    """The FP8 plans benchmarked for the block. Quantization is fused in all of them."""
    from loka_train.kernels.formats import Fp8Format, Scaling
    from loka_train.kernels.plan import GemmPlan, LinearPlan, Precision

    e4m3, e5m2 = Fp8Format.E4M3, Fp8Format.E5M2

    def fp8(backend, fmt, fmt_b=None, fast=False, scaling=Scaling.ROWWISE):
        return GemmPlan(precision=Precision.FP8, fmt=fmt, fmt_b=fmt_b, backend=backend,
                        fast_accum=fast, scaling=scaling)

    hp = GemmPlan()
    fwd = fp8("triton", e4m3, fast=True)  # Triton GEMM, bias + activation in its epilogue
    gi = fp8("torch_scaled_mm", e5m2, e4m3)  # cuBLAS row-wise, precise accumulation
    # Grad-weight contracts over M: its operands dZ^T and H^T come from the transposing
    # quantizer, tensor-wise with the amaxes the fused LayerNorm / ReLU-backward kernels
    # computed on the way (H^T recomputed from x: H is never written) ...
    gw_tw = fp8("torch_scaled_mm", e5m2, e4m3, fast=True, scaling=Scaling.TENSORWISE)
    return {
        "fp8": LinearPlan(forward=fwd, grad_input=gi, grad_weight=gw_tw),
        "fp8 precise-wgrad": LinearPlan(forward=fwd, grad_input=gi,
                                        grad_weight=fp8("torch_scaled_mm", e5m2, e4m3,
                                                        scaling=Scaling.TENSORWISE)),
        # ... or row-wise (one scale per column of dZ / H: a column-amax pass first).
        "fp8 rowwise-wgrad": LinearPlan(forward=fwd, grad_input=gi,
                                        grad_weight=fp8("torch_scaled_mm", e5m2, e4m3, fast=True)),
        "fp8 bf16-wgrad": LinearPlan(forward=fwd, grad_input=gi, grad_weight=hp),
        "fp8 cublas bf16-wgrad": LinearPlan(forward=fp8("torch_scaled_mm", e4m3, fast=True),
                                            grad_input=gi, grad_weight=hp),
    }


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture ``fn`` (already warmed up: autotuned) in a CUDA graph; return its replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _bench_block_shape(rows, timer, device, m, k, n, plans):
    import torch
    import torch.nn.functional as F

    from loka_train.kernels.formats import sqnr_db
    from loka_train.kernels.fused import layernorm_linear

    bf16 = torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=bf16, requires_grad=True)
    lnw = torch.ones(k, device=device, dtype=bf16, requires_grad=True)
    lnb = torch.zeros(k, device=device, dtype=bf16, requires_grad=True)
    w = (torch.randn(n, k, device=device, dtype=bf16) / k**0.5).requires_grad_(True)
    b = torch.zeros(n, device=device, dtype=bf16, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=bf16)
    leaves = [x, lnw, lnb, w, b]

    def bf16_fwd():
        return F.relu(F.linear(F.layer_norm(x, (k,), lnw, lnb), w, b))

    def bf16_step():
        return torch.autograd.grad(bf16_fwd(), leaves, g)

    def measure_all(name, fwd, step, extra):
        with torch.no_grad():
            _measure(rows, timer, Row("c", name, m, k, n, "forward", extra=extra), fwd)
        _measure(rows, timer, Row("c", name, m, k, n, "fwd+bwd", extra=extra), step)
        if device == "cuda":
            # Eager timings include the host's launch overhead (large on the lent VMs); the CUDA
            # graph replay shows the GPU time a compiled / graphed training step would see.
            row = Row("c", name, m, k, n, "fwd+bwd graph", extra=extra)
            try:
                replay = _graphed(step)
            except Exception as e:
                logger.exception("graph capture failed: %s", name)
                row.skipped = f"error: graph capture: {type(e).__name__}: {e}"[:300]
                rows.append(row)
                return
            _measure(rows, timer, row, replay)

    # Numerics of each variant: SQNR (dB) of the output and gradients against the same block
    # in fp32 (one step on these inputs).
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    ref_y = F.relu(F.linear(F.layer_norm(ref_leaves[0], (k,), ref_leaves[1], ref_leaves[2]),
                            ref_leaves[3], ref_leaves[4]))
    ref = [ref_y.detach(), *torch.autograd.grad(ref_y, ref_leaves, g.float())]

    def sqnr(fwd) -> dict:
        y = fwd()
        got = [y.detach(), *torch.autograd.grad(y, leaves, g)]
        names = ("y", "dx", "dln_w", "dln_b", "dw", "db")
        return {nm: round(float(sqnr_db(r, o.float())), 1) for nm, r, o in zip(names, ref, got)}

    measure_all("bf16", bf16_fwd, bf16_step, {"sqnr_db": sqnr(bf16_fwd)})
    for name, plan in plans.items():

        def fwd(plan=plan):
            return layernorm_linear(x, lnw, lnb, w, b, plan, activation="relu")

        def step(fwd=fwd):
            return torch.autograd.grad(fwd(), leaves, g)

        measure_all(name, fwd, step, {"plan": plan.to_dict(), "sqnr_db": sqnr(fwd)})


def bench_block(ms, kns, device, timer, rows):
    plans = block_plans()
    for m in ms:
        for k, n in kns:
            _bench_block_shape(rows, timer, device, m, k, n, plans)


# ------------------------------------------------------------------------------------ profile


def _block_step_fns(device, m, k, n):
    """name -> fwd+bwd callable for the bf16 block and each FP8 plan, at one shape."""
    import torch
    import torch.nn.functional as F

    from loka_train.kernels.fused import layernorm_linear

    bf16 = torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=bf16, requires_grad=True)
    lnw = torch.ones(k, device=device, dtype=bf16, requires_grad=True)
    lnb = torch.zeros(k, device=device, dtype=bf16, requires_grad=True)
    w = (torch.randn(n, k, device=device, dtype=bf16) / k**0.5).requires_grad_(True)
    b = torch.zeros(n, device=device, dtype=bf16, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=bf16)
    leaves = [x, lnw, lnb, w, b]
    fns = {"bf16": lambda: torch.autograd.grad(F.relu(F.linear(F.layer_norm(x, (k,), lnw, lnb), w, b)), leaves, g)}
    for name, plan in block_plans().items():
        fns[name] = lambda plan=plan: torch.autograd.grad(
            layernorm_linear(x, lnw, lnb, w, b, plan, activation="relu"), leaves, g)
    return fns


def profile_blocks(ms, kns, device, out: Path) -> None:
    """Per variant: wall time per back-to-back step, GPU kernel time per step, top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for m in ms:
        for k, n in kns:
            for name, fn in _block_step_fns(device, m, k, n).items():
                for _ in range(3):
                    fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                iters = 20
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                wall_us = 1e6 * (time.perf_counter() - t0) / iters
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
                with profile(activities=acts) as prof:
                    for _ in range(5):
                        fn()
                    if device == "cuda":
                        torch.cuda.synchronize()
                ka = prof.key_averages()
                # Kernels (device-side events) only; op rows would count them twice. The
                # record_function ranges of the FP8 path (`profiled`, active while profiling)
                # are mirrored on the GPU timeline as CUDA events too: not kernel time.
                gpu_us = sum(
                    e.time_range.elapsed_us() for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA
                    and not getattr(e, "is_user_annotation", False)
                ) / 5
                lines.append(f"=== M={m} K={k} N={n} {name}: wall {wall_us:.1f} us/step back-to-back, "
                             f"GPU kernels {gpu_us:.1f} us/step")
                sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
                lines.append(ka.table(sort_by=sort, row_limit=25, max_name_column_width=70))
                logger.info(lines[-2])
    (out / "profile.txt").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.dry_run:
        # Must be set before triton is imported (by loka_train.kernels.triton_kernels).
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if args.dry_run:
        device, ms, kns = "cpu", DRY_MS, DRY_KN
    else:
        if not torch.cuda.is_available():
            logger.error("no CUDA device: use --dry-run to check the script on CPU")
            return 2
        device = "cuda"
        ms, kns = (QUICK_MS, QUICK_KN) if args.quick else (FULL_MS, FULL_KN)
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.ms:
        ms = tuple(int(v) for v in args.ms.split(","))
    env = environment(device)
    logger.info("environment: %s", env)
    if args.profile:
        profile_blocks(ms, kns, device, args.out)
        return 0
    timer = Timer(device, args.rep_ms)
    rows: list[Row] = []
    t0 = time.time()
    cmd = "python -m bench.gemm " + " ".join(sys.argv[1:] if argv is None else argv)
    prev = load_previous(args.out) if args.append else None
    done = ""

    def save() -> None:
        # After every (part, M): a run stopped by a time limit keeps what it measured.
        all_rows, parts, all_ms, all_kns, commands = merge_previous(prev, rows, done, ms, kns, cmd)
        write_report(all_rows, parts, env, all_ms, all_kns, args.out, commands)

    for part, bench in (("a", bench_gemms), ("b", bench_quantizers), ("c", bench_block)):
        if part in args.parts:
            done += part
            for m in ms:  # each bench loops over M outermost: same order as one call with all
                bench((m,), kns, device, timer, rows)
                logger.info("(%s) M=%d done after %.0f s", part, m, time.time() - t0)
                save()
    if not done:
        save()
    errors = [r for r in rows if r.skipped and r.skipped.startswith("error")]
    logger.info("wrote %s (%d rows, %d errors) in %.0f s", args.out, len(rows), len(errors), time.time() - t0)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
