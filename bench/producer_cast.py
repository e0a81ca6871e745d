"""What a static-scale FP8 cast of an activation costs with its producer, on the GPU: the
producer alone (compiled), the producer then the Triton cast (``loka::tensorwise_quant_static``,
both layouts: what a site pays after a ReLU module), the ReLU folded into that cast
(``relu=True``, ``mods.fold_relu``), and the cast written as plain torch ops that inductor fuses
into the producer (:func:`traced_codes`; with its amax for the fit check, without it, one
layout).

Producers: a ReLU (the input of Wukong's FM MLP out and of over-arch 1) and a LayerNorm over
the rows (the input of an MLP after a norm). ``--cross``: DCN's cross layer
``x0 * (xw + b) + xl`` in fp32 (its output is the next layer's ``V`` input and over-arch 0's),
with the casts DCN's sites run on it: the site casts the fp32 output to a bf16 copy in traced
code (fused into the producer) and quantizes the copy; row-wise (the Triton one-pass quantizer
after the producer, against :func:`formats.quantize` traced for inductor to fuse into it) and
dynamic tensor-wise (the Triton two-pass cast after it, against the traced reference), then
the same casts of the fp32 output itself; the traced codes are compared with the Triton ones
and the share of differing codes reported (fp32 division: a code one step apart where a
quotient rounds the other way). ``--ks=`` times no ReLU or LayerNorm producer. The folded and fused payloads are checked bit for
bit against the Triton cast's first (a ReLU's only: a compiled LayerNorm rounds its own way).
Times are medians of ``triton.testing.do_bench`` (us); the kernels each variant launches come
from one profiled call.

    python -m bench.producer_cast --out DIR [--m 32768] [--ks 4096,2048] [--cross 3456]
    python -m bench.producer_cast --out DIR --ks= --cross 3456,1024
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def traced_codes(x: Any, slot: Any, fmt: Any, *, both: bool, row_amax: bool = False) -> tuple[Any, Any, Any]:
    """``x``'s codes with the slot's power-of-two scale in plain torch ops (its reciprocal exact,
    from the exponent bits), the transpose with ``both``, and the amax a fit check needs: of the
    whole tensor, or with ``row_amax`` each row's (a reduction over the rows, which inductor can
    fuse into a pointwise producer's kernel where a reduction to one value becomes a kernel of its
    own), whose amax is the tensor's."""
    import torch

    from loka_train.kernels.static_scales import SCALE

    exp = (slot[SCALE:SCALE + 1].view(torch.int32) >> 23) & 0xFF
    inv = ((254 - exp).clamp(min=0) << 23).view(torch.float32)
    q = (x.float() * inv).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    amax = x.float().abs().amax(dim=-1) if row_amax else x.abs().amax().float()
    return q, (q.t().contiguous() if both else None), amax


