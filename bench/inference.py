"""Inference benchmark: a trained model served in bf16, compiled bf16, torchao's float8
inference recipe and LoKA's export, on one device, from the same checkpoint.

    python -m bench.inference --configs wukong,dcn,dlrm --batches 512,2048,8192 --out DIR
    python -m bench.inference --run runs/<run> --batches 4096 --out DIR   # a run of yours

Per config: a short training run with the benchmark's sizes (``--train-steps`` in bf16, then
``--decide-steps`` of LoKA aggressive deciding its plans from those weights, as ``bench.e2e``'s
continuations decide; compile + CUDA graphs on a GPU), or ``--run``, an existing run directory;
then each variant of its checkpoint (``loka_train.export.load_trained``):

* ``bf16``: the trained weights in their own modules (no LoKA site), bf16 autocast, eager;
* ``torchao``: torchao's float8 inference recipe (``quantize_`` with
  ``Float8DynamicActivationFloat8WeightConfig``, row-wise) on the dense Linears whose dims are
  multiples of 16, the logit layer excluded; "not run" where torchao does not import;
* ``loka``: ``loka_train.export.serve`` with the run's plans (FP8 weights quantized once);
* ``loka+decided``: the same with the plans re-decided for each batch size
  (``loka_train.export.decide_for_batch``: the fastest of the trained FP8 forward and every
  forward the Probe judged safe, kept where it beats bf16 at that batch), one model per batch
  size, their tables in the JSON;
* ``loka+gatehigh`` (with ``--ne-budget``): ``loka`` whose NE gate moves forwards to high
  precision only (``hold_ne(allow_rowwise=False)``), against the gate's default, which may also
  take a tensor-wise forward row-wise: what each costs in speed at the same budget;
* ``loka+fast``: ``loka`` with its FP8 forwards on their backends' fast accumulation
  (``ServeConfig.fast_accum``; the NE gate serves it too);

each eager, ``+compile`` (the dense submodules under ``torch.compile`` with the options
``trainer.compile_dense`` uses: static shapes, one graph per batch size; the embedding lookup
stays eager, as in training), ``+compile+graphs`` (the same with inductor's CUDA graphs), and
either compiled setting ``+skipguards`` (called through ``loka_train.export.SkipGuards``: a call
like one already made skips dynamo's guards on the frozen model's state). With ``--ne-budget``,
each LoKA variant's NE is first held within that budget of bf16's (``loka_train.export.hold_ne``)
on the ``--eval-batches`` held-out batches after those its NE is reported on. Ratios: ``x ref``
against ``bf16+compile`` (the reference), ``x same`` against bf16 with the same settings. Every
variant serves the same embedding tables: as trained, or (``--embeddings fp16|int8``) in
TorchRec's inference modules (``loka_train.export.serve_embeddings``).

The forward-only ledger: for each batch size, every forward the served model runs in FP8 or the
Probe judged safe in FP8, timed as a GEMM alone in bf16 and in its FP8 candidates (operands
already quantized; CUDA-graph replays on a GPU), and the throughput limit it gives: ``bf16+compile``'s latency over that latency less
what the FP8 GEMMs save ("quantization free"). ``of limit`` is LoKA's ratio over that limit: where
``--pairs`` timed it against ``bf16+compile``, its paired ratio over the limit from the reference's
paired block p50s, else its ratio of p50s over the limit from the reference's p50. ``of the same
settings' limit`` is the stricter share: LoKA's paired ratio against bf16 with the same settings
over the limit that bf16's paired latency gives (what compile and CUDA graphs gain, bf16 gains
too; at small batches they alone can pass the first limit).
It is measured on the plain ``loka`` variant's model, or, where that variant does not run, on an
eager LoKA model built for it (the trained plans, before any NE gate: the limit counts every
safe FP8 forward whatever the gate serves, and the table's "served in FP8" is then as trained).

Every variant is built (serving the same embedding tables, held once), warmed up at each batch
size (``--warmup`` calls: compiled and captured there) and evaluated (NE and AUC on
``--eval-batches`` held-out batches of the largest batch size). Then ``--rounds`` rounds each time
every variant in turn, rotated from round to round: per batch size, two calls to come back to
it, then ``--iters`` timed forwards on held-out batches (``torch.no_grad``, bf16 autocast; each
call timed on the host between two device synchronisations, so latency is per call). p50 and p99
latency over all rounds' calls, each round's p50, and throughput (batch / p50). Then the paired
ratios, the figures to compare variants by on a machine that drifts: for each variant against
the reference and against bf16 with its settings, ``--pairs`` pairs of adjacent blocks of
``--pair-calls`` calls, the two alternating first, each pair's ratio of block p50s; their median
(and range) in the JSON and the table. Each variant is
also timed once right after its build (its first pass, printed: a run stopped before the rounds
still tells); a compiled variant records the graphs dynamo made of it and its graph breaks by
reason. Last, ``--profile-calls`` of each variant's calls per batch size run under
torch.profiler: the kernels' time per call, how busy the device is, kernels launched, GEMM and
quantization kernels' time and the host's operators (a call bound by its kernels told from one
bound by the host, whatever a drifting machine does to latency). Writes ``inference.json`` and
``inference.md`` under ``--out`` after each config's rounds and at its end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from bench.e2e.protocol import decide_overrides
from bench.e2e.variants import CONFIGS, DATA, DRY_CONFIGS, DRY_DATA, Composer
from loka_train.data import make_dataset
from loka_train.data.metrics import auc, normalized_entropy
from loka_train.dispatch.ledger import Ledger
from loka_train.export import (
    GateStep,
    InferenceDecision,
    SafeForwards,
    ServeConfig,
    SkipGuards,
    compile_served,
    decide_for_batch,
    forward_ledger,
    hold_ne,
    load_trained,
    serve,
    serve_embeddings,
)
from loka_train.export.config import EMBEDDINGS
from loka_train.job import JobConfig, run_job

logger = logging.getLogger(__name__)

MODELS = ("bf16", "torchao", "loka")
SETTINGS = ("", "+compile", "+compile+graphs", "+compile+skipguards", "+compile+graphs+skipguards")
VARIANTS = (*(m + s for m in MODELS for s in SETTINGS), *(v + s for v in ("loka+decided", "loka+gatehigh", "loka+fast")
                                                           for s in SETTINGS))
# torchao last: compiling its float8 Wukong model can take minutes.
DEFAULT_VARIANTS = ("bf16", "bf16+compile", "bf16+compile+graphs", "loka", "loka+compile",
                    "loka+compile+graphs", "loka+decided+compile", "torchao+compile")
REFERENCE = "bf16+compile"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.inference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for inference.json and inference.md")
    p.add_argument("--configs", default="wukong", help="comma-separated: dlrm, dcn, wukong (ignored with --run)")
    p.add_argument("--run", default=None, help="serve this run directory's latest checkpoint instead of training one")
    p.add_argument("--batches", default="512,2048,8192", help="comma-separated batch sizes")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--train-steps", type=int, default=150, help="bf16 training steps per config")
    p.add_argument("--decide-steps", type=int, default=30, help="LoKA steps after them that decide the plans")
    p.add_argument("--seed", type=int, default=0,
                   help="trainer.seed of the training run (its initial weights and RNG): another seed, another checkpoint")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed rounds: each round times every variant in turn (--iters calls each)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--pairs", type=int, default=6,
                   help="paired ratios: blocks of --pair-calls calls alternating between a variant and its "
                        "reference, per batch size (0: none)")
    p.add_argument("--pair-calls", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches of the largest batch size for NE/AUC")
    p.add_argument("--ne-budget", type=float, default=None,
                   help="hold each LoKA variant's NE within this relative budget of the bf16 model's (2e-4: 0.02%%) "
                        "on --eval-batches other held-out batches (loka_train.export.hold_ne), with the trained "
                        "tables whatever --embeddings serves; default: off")
    p.add_argument("--embeddings", default="trained", choices=sorted(EMBEDDINGS),
                   help="the tables every variant serves: as trained, or TorchRec's inference modules in fp16/int8")
    p.add_argument("--no-ledger", action="store_true", help="skip the forward-only ledger (measured on an eager LoKA model)")
    p.add_argument("--profile-calls", type=int, default=5,
                   help="calls of each variant and batch size under torch.profiler, after every timing (0: none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry-run", action="store_true", help="tiny models and data (CPU tests)")
    args = p.parse_args(argv)
    args.config_names = [c for c in args.configs.split(",") if c]
    args.batch_sizes = [int(b) for b in args.batches.split(",") if b]
    args.variant_names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variant_names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    bad = sorted(set(args.config_names) - set(CONFIGS))
    if bad and args.run is None:
        raise SystemExit(f"--configs: unknown {bad}; choose from {sorted(CONFIGS)}")
    if min(args.batch_sizes, default=0) < 1 or args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        raise SystemExit("--batches must be >= 1 each, --iters >= 1, --rounds >= 1, --warmup >= 0")
    if args.profile_calls < 0:
        raise SystemExit("--profile-calls must be >= 0")
    if args.pairs < 0 or args.pair_calls < 1:
        raise SystemExit("--pairs must be >= 0 and --pair-calls >= 1")
    if args.ne_budget is not None and not args.ne_budget >= 0:
        raise SystemExit("--ne-budget must be >= 0 (a relative NE increase, 2e-4 for 0.02%)")
    if args.train_steps < 1 or args.decide_steps < 1:
        raise SystemExit("--train-steps and --decide-steps must be >= 1")
    if args.seed < 0:
        raise SystemExit("--seed must be >= 0")
    if args.ne_budget is None and any("+gatehigh" in v for v in args.variant_names):
        raise SystemExit("--variants: a +gatehigh variant compares NE gates: give --ne-budget too (2e-4: 0.02%)")
    return args


def train_run(composer: Composer, args: argparse.Namespace, config: str, root: Path) -> tuple[JobConfig, Path]:
    """A short training run of `config` and its LoKA decision, as ``bench.e2e``'s continuations
    decide: ``--train-steps`` in bf16 (LoKA off; compile + CUDA graphs on a GPU), then
    ``--decide-steps`` more with LoKA aggressive resuming that checkpoint, every site sampled on
    every step and a re-plan every few steps, so that the plans are those of the trained
    weights; the decision runs eagerly (CUDA graphs on, for Dispatch's timings). Returns the LoKA job and the decided run's directory."""
    gpu = args.device == "cuda"
    configs, data = (DRY_CONFIGS, DRY_DATA) if args.dry_run else (CONFIGS, DATA)
    common = [
        *configs[config], *data, f"trainer={'gpu' if gpu else 'cpu'}", f"trainer.device={args.device}",
        f"trainer.batch_size={args.batch_sizes[-1] if not args.dry_run else 32}",
        "trainer.eval_batches=1", "trainer.eval_every=0", "trainer.checkpoint_at_end=true",
        "trainer.tensorboard=false", "trainer.progress_bar=false", f"trainer.seed={args.seed}",
        *(["trainer.dense_dtype=bf16", "trainer.compile_dense=true", "trainer.cuda_graphs=true"] if gpu else []),
    ]
    base = root / config / "base"
    run_job(composer.job([*common, f"trainer.steps={args.train_steps}", "trainer.resume=never",
                          f"trainer.out_dir={base}", "loka=off"]))
    job = composer.job([
        *common, f"trainer.steps={args.train_steps + args.decide_steps}", f"trainer.resume={base / 'latest'}",
        "trainer.resume_new_callbacks=true", f"trainer.out_dir={root / config / 'decided'}", "loka=aggressive",
        *decide_overrides(2 if args.dry_run else 5),
        # The plans do not depend on compilation: decide eagerly, as bench.e2e's decision runs do
        # (compiled, every sampled step and re-plan recompiles the towers).
        *(["trainer.compile_dense=false"] if gpu else []),
    ])
    run_job(job)
    return job, root / config / "decided" / "latest"


@dataclasses.dataclass
class NeGate:
    """``--ne-budget``: the batches the gate judges on (held-out, not those the NE is reported
    on), the bf16 model's NE there and the budget."""

    batches: list[Any]
    reference_ne: float
    budget: float


def build(
    variant: str, job: JobConfig, run: Path, device: torch.device, decide: Any = None, gate: NeGate | None = None,
) -> tuple[nn.Module | None, str, list[InferenceDecision], SafeForwards | None, list[GateStep]]:
    """The model of `variant` (called as ``model(dense, sparse) -> logits``), or None and why
    not; for ``+decided``, the plans re-decided at `decide`'s batch (``decide_for_batch``) and
    their table; with `gate`, a LoKA model's NE held to its budget (``hold_ne``), its steps."""
    decisions: list[InferenceDecision] = []
    steps: list[GateStep] = []
    safe = None
    if variant.startswith(("bf16", "torchao")):
        plain = replace(job, loka=replace(job.loka, enabled=False))  # the trained weights, no site
        model = cast(nn.Module, load_trained(plain, run, device=device).model.model)
        if variant.startswith("torchao"):
            why = _torchao(model)
            if why:
                return None, why, decisions, safe, steps
    else:
        trained = load_trained(job, run, device=device)
        safe = trained.safe_forwards
        served = ServeConfig(dtype="bf16", fast_accum="+fast" in variant)
        model = cast(nn.Module, serve(trained.model, plans=trained.plans, config=served).model)
        if "+decided" in variant:
            plans, decisions = decide_for_batch(model, _caller(decide, device), device=device,
                                                safe=safe, fast_accum=served.fast_accum)
            serve(model, plans=plans, config=served)
        if gate is not None:
            steps = hold_ne(model, lambda m: quality(m, gate.batches, device)["ne"], reference_ne=gate.reference_ne,
                            budget=gate.budget, config=served,
                            verdicts=None if safe is None else safe.verdicts, allow_rowwise="+gatehigh" not in variant)
    if "+compile" in variant:
        compile_served(model, graphs="+graphs" in variant)
    if "+skipguards" in variant:
        model = SkipGuards(model)
    return model, "", decisions, safe, steps


def _caller(batch: Any, device: torch.device) -> Callable[[nn.Module], Any]:
    """One call of a model on `batch`, under the bf16 autocast the models are served in."""
    def call(model: nn.Module) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model(batch.dense_features, batch.sparse_features)
    return call


def _torchao(model: nn.Module) -> str:
    """Apply torchao's float8 inference recipe in place; why not, where it cannot."""
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            PerRow,
            quantize_,
        )
    except Exception as exc:  # any import failure: the variant is not run, with the reason
        return f"not run: torchao float8 inference does not import ({type(exc).__name__}: {exc})"
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    last = linears[-1][0] if linears else None

    def fits(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and fqn != last
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    for _, linear in linears:  # the dense layers only: the embedding tables stay as trained
        linear.to(torch.bfloat16)
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=fits)
    return ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(model: nn.Module, batches: list[Any], calls: int, device: torch.device) -> list[float]:
    """Seconds of each of `calls` forwards, one batch after another."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    times = []
    with torch.no_grad(), autocast:
        for i in range(calls):
            b = batches[i % len(batches)]
            _sync(device)
            t0 = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()  # a new request: graphed outputs may be reused
            model(b.dense_features, b.sparse_features)
            _sync(device)
            times.append(time.perf_counter() - t0)
    return times


def paired_ratio(reference: nn.Module, model: nn.Module, batches: list[Any], pairs: int, calls: int,
                 device: torch.device) -> dict[str, Any]:
    """`model`'s throughput over `reference`'s, from `pairs` pairs of adjacent blocks of `calls`
    calls each (the order alternating from pair to pair, one untimed call before each block):
    each pair's ratio of block p50s compares the two under the same state of the machine, so a
    drift slower than a pair cancels. Returns the pairs' median, min, max and every ratio."""
    ratios, reference_p50s = [], []
    for k in range(pairs):
        p50 = {}
        for which in ((reference, model) if k % 2 == 0 else (model, reference)):
            time_calls(which, batches, 1, device)
            p50[id(which)] = statistics.median(time_calls(which, batches, calls, device))
        ratios.append(p50[id(reference)] / p50[id(model)])
        reference_p50s.append(p50[id(reference)])
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "ratios": ratios,
            "reference_p50_ms": statistics.median(reference_p50s) * 1e3}


