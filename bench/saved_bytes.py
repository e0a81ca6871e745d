"""What a stack of Linear + ReLU layers keeps for its backward, plain against LoKA's FP8 sites:
the bytes of every tensor autograd saves in one training forward (eager), by layer, dtype and
shape, each storage counted once (a tensor two ops save, as a ReLU's output that the next Linear
also saves, counts once, for the first layer that saved it).

Layers: ``--layers`` (K x N of each Linear, each followed by a ReLU, then a Linear to one logit;
default Wukong's over-arch, 4096 x 4096, 4096 x 2048, 2048 x 1024) at ``--m`` rows. LoKA's plan
on every site: tensor-wise FP8 forward, grad-input and grad-weight on ``--backend`` (``triton``:
the Triton casts, which fold each ReLU into the next site's cast, ``mods.fold_relu``; on the CPU
under ``TRITON_INTERPRET=1``), under bf16 autocast as the trainer runs with ``dense_dtype=bf16``;
``loka`` keeps each folded ReLU's pre-activation for its mask (``mods.relu_mask_bits=false``),
``loka_bits`` the mask as bits (``mods.relu_mask_bits``, the default).
The bytes are what the eager code saves: a compiled step's partitioner may save other tensors.

    python -m bench.saved_bytes --out DIR [--m 32768] [--layers 4096x4096,4096x2048,2048x1024]

Writes ``saved_bytes.json`` and ``saved_bytes.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import LinearPlan
from loka_train.mods import ModsConfig, convert, sites


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.saved_bytes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--m", type=int, default=32768, help="rows (the batch)")
    p.add_argument("--layers", default="4096x4096,4096x2048,2048x1024", help="K x N of each Linear, comma-separated")
    p.add_argument("--backend", default="triton", help="the FP8 backend of every site's plan")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        args.shapes = [tuple(int(d) for d in s.split("x")) for s in args.layers.split(",") if s]
    except ValueError:
        raise SystemExit(f"--layers {args.layers!r}: give K x N per layer, e.g. 4096x4096,4096x2048") from None
    if not args.shapes or any(len(s) != 2 or min(s) < 1 for s in args.shapes):
        raise SystemExit(f"--layers {args.layers!r}: give K x N per layer, e.g. 4096x4096,4096x2048")
    if any(a[1] != b[0] for a, b in zip(args.shapes, args.shapes[1:])):
        raise SystemExit(f"--layers {args.layers!r}: each layer's K must be the N before it")
    if args.m < 1:
        raise SystemExit("--m must be >= 1")
    return args


def stack(shapes: list[tuple[int, int]], device: torch.device) -> nn.Sequential:
    """Linear + ReLU per shape, then a Linear to one logit."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for k, n in shapes:
        layers += [nn.Linear(k, n), nn.ReLU()]
    layers.append(nn.Linear(shapes[-1][1], 1))
    return nn.Sequential(*layers).to(device)


@contextlib.contextmanager
def _recording(model: nn.Module, rows: list[dict[str, Any]]) -> Iterator[None]:
    """Record what autograd saves while `model` runs forward: per storage, the top-level layer
    that ran when it was first saved, its dtype, shape and bytes."""
    current = ["(input)"]
    seen: set[int] = set()
    handles = [child.register_forward_pre_hook(lambda m, a, name=name: current.__setitem__(0, name))
               for name, child in model.named_children()]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            rows.append({"layer": current[0], "dtype": str(t.dtype).removeprefix("torch."),
                         "shape": list(t.shape), "bytes": storage.nbytes()})
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        for h in handles:
            h.remove()


def saved(model: nn.Module, x: torch.Tensor) -> list[dict[str, Any]]:
    """What `model` saves for its backward in one forward on `x` (under bf16 autocast)."""
    rows: list[dict[str, Any]] = []
    with _recording(model, rows), torch.autocast(x.device.type, dtype=torch.bfloat16):
        model(x).sum().backward()
    return rows


def converted(args: argparse.Namespace, device: torch.device, *, relu_mask_bits: bool) -> nn.Module:
    """The stack with LoKA's sites, every GEMM tensor-wise FP8 on ``--backend``."""
    model = convert(stack(args.shapes, device), config=ModsConfig(enabled=True, relu_mask_bits=relu_mask_bits))
    for site in sites(model).values():
        site.set_plan(LinearPlan.fp8(backend=args.backend, scaling=Scaling.TENSORWISE))
    return model


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    x = torch.randn(args.m, args.shapes[0][0], device=device, generator=torch.Generator(device).manual_seed(1))
    plain = saved(stack(args.shapes, device), x)
    loka, with_bits = (converted(args, device, relu_mask_bits=b) for b in (False, True))
    fp8, bits = saved(loka, x), saved(with_bits, x)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU", "m": args.m,
            "layers": [list(s) for s in args.shapes], "backend": args.backend,
            "folded": [str(m) for m in loka if "Folded" in type(m).__name__],
            "plain": plain, "loka": fp8, "loka_bits": bits,
            "plain_bytes": sum(r["bytes"] for r in plain), "loka_bytes": sum(r["bytes"] for r in fp8),
            "loka_bits_bytes": sum(r["bytes"] for r in bits)}


def render(result: dict[str, Any], command: str) -> str:
    lines = [f"# Saved for the backward: {result['device']}", "", f"- command: `{command}`",
             f"- {result['m']} rows; layers (K x N): {', '.join(f'{k} x {n}' for k, n in result['layers'])}; "
             f"LoKA: tensor-wise FP8 on {result['backend']} for every GEMM, "
             f"{len(result['folded'])} ReLU(s) folded into the next site's cast",
             f"- total: plain {result['plain_bytes'] / 1e6:,.1f} MB, LoKA with the pre-activations kept for the ReLU "
             f"masks (`loka`, relu_mask_bits=false) {result['loka_bytes'] / 1e6:,.1f} MB "
             f"({result['loka_bytes'] / result['plain_bytes']:.2f}x), LoKA with the masks as bits (`loka_bits`) "
             f"{result['loka_bits_bytes'] / 1e6:,.1f} MB ({result['loka_bits_bytes'] / result['plain_bytes']:.2f}x)", ""]
    for which in ("plain", "loka", "loka_bits"):
        lines += [f"## {which}", "", "| layer | dtype | shape | MB |", "|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['dtype']} | {' x '.join(map(str, r['shape'])) or 'scalar'} | "
                  f"{r['bytes'] / 1e6:,.2f} |" for r in sorted(result[which], key=lambda r: (r["layer"], -r["bytes"]))]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import sys

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = measure(args)
    command = "python -m bench.saved_bytes " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "saved_bytes.json").write_text(json.dumps({"command": command, **result}, indent=1) + "\n")
    text = render(result, command)
    (out / "saved_bytes.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
