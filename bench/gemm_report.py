"""The FP8 GEMM benchmark's rows and its report: ``gemm.json`` and ``gemm.md``.

A :class:`Row` is one measurement of ``bench.gemm`` (part, variant name, shape, GEMM role,
microseconds or why it was skipped). :func:`write_report` writes every row as JSON and the
tables of parts (a), (b) and (c) as Markdown, with the block targets of issue 3 met or missed and
why the FP8 block is slower where it is; :func:`load_previous` and :func:`merge_previous` let
``--append`` calls build one report in pieces.

Example:
    >>> rows = [Row("c", "bf16", 8192, 1024, 1024, "fwd+bwd", us=30.0),
    ...         Row("c", "fp8", 8192, 1024, 1024, "fwd+bwd", us=20.0)]
    >>> block_speedup(rows, 8192, 1024, 1024, "fwd+bwd")
    (1.5, '')
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROLES = ("forward", "grad_input", "grad_weight")
# Issue 3's acceptance targets for (c): (M, K, N) -> minimum FP8/bf16 speedup of the block.
TARGETS = {(8192, 1024, 1024): 1.2, (8192, 4096, 4096): 1.5}


@dataclass
class Row:
    """One measurement."""

    part: str
    name: str
    m: int
    k: int
    n: int
    role: str = ""
    us: float | None = None
    skipped: str | None = None
    extra: dict = field(default_factory=dict)


def environment(device: str) -> dict:
    import torch
    import triton

    env = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
    try:
        from importlib.metadata import version

        for pkg in ("fbgemm-gpu", "fbgemm-gpu-genai", "fbgemm-gpu-cpu"):
            try:
                env[pkg] = version(pkg)
            except Exception:
                pass
    except ImportError:
        pass
    if device == "cuda":
        cap = torch.cuda.get_device_capability()
        env["capability"] = f"sm_{cap[0]}{cap[1]}"
    return env


def _lookup(rows, part, name, m, k, n, role=""):
    for r in rows:
        if (r.part, r.name, r.m, r.k, r.n, r.role) == (part, name, m, k, n, role):
            return r
    return None


def _fmt_us(r: Row | None) -> str:
    if r is None:
        return "-"
    if r.us is None:
        return "n/a"
    return f"{r.us:.1f}"


def _speedup(base: Row | None, r: Row | None) -> str:
    if base is None or r is None or not base.us or not r.us:
        return "n/a"
    return f"{base.us / r.us:.2f}x"


def block_speedup(rows, m, k, n, role) -> tuple[float | None, str]:
    """Speedup of the `fp8` block over bf16 and, when below 1, why (from parts a and b)."""
    base = _lookup(rows, "c", "bf16", m, k, n, role)
    fp8 = _lookup(rows, "c", "fp8", m, k, n, role)
    if base is None or fp8 is None or not base.us or not fp8.us:
        return None, "not measured"
    speed = base.us / fp8.us
    if speed >= 1.0:
        return speed, ""
    # The GEMMs alone, as the `fp8` plan runs them (forward Triton+fast, grad-input cuBLAS
    # row-wise, grad-weight cuBLAS tensor-wise+fast).
    g_bf16 = [_lookup(rows, "a", "bf16", m, k, n, r) for r in ("forward", "grad_input", "grad_weight")]
    g_fp8 = [_lookup(rows, "a", "triton/rowwise+fast", m, k, n, "forward"),
             _lookup(rows, "a", "scaled_mm/rowwise", m, k, n, "grad_input"),
             _lookup(rows, "a", "scaled_mm/tensorwise+fast", m, k, n, "grad_weight")]
    if all(r is not None and r.us is not None for r in g_bf16 + g_fp8):
        saved = sum(r.us for r in g_bf16) - sum(r.us for r in g_fp8)
        extra = fp8.us - base.us + saved
        if saved <= 0:
            return speed, (f"the FP8 GEMMs alone are not faster here ({-saved:.1f} us slower than bf16 "
                           "for the three GEMMs)")
        return speed, (f"the FP8 GEMMs save {saved:.1f} us but quantization (W, W^T, dZ^T, H^T, the "
                       f"extra FP8 writes of the fused LN / ReLU-backward kernels) and launches cost "
                       f"{extra:.1f} us")
    return speed, "GEMM timings (part a) missing for a breakdown"


def _row_key(r: Row) -> tuple:
    return (r.part, r.name, r.m, r.k, r.n, r.role)


def load_previous(out: Path) -> dict | None:
    """The gemm.json of an earlier call into ``out`` (for ``--append``), or None."""
    f = out / "gemm.json"
    if not f.exists():
        return None
    data = json.loads(f.read_text())
    data["rows"] = [Row(**r) for r in data["rows"]]
    return data


def merge_previous(prev: dict | None, rows, parts: str, ms, kns, cmd: str):
    """Rows, parts, M values, shapes and commands of ``prev`` and this call together."""
    if prev is None:
        return rows, parts, tuple(ms), tuple(kns), [cmd]
    new = {_row_key(r) for r in rows}
    rows = [r for r in prev["rows"] if _row_key(r) not in new] + list(rows)
    parts = "".join(p for p in "abc" if p in parts or p in prev.get("parts", ""))
    ms = tuple(sorted(set(ms) | set(prev["ms"])))
    kns = tuple(dict.fromkeys([tuple(s) for s in prev["kn"]] + [tuple(s) for s in kns]))
    commands = list(prev.get("commands", [prev.get("command", "?")])) + [cmd]
    return rows, parts, ms, kns, commands


def write_report(rows, parts: str, env, ms, kns, out: Path, commands: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = "; ".join(commands)
    data = {"environment": env, "command": cmd, "commands": commands, "parts": parts, "ms": list(ms),
            "kn": [list(s) for s in kns], "rows": [asdict(r) for r in rows]}
    (out / "gemm.json").write_text(json.dumps(data, indent=1))

    lines = ["# FP8 GEMM benchmark (issue 3)", ""]
    lines += [f"- device: **{env['device']}**" + (f" ({env['capability']})" if "capability" in env else "")]
    lines += [f"- {k}: {v}" for k, v in env.items() if k not in ("device", "capability")]
    lines += [f"- rerun: `{cmd}`", "- times: median microseconds (triton.testing.do_bench, L2 flushed); "
              "speedup = bf16 time / variant time", ""]

    if "a" in parts:
        labels = sorted({r.name for r in rows if r.part == "a" and r.name != "bf16"})
        lines += ["## (a) GEMMs, operands pre-quantized (bf16 output)", ""]
        lines += ["FP8 formats: forward e4m3 x e4m3; grad roles e5m2 x e4m3 (fbgemm: e4m3 x e4m3). "
                  "Cells: speedup over bf16; n/a = unsupported (reason in the JSON).", ""]
        for role in ROLES:
            lines += [f"### {role}", "", "| M | K | N | bf16 us | " + " | ".join(labels) + " |",
                      "|---|---|---|---|" + "---|" * len(labels)]
            for m in ms:
                for k, n in kns:
                    base = _lookup(rows, "a", "bf16", m, k, n, role)
                    cells = [_speedup(base, _lookup(rows, "a", lab, m, k, n, role)) for lab in labels]
                    lines.append(f"| {m} | {k} | {n} | {_fmt_us(base)} | " + " | ".join(cells) + " |")
            lines.append("")

    if "b" in parts:
        names = list(dict.fromkeys(r.name for r in rows if r.part == "b"))
        lines += ["## (b) Quantizers alone (bf16 input (M, K) -> e4m3), microseconds", "",
                  "| M | K | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for m in ms:
            for k in sorted({k for k, _ in kns}):
                cells = [_fmt_us(_lookup(rows, "b", nm, m, k, 0)) for nm in names]
                lines.append(f"| {m} | {k} | " + " | ".join(cells) + " |")
        lines.append("")

    if "c" in parts:
        names = list(dict.fromkeys(r.name for r in rows if r.part == "c"))
        fp8_names = [nm for nm in names if nm != "bf16"]
        lines += ["## (c) LayerNorm -> Linear -> ReLU block, bf16 activations, forward + backward", "",
                  "All FP8 variants fuse LayerNorm+quantize (forward) and ReLU-backward+quantize (grad-input) "
                  "into one Triton kernel each, quantize W^T without a transposed copy and run LayerNorm's "
                  "backward as one Triton kernel (loka_train/kernels/triton_block.py). `fp8`: forward Triton "
                  "GEMM e4m3 (fast acc.) with bias+ReLU epilogue; grad-input cuBLAS row-wise e5m2 x e4m3 "
                  "(precise acc.); grad-weight cuBLAS tensor-wise e5m2 x e4m3 (fast acc.), its dZ^T and H^T "
                  "quantized transposed with the amaxes the fused kernels computed (H^T recomputed from x, "
                  "the bias gradient summed in the same pass). `fp8 precise-wgrad`: grad-weight with precise "
                  "accumulation; `fp8 rowwise-wgrad`: grad-weight row-wise (a column-amax pass first); "
                  "`fp8 bf16-wgrad`: grad-weight in bf16; `fp8 cublas bf16-wgrad`: forward on "
                  "torch._scaled_mm too (ReLU separate).", "",
                  "Eager times include host launch overhead; `graph` = the same step replayed as a CUDA graph "
                  "(the GPU time a compiled/graphed step sees).", ""]
        for mode, role in (("eager", "fwd+bwd"), ("graph", "fwd+bwd graph")):
            lines += [f"### {mode}", "", "| M | K | N | bf16 us | " + " | ".join(f"{nm}" for nm in fp8_names)
                      + " | target (`fp8`) |", "|---|---|---|---|" + "---|" * (len(fp8_names) + 1)]
            for m in ms:
                for k, n in kns:
                    base = _lookup(rows, "c", "bf16", m, k, n, role)
                    cells = [f"{_fmt_us(r)} ({_speedup(base, r)})"
                             for r in (_lookup(rows, "c", nm, m, k, n, role) for nm in fp8_names)]
                    sp, _ = block_speedup(rows, m, k, n, role)
                    tgt = TARGETS.get((m, k, n))
                    tcell = "" if tgt is None else (f">= {tgt}x: " + ("met" if sp is not None and sp >= tgt else "**missed**"))
                    lines.append(f"| {m} | {k} | {n} | {_fmt_us(base)} | " + " | ".join(cells) + f" | {tcell} |")
            lines.append("")
        lines += ["### Numerics: SQNR (dB) against the same block in fp32, one step", "",
                  "Output y / input gradient dx / weight gradient dW / bias gradient db.", "",
                  "| M | K | N | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
        for m in ms:
            for k, n in kns:
                cells = []
                for nm in names:
                    r = _lookup(rows, "c", nm, m, k, n, "fwd+bwd")
                    q = (r.extra.get("sqnr_db") if r is not None else None) or {}
                    cells.append(" / ".join(f"{q[key]:.0f}" for key in ("y", "dx", "dw", "db") if key in q) or "-")
                lines.append(f"| {m} | {k} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
        slower = []
        for m in ms:
            for k, n in kns:
                sp, why = block_speedup(rows, m, k, n, "fwd+bwd graph")
                if sp is None:
                    sp, why = block_speedup(rows, m, k, n, "fwd+bwd")
                if sp is not None and sp < 1.0:
                    slower.append(f"- M={m} K={k} N={n}: {sp:.2f}x: {why}")
        lines += ["### Shapes where the `fp8` block is slower than bf16 (graph timing where measured)", ""]
        lines += slower or ["- none"]
        lines.append("")

    skipped = [r for r in rows if r.skipped and r.skipped.startswith("error")]
    if skipped:
        lines += ["## Errors", ""] + [f"- {r.part} {r.name} {r.role} {r.m}x{r.k}x{r.n}: {r.skipped}" for r in skipped]
    (out / "gemm.md").write_text("\n".join(lines) + "\n")