def profile_calls(model: nn.Module, batches: list[Any], calls: int, device: torch.device,
                  p50_ms: float) -> dict[str, Any]:
    """Where `calls` calls of `model` spend their time, under torch.profiler
    (``bench.e2e.measure.summarize_profile``, per call): on a GPU the kernels' time, how busy the
    GPU is and how many kernels a call launches, by category (GEMM, quantization, embedding, ...),
    and the host's operators; on a CPU the operators' self time. Tells a call bound by its
    kernels from one bound by the host, whatever the machine's drift does to the latency."""
    from types import SimpleNamespace

    from torch.profiler import ProfilerActivity, profile

    from bench.e2e.measure import summarize_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        time_calls(model, batches, calls, device)
        wall = time.perf_counter() - t0
    clock = SimpleNamespace(profile=prof, profile_steps=calls, cuda=device.type == "cuda", profile_first=0,
                            sampled=[False] * calls, first_step=0, profile_wall_s=wall)
    try:
        got = summarize_profile(clock, p50_ms)  # type: ignore[arg-type]
    except RuntimeError as exc:  # no kernel recorded (CUPTI unavailable, ...): the timings stand
        return {"error": str(exc)}
    per_call = {k.replace("_per_step", "_per_call"): v for k, v in got.items()
                if k.endswith("_per_step") or k in ("source", "busy_fraction")}
    return {**per_call, "categories_ms_per_call": {c: v["ms_per_step"] for c, v in got["categories"].items()},
            "top_kernels": [{k.replace("_per_step", "_per_call"): v for k, v in t.items() if k != "us_per_call"}
                            for t in got["top_kernels"][:12]],
            "top_host_ops": [{k.replace("_per_step", "_per_call"): v for k, v in t.items()}
                             for t in got["top_host_ops"][:8]]}


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with its non-finite floats as None (JSON has no infinity)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}


