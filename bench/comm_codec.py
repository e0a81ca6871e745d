"""What the embedding all-to-all codec costs per MB, against what it saves on the wire (1 GPU).

For each payload size, direction, precision and implementation (`CodecImpl`) it measures the
encode and the decode (`WireFormat.encode_bytes` / `decode_bytes`, what `SwitchableCodec`
runs), and reports per MB of fp32 input (1 MB = 1e6 bytes):

* cost: encode + decode time, from CUDA graph replays of `--graph-calls` calls timed with CUDA
  events (median of `--reps` replays); the eager time per call (events around each call,
  median, host launch overhead included) beside it;
* saved: the all-to-all time the smaller payload saves, ``(1 - bytes_ratio) * 1e6 B / bandwidth``,
  at 450 GB/s (H100 NVLink, per direction) and 50 GB/s (400 Gb/s InfiniBand per GPU);
* net = saved - cost (positive: the format pays), and the break-even bandwidth below which it
  pays, ``(1 - bytes_ratio) * 1e6 B / cost``.

Sizes are one GPU's all-to-all payload in a weak-scaled job: per-GPU batch x tables rows of
`dim` values (with W GPUs a rank sends batch/W x dim for each of its tables to each of W ranks:
batch x tables x dim in all), `row_dim` = dim as `bench/comm.py` runs it. Forward data is
N(0, 1) (pooled embeddings, e4m3), backward 1e-4 * N(0, 1) (gradients, e5m2). FP32 is the
pass-through baseline (its encode and decode are views). Each implementation is also checked
against the reference on the same data (payload bytes identical for TRITON; SQNR of the round
trip for all). Decode reads a payload that may still sit in L2 (50 MB on an H100) at the
smallest size: its figure there is a lower bound.

Run (1 GPU, with the device bundle for FBGEMM):
    python -m bench.comm_codec --out bench/results/<dir>
Dry run (CPU, Triton interpreter, tiny sizes):
    python -m bench.comm_codec --dry-run --out /tmp/comm_codec

Writes ``comm_codec.json`` and ``comm_codec.md`` under --out (rewritten after every size).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SIZES = ((8192, 26, 64), (16384, 26, 128), (16384, 52, 128), (32768, 52, 64))
"""(per-GPU batch, tables, dim): 54.5 MB, 218 MB, 436 MB (the 2 x H200 job: 52 x 128 at
batch 16384) and 436 MB again at dim 64 (shorter rows, twice as many scales)."""
DRY_SIZES = ((8, 3, 64), (4, 2, 6))
BANDWIDTHS_GBPS = {"nvlink": 450.0, "infiniband": 50.0}
VARIANTS = (("fp32", "reference"), ("bf16", "reference"), ("bf16", "triton"),
            ("fp8", "reference"), ("fp8", "fbgemm"), ("fp8", "triton"))
DIRECTIONS = {"forward": ("e4m3", 1.0), "backward": ("e5m2", 1e-4)}


def per_mb(numel: int, encoded_bytes: int, encode_us: float, decode_us: float,
           bandwidths_gbps: dict[str, float] = BANDWIDTHS_GBPS) -> dict[str, Any]:
    """Cost, all-to-all time saved and net per MB of fp32 input, and the break-even bandwidth.

    Example:
        >>> r = per_mb(1_000_000, 1_000_000, 1.0, 1.0)  # FP8-sized payload, 2 us per 4 MB
        >>> round(r["saved_us_per_mb"]["nvlink"], 3), r["cost_us_per_mb"]
        (1.667, 0.5)
    """
    mb = numel * 4 / 1e6
    ratio = encoded_bytes / (numel * 4)
    cost = (encode_us + decode_us) / mb
    saved = {name: (1 - ratio) * 1e6 / (bw * 1e9) * 1e6 for name, bw in bandwidths_gbps.items()}
    return {
        "mb": mb,
        "bytes_ratio": ratio,
        "cost_us_per_mb": cost,
        "saved_us_per_mb": saved,
        "net_us_per_mb": {name: s - cost for name, s in saved.items()},
        "breakeven_gbps": (1 - ratio) * 1e6 / (cost * 1e-6) / 1e9 if cost > 0 else float("inf"),
    }


def _median_us_cuda(fn: Callable[[], object], reps: int, graph_calls: int) -> dict[str, Any]:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    eager = statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(graph_calls):
                fn()
        graph.replay()
        for start, end in zip(starts, ends):
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        graph_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        del graph
    except RuntimeError as err:  # recorded: the eager time then stands for this variant
        return {"graph": None, "eager": eager, "graph_error": f"{type(err).__name__}: {err}"}
    return {"graph": graph_us / graph_calls, "eager": eager, "graph_error": None}


def _median_us_cpu(fn: Callable[[], object], reps: int) -> dict[str, Any]:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return {"graph": None, "eager": statistics.median(times), "graph_error": None}


def _measure_variant(fmt: Any, x: Any, references: dict[str, Any], *, device: str, reps: int,
                     graph_calls: int) -> dict[str, Any]:
    """Check one `WireFormat` against the reference payload of its precision, then time it."""
    import torch

    from loka_train.comm import CodecImpl
    from loka_train.kernels.formats import sqnr_db

    payload = fmt.encode_bytes(x)
    row: dict[str, Any] = {
        "encoded_bytes": payload.numel(),
        "sqnr_db": float(sqnr_db(x.reshape(-1), fmt.decode_bytes(payload))),
    }
    reference = references.get(fmt.precision.value)
    if fmt.impl is CodecImpl.REFERENCE:
        references[fmt.precision.value] = payload
        row["identical_to_reference"] = True
    elif reference is not None and payload.numel() == reference.numel():
        row["identical_to_reference"] = bool(torch.equal(payload, reference))
    else:
        row["identical_to_reference"] = None  # another layout (FBGEMM's FP8)
    if device == "cuda":
        enc = _median_us_cuda(lambda: fmt.encode_bytes(x), reps, graph_calls)
        dec = _median_us_cuda(lambda: fmt.decode_bytes(payload), reps, graph_calls)
    else:
        enc = _median_us_cpu(lambda: fmt.encode_bytes(x), reps)
        dec = _median_us_cpu(lambda: fmt.decode_bytes(payload), reps)
    mode = "graph" if enc["graph"] is not None and dec["graph"] is not None else "eager"
    encode_us, decode_us = enc[mode], dec[mode]
    numel = x.numel()
    row.update(per_mb(numel, payload.numel(), encode_us, decode_us))
    moved = numel * 4 + payload.numel()  # each pass reads one side and writes the other
    row.update({
        "encode_us": enc, "decode_us": dec, "timed": mode,
        "eager_cost_us_per_mb": (enc["eager"] + dec["eager"]) / row["mb"],
        "encode_gbps": moved / (encode_us * 1e-6) / 1e9 if encode_us > 0 else None,
        "decode_gbps": moved / (decode_us * 1e-6) / 1e9 if decode_us > 0 else None,
    })
    return row


def measure_size(batch: int, tables: int, dim: int, *, row_dim: int | None, device: str,
                 reps: int, graph_calls: int, variants: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """Every variant and direction at one size; a variant that cannot run is recorded with
    its reason (``skipped``) or its exception (``error``), never dropped."""
    import torch

    from loka_train.comm import CodecImpl, CommPrecision, WireFormat
    from loka_train.comm.formats import check_codec_impl
    from loka_train.kernels.formats import Fp8Format

    row_dim = row_dim or dim
    numel = batch * tables * dim
    rows = []
    for direction, (fp8_name, scale) in DIRECTIONS.items():
        gen = torch.Generator(device=device).manual_seed(0)
        x = scale * torch.randn(batch * tables, dim, device=device, generator=gen)
        references: dict[str, Any] = {}
        for precision_name, impl_name in variants:
            precision, impl = CommPrecision(precision_name), CodecImpl(impl_name)
            fmt = WireFormat(precision=precision, row_dim=row_dim, fp8_format=Fp8Format(fp8_name), impl=impl)
            row: dict[str, Any] = {
                "size": f"{batch}x{tables}x{dim}", "batch": batch, "tables": tables, "dim": dim,
                "row_dim": row_dim, "numel": numel, "direction": direction,
                "fp8_format": fp8_name if precision is CommPrecision.FP8 else None,
                "precision": precision_name, "impl": impl_name, "skipped": None, "error": None,
            }
            rows.append(row)
            try:
                check_codec_impl(impl, device, row_dim, precision)
                if impl is CodecImpl.FBGEMM:
                    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
            except (ValueError, ImportError) as err:
                row["skipped"] = str(err)
                continue
            try:
                row.update(_measure_variant(fmt, x, references, device=device, reps=reps,
                                            graph_calls=graph_calls))
            except Exception as err:  # recorded in the results: one variant must not end the run
                row["error"] = f"{type(err).__name__}: {err}"
            print(_summary(row), flush=True)
        del x, references
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _summary(row: dict[str, Any]) -> str:
    head = f"{row['size']} {row['direction']:8s} {row['precision']}/{row['impl']}"
    if row.get("error"):
        return f"{head}: error {row['error']}"
    return (f"{head}: cost {row['cost_us_per_mb']:.3f} us/MB, net nvlink "
            f"{row['net_us_per_mb']['nvlink']:+.3f}, ib {row['net_us_per_mb']['infiniband']:+.3f} us/MB")


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size and direction: the cheapest FP8 against the cheapest BF16 (the target: FP8's
    cost per MB <= BF16's)."""
    out = []
    keys = sorted({(r["size"], r["direction"]) for r in rows}, key=str)
    for size, direction in keys:
        best: dict[str, dict[str, Any]] = {}
        for r in rows:
            if (r["size"], r["direction"]) != (size, direction) or "cost_us_per_mb" not in r:
                continue
            if r["precision"] not in best or r["cost_us_per_mb"] < best[r["precision"]]["cost_us_per_mb"]:
                best[r["precision"]] = r
        if "fp8" in best and "bf16" in best:
            fp8, bf16 = best["fp8"], best["bf16"]
            out.append({
                "size": size, "direction": direction,
                "fp8": f"fp8/{fp8['impl']}", "fp8_cost_us_per_mb": fp8["cost_us_per_mb"],
                "bf16": f"bf16/{bf16['impl']}", "bf16_cost_us_per_mb": bf16["cost_us_per_mb"],
                "target_met": fp8["cost_us_per_mb"] <= bf16["cost_us_per_mb"],
                "fp8_net_minus_bf16_net_us_per_mb": {
                    k: fp8["net_us_per_mb"][k] - bf16["net_us_per_mb"][k] for k in BANDWIDTHS_GBPS
                },
            })
    return out