def _kernels(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """The kernels one call of ``fn`` launches: each name's device time summed over its
    launches in the call (``us``) and how many (``calls``), longest first. A kernel launched
    twice (the static cast's, whose second launch is the gated recast) counts both."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            out.append({"name": e.key[:120], "us": round(e.device_time_total, 1), "calls": e.count})
    return sorted(out, key=lambda d: -d["us"])


def run(m: int, k: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from loka_train.kernels import static_scales as ss
    from loka_train.kernels import triton_tensorwise as tt
    from loka_train.kernels.formats import Fp8Format

    fmt = Fp8Format.E4M3
    dev = torch.device("cuda")
    y = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ln_w = torch.randn(k, device=dev, dtype=torch.bfloat16)
    ln_b = torch.randn(k, device=dev, dtype=torch.bfloat16)
    producers: dict[str, Callable[[Any], Any]] = {
        "relu": torch.relu,
        "layernorm": lambda t: F.layer_norm(t, (k,), ln_w, ln_b),
    }
    rows: list[dict[str, Any]] = []
    for pname, prod in producers.items():
        slot = ss.new_slots(1, margin=2.0, spread=16.0, device=dev)[0]
        h_ref = prod(y)
        tt.tensorwise_quant_static(h_ref, slot, both=True)  # seeds the slot
        ref_q, ref_s, ref_qt = tt.tensorwise_quant_static(h_ref, slot, both=True)
        assert ref_qt is not None

        def fused_keep(t: Any, slot: Any = slot, prod: Any = prod) -> Any:
            h = prod(t)
            q, q_t, amax = traced_codes(h, slot, fmt, both=True)
            return h, q, q_t, amax

        def fused_drop(t: Any, slot: Any = slot, prod: Any = prod) -> Any:
            h = prod(t)
            q, q_t, amax = traced_codes(h, slot, fmt, both=True)
            return q, q_t, amax

        def fused_no_amax(t: Any, slot: Any = slot, prod: Any = prod) -> Any:
            h = prod(t)
            q, q_t, _ = traced_codes(h, slot, fmt, both=True)
            return h, q, q_t

        def fused_one_layout(t: Any, slot: Any = slot, prod: Any = prod) -> Any:
            h = prod(t)
            q, _, amax = traced_codes(h, slot, fmt, both=False)
            return h, q, amax

        c_prod = torch.compile(prod, dynamic=False)
        c_keep = torch.compile(fused_keep, dynamic=False)
        c_drop = torch.compile(fused_drop, dynamic=False)
        c_noamax = torch.compile(fused_no_amax, dynamic=False)
        c_one = torch.compile(fused_one_layout, dynamic=False)

        def same(q: Any, q_t: Any, ref_q: Any = ref_q, ref_qt: Any = ref_qt) -> bool:
            return (torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
                    and torch.equal(q_t.view(torch.uint8), ref_qt.view(torch.uint8)))

        if pname == "relu":
            _, q, q_t, amax = c_keep(y)
            fq, fs, fq_t = tt.tensorwise_quant_static(y, slot, both=True, relu=True)
            if not (same(q, q_t) and float(amax) == float(h_ref.abs().amax().float())
                    and same(fq, fq_t) and torch.equal(fs, ref_s)):
                raise AssertionError("relu: the folded or fused codes differ from the Triton cast's")

        variants: dict[str, Callable[[], Any]] = {
            f"{pname} alone (compiled)": lambda c=c_prod: c(y),
            f"{pname} then the Triton two-layout static cast": lambda c=c_prod, slot=slot: tt.tensorwise_quant_static(
                c(y), slot, both=True),
            f"{pname} + inductor-fused cast, both layouts, amax (output kept)": lambda c=c_keep: c(y),
            f"{pname} + inductor-fused cast, both layouts, amax (output dropped)": lambda c=c_drop: c(y),
            f"{pname} + inductor-fused cast, both layouts, no amax": lambda c=c_noamax: c(y),
            f"{pname} + inductor-fused cast, one layout, amax": lambda c=c_one: c(y),
        }
        if pname == "relu":
            variants["relu folded into the Triton two-layout static cast"] = (
                lambda slot=slot: tt.tensorwise_quant_static(y, slot, both=True, relu=True))
        for name, fn in variants.items():
            us = do_bench(fn) * 1e3
            rows.append({"m": m, "k": k, "producer": pname, "variant": name, "us": round(us, 1),
                         "kernels": _kernels(fn)})
            print(f"{m}x{k} {name}: {us:.1f} us", flush=True)
    return rows


def run_cross(m: int, k: int) -> list[dict[str, Any]]:
    """DCN's cross-layer output and the casts of it that its sites run (module docstring): as
    a site takes it, the fp32 output and its bf16 copy (``kernels.linear`` casts an fp32
    activation to the autocast dtype in traced code, fused into the producer), the cast reading
    the copy; and, for comparison, fp32 ``h`` cast directly (the Triton quantizer then reads
    twice the bytes)."""
    import torch
    from triton.testing import do_bench

    from loka_train.kernels import static_scales as ss
    from loka_train.kernels import triton_kernels as tk
    from loka_train.kernels import triton_tensorwise as tt
    from loka_train.kernels.formats import Fp8Format, Scaling, quantize

    fmt = Fp8Format.E4M3
    dev = torch.device("cuda")
    x0 = torch.randn(m, k, device=dev)
    xl = torch.randn(m, k, device=dev)
    xw = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, device=dev)

    def cross(x0: Any, xw: Any, b: Any, xl: Any) -> Any:
        return x0 * (xw.float() + b) + xl

    def cross_copy(x0: Any, xw: Any, b: Any, xl: Any) -> Any:
        h = cross(x0, xw, b, xl)
        return h, h.to(torch.bfloat16)

    def fused(scaling: Scaling, *, copy: bool) -> Callable[..., Any]:
        def fn(x0: Any, xw: Any, b: Any, xl: Any) -> Any:
            h = cross(x0, xw, b, xl)
            hc = h.to(torch.bfloat16) if copy else h
            q = quantize(hc, fmt, scaling, axis=-1)
            return h, hc, q.data, q.scale
        return fn

    def fused_static(*, both: bool, amax: str) -> Callable[..., Any]:
        def fn(x0: Any, xw: Any, b: Any, xl: Any) -> Any:
            h = cross(x0, xw, b, xl)
            hc = h.to(torch.bfloat16)
            q, q_t, a = traced_codes(hc, slot, fmt, both=both, row_amax=amax == "rows")
            return (h, hc, q, q_t) if amax == "none" else (h, hc, q, q_t, a)
        return fn

    c_cross = torch.compile(cross, dynamic=False)
    c_copy = torch.compile(cross_copy, dynamic=False)
    c_row, c_tw = (torch.compile(fused(sc, copy=True), dynamic=False) for sc in (Scaling.ROWWISE, Scaling.TENSORWISE))
    c_row32, c_tw32 = (torch.compile(fused(sc, copy=False), dynamic=False) for sc in (Scaling.ROWWISE, Scaling.TENSORWISE))
    args = (x0, xw, b, xl)
    slot = ss.new_slots(1, margin=2.0, spread=16.0, device=dev)[0]
    hc0 = c_copy(*args)[1]
    tt.tensorwise_quant_static(hc0, slot, both=True)  # seeds the slot
    ref_q, _, ref_qt = tt.tensorwise_quant_static(hc0, slot, both=True)
    statics = {(both, amax): torch.compile(fused_static(both=both, amax=amax), dynamic=False)
               for both in (False, True) for amax in ("rows", "tensor", "none")}

    def differing(a: Any, b: Any) -> float:
        return float((a.view(torch.uint8) != b.view(torch.uint8)).float().mean())

    h, hc = c_copy(*args)
    checks = {
        "rowwise": differing(tk.fused_rowwise_quant(hc, fmt=fmt)[0], c_row(*args)[2]),
        "tensorwise": differing(tt.tensorwise_quant(hc, fmt=fmt)[0], c_tw(*args)[2]),
        "rowwise_fp32": differing(tk.fused_rowwise_quant(h, fmt=fmt)[0], c_row32(*args)[2]),
        "static": differing(ref_q, statics[(False, "rows")](*args)[2]),
        "static_transposed": differing(ref_qt, statics[(True, "rows")](*args)[3]),
    }
    # Inductor reads the copy's values before their bf16 rounding (no emulate_precision_casts):
    # the rows' amax is the fp32 output's, within the copy's rounding of it.
    _, hc1, _, _, rows_amax = statics[(False, "rows")](*args)
    want = hc1.float().abs().amax(dim=-1)
    if not bool(((rows_amax - want).abs() <= 2**-8 * want).all()):
        raise AssertionError("cross: the traced rows' amax is not each row's")
    print(f"{m}x{k} cross: codes differing from the Triton casts': {checks}", flush=True)
    variants: dict[str, Callable[[], Any]] = {
        "cross alone (compiled)": lambda: c_cross(*args),
        "cross and its bf16 copy (compiled)": lambda: c_copy(*args),
        "cross and its bf16 copy, then the Triton row-wise quantizer on the copy (as the sites run it)":
            lambda: tk.fused_rowwise_quant(c_copy(*args)[1], fmt=fmt),
        "cross and its bf16 copy + inductor-fused row-wise cast of the copy": lambda: c_row(*args),
        "cross and its bf16 copy, then the Triton tensor-wise cast (dynamic)":
            lambda: tt.tensorwise_quant(c_copy(*args)[1], fmt=fmt),
        "cross and its bf16 copy + inductor-fused tensor-wise cast (dynamic)": lambda: c_tw(*args),
        "cross and its bf16 copy, then the Triton static tensor-wise cast of the copy, one layout (as the sites run it)":
            lambda: tt.tensorwise_quant_static(c_copy(*args)[1], slot, both=False),
        "cross and its bf16 copy, then the Triton static tensor-wise cast of the copy, both layouts":
            lambda: tt.tensorwise_quant_static(c_copy(*args)[1], slot, both=True),
        **{f"cross and its bf16 copy + inductor-fused static cast, {'both layouts' if both else 'one layout'}, "
           f"{'rows amax' if amax == 'rows' else 'tensor amax' if amax == 'tensor' else 'no amax'}":
           (lambda c=c: c(*args)) for (both, amax), c in statics.items()},
        "cross then the Triton row-wise quantizer on fp32": lambda: tk.fused_rowwise_quant(c_cross(*args), fmt=fmt),
        "cross + inductor-fused row-wise cast of fp32": lambda: c_row32(*args),
        "cross + inductor-fused tensor-wise cast of fp32 (dynamic)": lambda: c_tw32(*args),
    }
    rows: list[dict[str, Any]] = []
    for name, fn in variants.items():
        us = do_bench(fn) * 1e3
        rows.append({"m": m, "k": k, "producer": "cross", "variant": name, "us": round(us, 1),
                     "kernels": _kernels(fn), "codes_differing": checks})
        print(f"{m}x{k} {name}: {us:.1f} us", flush=True)
    return rows


def _widths(text: str) -> list[int]:
    """``--ks`` / ``--cross``: positive integers, comma-separated (empty: none)."""
    try:
        widths = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give widths as comma-separated integers, e.g. 4096,2048 "
                                         "(or nothing: --ks=)") from None
    if any(w <= 0 for w in widths):
        raise argparse.ArgumentTypeError(f"{text!r}: widths must be positive")
    return widths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--m", type=int, default=32768)
    ap.add_argument("--ks", type=_widths, default="4096,2048",
                    help="widths of the ReLU and LayerNorm producers (comma-separated; --ks= for none)")
    ap.add_argument("--cross", type=_widths, default="", help="widths of DCN cross layers to time "
                    "(comma-separated); none by default")
    args = ap.parse_args(argv)
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for k in args.ks:
        rows += run(args.m, k)
    for k in args.cross:
        rows += run_cross(args.m, k)
    (args.out / "producer_cast.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))
    lines = ["| M x K | variant | us | kernels (us a call, x launches) |", "|---|---|---|---|"]
    for r in rows:
        ks = ", ".join(f"{d['name'][:60]} {d['us']}" + (f" x{d['calls']}" if d["calls"] > 1 else "")
                       for d in r["kernels"][:4])
        lines.append(f"| {r['m']} x {r['k']} | {r['variant']} | {r['us']} | {ks} |")
    (args.out / "producer_cast.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