def share_tables(model: nn.Module, donor: nn.Module | None) -> nn.Module:
    """`model` with `donor`'s embedding lookup (``sparse_arch``) in place of its own: every
    variant serves the same trained tables, held once. Returns the donor to keep (`model`'s
    own lookup where there is none yet)."""
    if donor is None:
        return model
    _served(model).sparse_arch = _served(donor).sparse_arch
    return donor


def _served(model: nn.Module) -> nn.Module:
    """The model a variant's calls reach (inside :class:`SkipGuards`)."""
    return model.model if isinstance(model, SkipGuards) else model


def quality(model: nn.Module, batches: list[Any], device: torch.device) -> dict[str, float]:
    logits, labels = [], []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for b in batches:
            torch.compiler.cudagraph_mark_step_begin()
            # A copy: a graphed model's next call reuses its output buffer.
            logits.append(model(b.dense_features, b.sparse_features).float().reshape(-1).clone())
            labels.append(b.labels.float())
    lg, lb = torch.cat(logits).cpu(), torch.cat(labels).cpu()
    return {"ne": normalized_entropy(lg, lb), "auc": auc(lg, lb)}


def same_settings(variant: str) -> str:
    """The bf16 variant with `variant`'s runtime settings."""
    rest = variant[len(next(m for m in MODELS if variant.startswith(m))):]
    return "bf16" + rest.replace("+decided", "").replace("+gatehigh", "").replace("+fast", "")