def markdown(report: dict[str, Any]) -> str:
    """The per-MB table and the verdicts, as Markdown."""
    def num(v: float | None, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        f"# Embedding all-to-all codec, cost per MB of fp32 input ({report['device']})", "",
        f"Command: `{report['command']}`. torch {report['torch']}, triton {report['triton']}, "
        f"fbgemm-gpu {report['fbgemm_gpu']}. Times: {report['timing']}. Saved = all-to-all time "
        "the payload saves against FP32 at 450 GB/s (NVLink) and 50 GB/s (400 Gb/s IB); "
        "net = saved - cost; break-even = bandwidth below which the format pays.", "",
        "| size (B x T x D) | dir | format | bytes / fp32 byte | encode us | decode us | cost us/MB |"
        " eager us/MB | saved @450 | net @450 | saved @50 | net @50 | break-even GB/s |"
        " enc GB/s | dec GB/s | SQNR dB | = reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        name = f"{r['precision']}/{r['impl']}" + (f" ({r['fp8_format']})" if r["fp8_format"] else "")
        if r["skipped"] or r["error"]:
            why = r["skipped"] or r["error"]
            lines.append(f"| {r['size']} | {r['direction']} | {name} | {'skipped' if r['skipped'] else 'error'}: "
                         f"{why.splitlines()[0][:120]} |" + " |" * 13)
            continue
        mode = r["timed"]
        lines.append(
            f"| {r['size']} | {r['direction']} | {name} | {r['bytes_ratio']:.3f} | "
            f"{num(r['encode_us'][mode], '.1f')} | {num(r['decode_us'][mode], '.1f')} | "
            f"{r['cost_us_per_mb']:.3f} | {r['eager_cost_us_per_mb']:.3f} | "
            f"{r['saved_us_per_mb']['nvlink']:.3f} | {r['net_us_per_mb']['nvlink']:+.3f} | "
            f"{r['saved_us_per_mb']['infiniband']:.3f} | {r['net_us_per_mb']['infiniband']:+.3f} | "
            f"{num(r['breakeven_gbps'], '.0f')} | {num(r['encode_gbps'], '.0f')} | "
            f"{num(r['decode_gbps'], '.0f')} | {r['sqnr_db']:.1f} | {r['identical_to_reference']} |")
    lines += ["", "## FP8 against BF16 (cheapest implementation of each)", "",
              "| size | dir | FP8 | cost us/MB | BF16 | cost us/MB | FP8 <= BF16 | FP8 net - BF16 net @450 | @50 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for v in report["verdicts"]:
        gain = v["fp8_net_minus_bf16_net_us_per_mb"]
        lines.append(f"| {v['size']} | {v['direction']} | {v['fp8']} | {v['fp8_cost_us_per_mb']:.3f} | "
                     f"{v['bf16']} | {v['bf16_cost_us_per_mb']:.3f} | {'yes' if v['target_met'] else 'no'} | "
                     f"{gain['nvlink']:+.3f} | {gain['infiniband']:+.3f} |")
    return "\n".join(lines) + "\n"


def _parse_sizes(text: str) -> list[tuple[int, int, int]]:
    sizes = []
    for item in text.split(","):
        batch, tables, dim = (int(v) for v in item.lower().split("x"))
        sizes.append((batch, tables, dim))
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for comm_codec.json / .md")
    parser.add_argument("--sizes", help="BxTxD,... (default: the four job sizes)")
    parser.add_argument("--row-dim", type=int, help="values per FP8 scale (default: dim)")
    parser.add_argument("--reps", type=int, default=50, help="timed calls / graph replays")
    parser.add_argument("--graph-calls", type=int, default=5, help="calls captured per graph")
    parser.add_argument("--variants", help="precision/impl,... (default: all six)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny sizes")
    args = parser.parse_args(argv)
    if args.dry_run:
        # Before triton is imported: the kernels then run in the interpreter on CPU.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import triton

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench.comm_codec needs a CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    sizes = _parse_sizes(args.sizes) if args.sizes else list(DRY_SIZES if args.dry_run else SIZES)
    reps = 2 if args.dry_run else args.reps
    variants = VARIANTS if not args.variants else tuple(
        tuple(v.split("/")) for v in args.variants.split(","))  # type: ignore[misc]
    try:
        import fbgemm_gpu
        fbgemm_version = getattr(fbgemm_gpu, "__version__", "unknown")
    except ImportError as err:
        fbgemm_version = f"not importable ({err})"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "fbgemm_gpu": fbgemm_version,
        "command": "python -m bench.comm_codec " + " ".join(argv if argv is not None else sys.argv[1:]),
        "timing": (f"CUDA graph of {args.graph_calls} calls, median of {reps} replays (CUDA events)"
                   if device == "cuda" else f"CPU wall clock, median of {reps} calls"),
        "bandwidths_gbps": BANDWIDTHS_GBPS, "results": [], "verdicts": [],
    }
    for batch, tables, dim in sizes:
        report["results"] += measure_size(batch, tables, dim, row_dim=args.row_dim, device=device,
                                          reps=reps, graph_calls=args.graph_calls, variants=variants)
        report["verdicts"] = verdicts(report["results"])
        (out / "comm_codec.json").write_text(json.dumps(report, indent=2))
        (out / "comm_codec.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