def allow_compiles(args: argparse.Namespace) -> Any:
    """Dynamo's limits raised to what the compiled variants need, and hitting one an error (a
    context manager).

    Every variant's towers share their code objects (``DenseArch.forward``, ...): each compiled
    model and batch size is one more cache entry of them, and past ``recompile_limit`` (8) dynamo
    would run the later variants eagerly with a warning, timing them as compiled ones."""
    compiled = sum("+compile" in v for v in args.variant_names) * len(args.batch_sizes)
    config = torch._dynamo.config
    return config.patch(
        recompile_limit=max(config.recompile_limit, 2 * compiled + 8),
        accumulated_recompile_limit=max(config.accumulated_recompile_limit, 8 * compiled + 64),
        fail_on_recompile_limit_hit=True,
    )


def bench_config(args: argparse.Namespace, config: str, job: JobConfig, run: Path,
                 progress: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Every variant of `config`'s checkpoint, measured (:func:`_bench_config`) under :func:`allow_compiles`."""
    with allow_compiles(args):
        return _bench_config(args, config, job, run, progress)


def _bench_config(args: argparse.Namespace, config: str, job: JobConfig, run: Path,
                  progress: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Every variant of `config`'s checkpoint: built, warmed up at each batch size (compiled
    there) and evaluated, then timed in ``--rounds`` rounds, each round timing every variant in
    turn (rotated from round to round), so that a drift of the machine spreads over all; the rows
    so far given to `progress`; then the paired ratios and the profiles."""
    device = torch.device(args.device)
    rows: dict[str, dict[str, Any]] = {}
    models: dict[str, dict[int, nn.Module]] = {}  # variant -> batch size -> model
    ledgers: dict[int, Ledger] = {}
    donor: nn.Module | None = None
    last = args.batch_sizes[-1]
    timed = {b: [x.to(device) for x in make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=b)
                 .batches(0, max(1, min(4, args.eval_batches)))] for b in args.batch_sizes}
    held_out = [x.to(device) for x in make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=last)
                .batches(0, args.eval_batches)]
    gate = None
    if args.ne_budget is not None:  # the next held-out batches: the gate does not choose on those it is judged on
        gate_batches = [x.to(device) for x in make_dataset(job.data, split="eval", rank=0, world_size=1, batch_size=last)
                        .batches(args.eval_batches, args.eval_batches)]
        if len(gate_batches) < args.eval_batches:
            raise SystemExit(f"--ne-budget: the eval split has {args.eval_batches + len(gate_batches)} batches of {last}, "
                             f"not the {2 * args.eval_batches} the gate needs: lower --eval-batches")
        plain = replace(job, loka=replace(job.loka, enabled=False))
        gate = NeGate(gate_batches, quality(cast(nn.Module, load_trained(plain, run, device=device).model.model),
                                            gate_batches, device)["ne"], args.ne_budget)
    counters = torch._dynamo.utils.counters
    skips = counters["inductor"]  # inductor's CUDA-graph skips, by reason
    for variant in args.variant_names:
        t0 = time.perf_counter()
        skipped = skips["cudagraph_skips"]
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        # A +decided variant: one model per batch size, its plans re-decided there.
        per_batch: dict[int, tuple[nn.Module | None, str, list[InferenceDecision], SafeForwards | None,
                                   list[GateStep]]] = {}
        for b in timed if "+decided" in variant else [last]:
            per_batch[b] = made = build(variant, job, run, device, decide=timed[b][0],
                                        gate=gate if variant.startswith("loka") else None)
            if made[0] is not None:  # its own tables dropped at once: one copy of them at a time
                sharing = donor is None
                donor = share_tables(made[0], donor)
                if sharing and args.embeddings != "trained":  # every variant serves these tables
                    serve_embeddings(donor, args.embeddings)
        if "+decided" not in variant:
            per_batch = {b: per_batch[last] for b in timed}
        model, why, _, safe, _ = per_batch[last]
        row: dict[str, Any] = {"config": config, "variant": variant, "status": "ok" if model is not None else why}
        if model is not None:
            built = {b: made[0] for b, made in per_batch.items() if made[0] is not None}
            for b, batches in timed.items():
                if variant == "loka" and not args.no_ledger:  # the eager served model records its shapes
                    # Every forward with a safe FP8 candidate: the limit of any re-decision.
                    ledgers[b] = forward_ledger(built[b], _caller(batches[0], device), device=device, safe=safe)
                time_calls(built[b], batches, args.warmup, device)
            row.update(quality(built[last], held_out, device))
            if gate is not None and variant.startswith("loka"):
                # One gate per model built: per batch size for +decided, else one (judged at the largest).
                row["ne_gate"] = {f"b{b}": [_finite(dataclasses.asdict(st)) for st in made[4]]
                                  for b, made in per_batch.items() if "+decided" in variant or b == last}
            if "+decided" in variant:
                row["decisions"] = {f"b{b}": [_finite(dataclasses.asdict(d)) for d in made[2]]
                                    for b, made in per_batch.items()}
                # Each batch size's plans on the same held-out batches (the row's NE: the largest's).
                row["ne_by_batch"] = {f"b{b}": quality(m, held_out, device)["ne"] for b, m in built.items()}
            models[variant] = built
        row["build_s"] = time.perf_counter() - t0
        if "+graphs" in variant:  # a graph inductor did not capture runs without CUDA graphs
            row["cudagraph_skips"] = skips["cudagraph_skips"] - skipped
        rows[variant] = row
        first = ""
        if model is not None:  # one pass now, so that a run stopped before the rounds still tells
            first_ms = {b: statistics.median(time_calls(built[b], batches, args.iters, device)) * 1e3
                        for b, batches in timed.items()}
            row["first_pass_p50_ms"] = {f"b{b}": ms for b, ms in first_ms.items()}
            first = "; first pass " + ", ".join(f"b{b} p50 {ms:.3f} ms" for b, ms in first_ms.items())
        if "+compile" in variant:  # what dynamo made of it (every batch size called): graphs, breaks by reason
            row["dynamo"] = {"graphs": counters["stats"]["unique_graphs"] - graphs, "graph_breaks": {
                reason[:200]: n - breaks.get(reason, 0) for reason, n in counters["graph_break"].items()
                if n > breaks.get(reason, 0)}}
        print(f"[inference] {config} {variant}: built and warmed up in {row['build_s']:.1f}s; {row['status']}{first}",
              flush=True)
        if progress is not None:  # what is built so far: a time limit in a later build keeps it
            progress(list(rows.values()))
    if not args.no_ledger and not ledgers and any(v.startswith("loka") for v in models):
        # No plain `loka` variant: an eager LoKA model of its own gives the ledger (a served model
        # records its GEMMs' shapes only when it runs eagerly); built, measured, dropped.
        eager, _, _, safe, _ = build("loka", job, run, device)
        if eager is not None:
            share_tables(eager, donor)
            for b, batches in timed.items():
                ledgers[b] = forward_ledger(eager, _caller(batches[0], device), device=device, safe=safe)
            del eager
    times: dict[str, dict[int, list[float]]] = {v: {b: [] for b in args.batch_sizes} for v in models}
    round_p50: dict[str, dict[int, list[float]]] = {v: {b: [] for b in args.batch_sizes} for v in models}
    names = list(models)
    for k in range(args.rounds):
        for v in names[k % len(names):] + names[:k % len(names)]:
            for b, batches in timed.items():
                time_calls(models[v][b], batches, min(2, args.warmup), device)  # back to this variant and size
                got = time_calls(models[v][b], batches, args.iters, device)
                times[v][b] += got
                round_p50[v][b].append(statistics.median(got) * 1e3)
    for v in names:
        for b in args.batch_sizes:
            ts = sorted(times[v][b])
            p50 = statistics.median(ts)
            rows[v][f"b{b}"] = {"p50_ms": p50 * 1e3, "p99_ms": ts[min(len(ts) - 1, int(0.99 * len(ts)))] * 1e3,
                                "samples_per_s": b / p50, "round_p50_ms": round_p50[v][b]}
        print(f"[inference] {config} {v}: " + ", ".join(
            f"b{b} p50 {rows[v][f'b{b}']['p50_ms']:.3f} ms" for b in args.batch_sizes), flush=True)
    out = _ratios(args, config, rows, ledgers)
    if progress is not None:  # the rounds' figures kept, whatever the rest of the run does
        progress(out)
    for v in names:
        if not args.pairs or v == REFERENCE or REFERENCE not in models:
            continue
        same = same_settings(v)
        for b, batches in timed.items():
            cell = rows[v][f"b{b}"]
            cell["paired_vs_ref"] = paired_ratio(models[REFERENCE][b], models[v][b], batches, args.pairs,
                                                 args.pair_calls, device)
            if same == REFERENCE:
                cell["paired_vs_same"] = cell["paired_vs_ref"]
            elif same in models and same != v:
                cell["paired_vs_same"] = paired_ratio(models[same][b], models[v][b], batches, args.pairs,
                                                      args.pair_calls, device)
        print(f"[inference] {config} {v}: paired x {REFERENCE} " + ", ".join(
            f"b{b} {rows[v][f'b{b}']['paired_vs_ref']['median']:.3f}" for b in args.batch_sizes), flush=True)
    if REFERENCE in rows and rows[REFERENCE]["status"] == "ok":
        for b, ledger in ledgers.items():  # the limit's shares again, from the paired timings now there
            for v in names:
                if v.startswith("loka"):
                    _of_limit(rows[v][f"b{b}"], ledger, rows[REFERENCE][f"b{b}"]["p50_ms"])
    if args.profile_calls:  # last: the profiler's overhead reaches no timing
        for v in names:
            rows[v]["profile"] = {
                f"b{b}": profile_calls(models[v][b], batches, args.profile_calls, device, rows[v][f"b{b}"]["p50_ms"])
                for b, batches in timed.items()}
    models.clear()
    return out


def _ratios(args: argparse.Namespace, config: str, rows: dict[str, dict[str, Any]],
            ledgers: dict[int, Ledger]) -> list[dict[str, Any]]:
    """`rows` with their ratios (against the reference, against bf16 with the same settings),
    then the forward-only ledger's rows with their limits (the rows' dicts, updated in place)."""
    ok = {v: r for v, r in rows.items() if r["status"] == "ok"}
    ref = ok.get(REFERENCE)
    for r in ok.values():
        same = ok.get(same_settings(r["variant"]))
        if ref is not None:
            r["ne_delta_rel_vs_ref"] = r["ne"] / ref["ne"] - 1
        for b in args.batch_sizes:
            cell = r[f"b{b}"]
            if ref is not None:
                cell["speedup_vs_ref"] = cell["samples_per_s"] / ref[f"b{b}"]["samples_per_s"]
            if same is not None:
                cell["speedup_vs_same"] = cell["samples_per_s"] / same[f"b{b}"]["samples_per_s"]
    out = list(rows.values())
    for b, ledger in ledgers.items():
        entry: dict[str, Any] = {"ledger": ledger.to_dict()}
        if ref is not None:
            entry["limit_vs_ref"] = _limit(ledger, ref[f"b{b}"]["p50_ms"])
            for r in ok.values():
                if r["variant"].startswith("loka"):
                    _of_limit(r[f"b{b}"], ledger, ref[f"b{b}"]["p50_ms"])
        out.append({"config": config, "variant": "forward ledger", "status": "ledger", f"b{b}": entry})
    return out


def _limit(ledger: Ledger, reference_ms: float) -> float | None:
    """The forward ledger's throughput limit over a reference latency of `reference_ms`, or None
    where the FP8 GEMMs' saving exceeds that latency (host-clock timings on a CPU)."""
    limit = ledger.predict(reference_ms, planned_step=False)["quant_free"]
    return limit if math.isfinite(limit) else None


def _of_limit(cell: dict[str, Any], ledger: Ledger, reference_p50_ms: float) -> None:
    """A LoKA cell's shares of the forward ledger's limit. ``of_limit``: where the cell was timed
    in pairs against the reference, its paired ratio over the limit the reference's paired block
    p50s give (both sides from the same interleaved blocks: a drift between the rounds cancels),
    else its ratio of p50s over the limit from the reference's p50 (`reference_p50_ms`);
    ``of_limit_from`` says which, ``of_limit_vs`` the limit taken. ``of_same_limit``: its paired
    ratio against bf16 with the same settings over the limit that bf16's paired block p50s give
    (of what the FP8 GEMMs could save on that step, what LoKA gets: compile's and graphs' gains
    apart)."""
    paired = cell.get("paired_vs_ref")
    if paired and "reference_p50_ms" in paired and (limit := _limit(ledger, paired["reference_p50_ms"])):
        cell.update(of_limit=paired["median"] / limit, of_limit_vs=limit, of_limit_from="paired")
    elif limit := _limit(ledger, reference_p50_ms):
        cell.update(of_limit=cell["speedup_vs_ref"] / limit, of_limit_vs=limit, of_limit_from="p50")
    same = cell.get("paired_vs_same")
    if same and "reference_p50_ms" in same and (limit := _limit(ledger, same["reference_p50_ms"])):
        cell.update(of_same_limit=same["median"] / limit, of_same_limit_vs=limit)


def render(result: dict[str, Any]) -> str:
    args = result["args"]
    sizes = args["batch_sizes"]
    tables = args.get("embeddings", "trained")
    lines = [f"# Inference: {result['device']}", "", f"- command: `{result['command']}`",
             f"- embedding tables (every variant): {'as trained' if tables == 'trained' else tables + ', TorchRec inference modules'}",
             "",
             "Throughput (samples/s) and p50 / p99 latency (ms) per batch size; `x ref`: against "
             f"{REFERENCE} of the same config; `x same`: against bf16 with the same settings; `paired`: "
             "the median ratio of adjacent, alternating blocks of calls of the two (drift cancels); "
             f"NE (relative to {REFERENCE}'s) and AUC on {args['eval_batches']} held-out batches of "
             f"{sizes[-1]}.", ""]
    lines += ["| config | variant | " + " | ".join(f"b{b}: samples/s, x ref, x same, p50 / p99 ms" for b in sizes)
              + " | NE (vs ref) | AUC |", "|" + "---|" * (4 + len(sizes))]
    limits: list[str] = []
    for r in result["rows"]:
        if r["status"] == "ledger":
            for b in sizes:
                e = r.get(f"b{b}")
                if e is not None and e.get("limit_vs_ref") is not None:
                    served = sum(row["plan"] != "high" for row in e["ledger"]["rows"])
                    limits.append(f"| {r['config']} | {b} | {served} / {len(e['ledger']['rows'])} | "
                                  f"{e['limit_vs_ref']:.3f}x |")
            continue
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {r['variant']} | {r['status']} |" + " |" * len(sizes))
            continue
        cells = []
        for b in sizes:
            c = r.get(f"b{b}")
            if c is None:  # built, not yet through the timed rounds (a run stopped there)
                first = r.get("first_pass_p50_ms", {}).get(f"b{b}")
                cells.append("-" if first is None else f"first pass p50 {first:.2f} ms, no timed rounds")
                continue
            ratios = ", ".join(
                f"{c[k]:.2f}x" + (f" (paired {c[p]['median']:.2f}x)" if p in c else "") if k in c else "-"
                for k, p in (("speedup_vs_ref", "paired_vs_ref"), ("speedup_vs_same", "paired_vs_same")))
            of = (f" ({c['of_limit']:.0%} of limit{', paired' if c.get('of_limit_from') == 'paired' else ''}"
                  + (f"; {c['of_same_limit']:.0%} of the same settings' limit" if "of_same_limit" in c else "")
                  + ")" if "of_limit" in c else "")
            cells.append(f"{c['samples_per_s']:,.0f}, {ratios}{of}, {c['p50_ms']:.2f} / {c['p99_ms']:.2f}")
        delta = f" ({r['ne_delta_rel_vs_ref']:+.3%})" if "ne_delta_rel_vs_ref" in r else ""
        lines.append(f"| {r['config']} | {r['variant']} | " + " | ".join(cells) + f" | {r['ne']:.5f}{delta} | {r['auc']:.4f} |")
    gated = [r for r in result["rows"] if r.get("ne_gate")]
    if gated:
        lines += ["", f"NE budget ({args['ne_budget']:.4%} of bf16's NE on {args['eval_batches']} other held-out "
                  "batches): each FP8 forward moved to hold it (to row-wise scales or high precision), and the NE "
                  "there after each.", ""]
        for r in gated:
            for b, steps in r["ne_gate"].items():
                trail = ", ".join(f"{st['moved']} to {st.get('to', 'high')} {st['ne_delta']:+.4%}" if st["moved"]
                                  else f"as served {st['ne_delta']:+.4%}" if i == 0 else "no move lowers the NE"
                                  for i, st in enumerate(steps))
                failed = [f"{site} row-wise ({why})" for st in steps for site, why in st.get("failed", {}).items()]
                trail += f"; failed and left out: {', '.join(failed)}" if failed else ""
                lines.append(f"- {r['config']} {r['variant']} ({b}): {trail}; {steps[-1]['fp8_forwards']} FP8 forwards")
    profiled = [r for r in result["rows"] if r.get("profile")]
    if profiled:
        lines += ["", "Where a call's time goes (torch.profiler, per call, after the timed rounds): "
                  "its p50 over the rounds; the kernels' time and the time the device is busy; kernels launched; "
                  "GEMM and quantization kernels' time; the host's ATen calls.", "",
                  "| config | variant | batch | p50 ms | kernel ms | busy ms | kernels | GEMM ms | quantize ms | "
                  "host ATen calls |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in profiled:
            for b in sizes:
                pr = r["profile"][f"b{b}"]
                if "error" in pr:
                    lines.append(f"| {r['config']} | {r['variant']} | {b} | not profiled: {pr['error']} |" + " |" * 6)
                    continue
                cats = pr["categories_ms_per_call"]
                lines.append(f"| {r['config']} | {r['variant']} | {b} | {r[f'b{b}']['p50_ms']:.3f} | "
                             f"{pr['kernel_ms_per_call']:.3f} | {pr['busy_ms_per_call']:.3f} | "
                             f"{pr.get('kernels_per_call', 0):.0f} | {cats['gemm']:.3f} | {cats['quantize']:.3f} | "
                             f"{pr['host_aten_calls_per_call']:.0f} |")
    if limits:
        lines += ["", "Forward-only ledger: the throughput limit against "
                  f"{REFERENCE} with each forward's fastest FP8 GEMM (its served plan's, or one the Probe judged "
                  "safe) at its measured time and its quantization free.", "",
                  "| config | batch | forwards served in FP8 (by the measured model) / with an FP8 candidate | limit |",
                  "|---|---|---|---|",
                  *limits]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    from bench.e2e.cli import init_process_group

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    rows: list[dict[str, Any]] = []
    command = "python -m bench.inference " + " ".join(sys.argv[1:] if argv is None else argv)

    def write(done: list[dict[str, Any]] | None = None) -> str:
        # After each config's rounds and at its end: a time limit loses at most what runs then.
        result = {
            "command": command,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "args": {k: v for k, v in vars(args).items()},
            "rows": rows if done is None else done,
        }
        (out / "inference.json").write_text(json.dumps(result, indent=1) + "\n")
        text = render(result)
        (out / "inference.md").write_text(text)
        return text

    def partial(got: list[dict[str, Any]]) -> None:  # the running config's rows after the finished ones
        write(rows + got)

    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="inference_") as tmp:
        if args.run is not None:
            from launch.export import run_config

            rows += bench_config(args, "run", run_config(args.run), Path(args.run),
                                 progress=partial)
        else:
            init_process_group(device.type)
            composer = Composer(stack)
            for config in args.config_names:
                job, run = train_run(composer, args, config, Path(tmp))
                rows += bench_config(args, config, job, run, progress=partial)
                write()
    print(write())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
