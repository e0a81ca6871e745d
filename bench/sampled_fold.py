"""What folding the ReLUs (``mods.fold_relu``) changes in training where the Probe's sampled steps
run compiled: per-step losses of a small Wukong on fixed plans, ReLUs folded or not, sampled
steps compiled or not.

    python -m bench.sampled_fold --out DIR [--plans FILE[,FILE...]] [--sampled compiled,eager]
                                 [--batches 4096] [--steps 24] [--every 3] [--interval 4]
                                 [--device cuda] [--no-graphs]

Each run (fold on / off x sampled steps compiled / uncompiled, ``--sampled``) trains the same
model from the same seed for ``--steps`` steps under the aggressive preset with Dispatch off, the
Probe sampling every ``--every``-th step (the first samples every site) and refreshing the static
scales every ``--interval`` steps. Each ``--plans`` file is a case of its own, which fixes each
site's plan: a JSON object
``{site: {"forward": "fp8:e4m3/tensorwise@torch_scaled_mm", "grad_input": ..., "grad_weight":
"high"}}`` as ``bench.e2e`` records them (``loka.plans``); sites it does not name keep the initial
tensor-wise FP8 plan. Folding must change nothing: the report gives, per sampled mode, the
relative gap between the folded and the unfolded run's loss at step 1 (the first step after the
first sampled step, which samples every site; the later steps of a short warm-up amplify any
difference) and the largest, next to the gaps that compiling the sampled steps makes on its own
(unfolded, compiled against uncompiled). ``--reset dense_arch,fmb.mlp.0`` adds, per plan file, a
case without the plans of the sites whose name holds each part: which site's plan matters.

Sites fold only where the Triton tensor-wise cast takes their input (``kernels.linear.folds_input_relu``):
on CUDA, and on the CPU under ``TRITON_INTERPRET=1``, where the plans keep their backends and the
initial plan runs on ``torch_scaled_mm``; elsewhere the plans run on the emulated backend, which
folds nothing. The runs train under DDP (the trainer's), whose compiled graphs dynamo splits at
its buckets: a folded ReLU's mask must survive such a split (``kernels.opaque.define``'s
``masked_grads``). ``--out`` writes ``sampled_fold.json`` (every run's losses, the plans given and those the sites
ran, the given sites the model lacks, the gaps).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from loka_train.kernels.plan import GemmPlan


def parse_gemm_plan(text: str) -> GemmPlan:
    """A ``GemmPlan`` from its string form (``str(plan)``: ``high`` or ``fp8:e5m2xe4m3/rowwise@triton``)."""
    from loka_train.kernels.formats import Fp8Format, Scaling
    from loka_train.kernels.plan import GemmPlan, Precision

    if text == "high":
        return GemmPlan()
    try:
        kind, rest = text.split(":", 1)
        fmts, rest = rest.split("/", 1)
        scaling, backend = rest.split("@", 1)
    except ValueError:
        raise ValueError(f"plan {text!r}: expected 'high' or 'fp8:FMT[xFMT_B]/SCALING@BACKEND'") from None
    if kind != "fp8":
        raise ValueError(f"plan {text!r}: expected 'high' or 'fp8:...'")
    fast = backend.endswith("+fast")
    fmt, _, fmt_b = fmts.partition("x")
    return GemmPlan(precision=Precision.FP8, fmt=Fp8Format(fmt), fmt_b=Fp8Format(fmt_b) if fmt_b else None,
                    scaling=Scaling(scaling), backend=backend.removesuffix("+fast"), fast_accum=fast)


def train(*, fold: bool, sampled_compiled: bool, plans: dict[str, dict[str, str]], batch: int, steps: int,
          every: int, interval: int, device: str, graphs: bool, out_dir: Path) -> dict[str, Any]:
    """One run: its per-step training losses (``losses``), every site's plan as the run ended
    (``plans``, ``str`` of each GEMM's), the sites of `plans` the model does not have
    (``missing``) and whether the casts could fold at all (``casts_fold``: Triton runs on
    `device`; elsewhere the plans run on the emulated backend, whose casts fold nothing).

    Raises:
        RuntimeError: where the model's folded ReLUs are not what `fold` asks.
    """
    from loka_train.data import DataConfig
    from loka_train.kernels.plan import LinearPlan
    from loka_train.kernels.triton_kernels import triton_runnable
    from loka_train.models import ModelConfig
    from loka_train.plugin.callback import LokaCallback
    from loka_train.plugin.config import LokaConfig
    from loka_train.runtime import Callback, TrainerConfig
    from loka_train.runtime.trainer import Trainer
    from tests.gpu._graphs_runs import MODELS  # the small Wukong of the GPU graphs test

    triton = triton_runnable(torch.device(device))[0]
    loka = LokaConfig.preset(
        "aggressive", probe={"every_k_steps": every, "window": 4, "interval": interval},
        dispatch={"enabled": False}, guard={"enabled": False},
        mods={"initial_plan": "fp8_tensorwise", "fold_relu": fold,
              "backend": "torch_scaled_mm" if triton else "emulated"},
    )
    if not triton:
        print(f"[sampled_fold] Triton does not run on {device} (on the CPU set TRITON_INTERPRET=1): the plans run "
              "on the emulated backend, whose casts fold no ReLU, so folded and unfolded runs compute the same",
              flush=True)
        plans = {site: {role: p.replace("@torch_scaled_mm", "@emulated").replace("@triton", "@emulated")
                        for role, p in roles.items()} for site, roles in plans.items()}
    loka_cb = LokaCallback(loka)

    class Fixed(Callback):
        """Sets the given plans after LoKA's start, and records each step's loss."""

        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_start(self, trainer: Any) -> None:
            for name, site in loka_cb.sites.items():
                if name in plans:
                    site.set_plan(LinearPlan(**{r: parse_gemm_plan(p) for r, p in plans[name].items()}))
                    if site.static_slots is None and hasattr(site, "enable_static_scales"):
                        site.enable_static_scales(margin=loka.mods.static_scale_margin,
                                                  spread=loka.mods.static_scale_spread, device=trainer.device)

        def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
            self.losses.append(metrics["train/loss"])

    fixed = Fixed()
    small: dict[str, Any] = MODELS["wukong"]
    trainer = Trainer(
        model=ModelConfig(**small), data=DataConfig(num_embeddings=10_000),
        trainer=TrainerConfig(
            steps=steps, batch_size=batch, device=device, dense_dtype="bf16", sharding="table_wise",
            log_every=1, eval_batches=1, out_dir=str(out_dir), tensorboard=False, progress_bar=False,
            checkpoint_at_end=False, resume="never", dense_lr=0.005, dense_warmup_steps=2,
            cuda_graphs=graphs, compile_dense=True, compile_sampled=sampled_compiled,
        ),
        callbacks=[loka_cb, fixed],
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    folded = [name for name, site in loka_cb.sites.items() if site.input_relu]
    if bool(folded) is not fold:
        raise RuntimeError(f"fold={fold} but the folded sites are {folded}")
    ended = {name: {r: str(getattr(site.plan, r)) for r in ("forward", "grad_input", "grad_weight")}
             for name, site in loka_cb.sites.items()}
    return {"losses": fixed.losses, "plans": ended, "missing": sorted(set(plans) - set(ended)), "casts_fold": triton}


def max_gap(a: list[float], b: list[float]) -> tuple[float, int]:
    """The largest per-step relative gap |a - b| / |b| and its step."""
    gaps = [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]
    step = max(range(len(gaps)), key=gaps.__getitem__)
    return gaps[step], step


def gaps_of(runs: dict[str, list[float]]) -> dict[str, dict[str, float | int]]:
    """Per sampled mode in `runs`, the folded run's gap to the unfolded one: at step 1, the first
    step after the first sampled step (later steps of a short warm-up amplify any difference),
    and the largest with its step; with both modes, the same for compiling the sampled steps
    (unfolded runs)."""
    pairs = {f"fold, sampled {m}": (f"fold=on sampled={m}", f"fold=off sampled={m}") for m in ("compiled", "eager")}
    pairs["compiling the sampled steps, unfolded"] = ("fold=off sampled=compiled", "fold=off sampled=eager")
    out: dict[str, dict[str, float | int]] = {}
    for what, (a, b) in pairs.items():
        if a in runs and b in runs:
            gap, step = max_gap(runs[a], runs[b])
            first = max_gap(runs[a][1:2], runs[b][1:2])[0] if len(runs[a]) > 1 else 0.0
            out[what] = {"step1": first, "gap": gap, "step": step}
    return out


def with_resets(cases: dict[str, dict[str, Any]], parts: list[str]) -> dict[str, dict[str, Any]]:
    """`cases` and, for each case and each name part of `parts`, a case ``<case>-<part>`` without
    the plans of the sites whose name contains that part (they keep the initial plan).

    Raises:
        SystemExit: where a part names no site of a case's plans (a typo would measure the case
            again under another name).
    """
    out = dict(cases)
    for case, plans in cases.items():
        for part in parts:
            kept = {site: roles for site, roles in plans.items() if part not in site}
            if len(kept) == len(plans):
                raise SystemExit(f"--reset {part!r}: no site of case {case!r} has it in its name")
            out[f"{case}-{part}"] = kept
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write sampled_fold.json here")
    p.add_argument("--plans", default="", help="comma-separated JSON files {site: {role: plan}} (bench.e2e's "
                   "loka.plans), one case each (none: every site on the initial plan)")
    p.add_argument("--reset", default="", help="comma-separated name parts: for each, one more case per plan file "
                   "whose sites with that part in their name keep the initial plan instead (to bisect)")
    p.add_argument("--sampled", default="compiled,eager", help="the sampled steps' modes to run: compiled, eager")
    p.add_argument("--batches", default="4096", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=3, help="the Probe samples every N-th step")
    p.add_argument("--interval", type=int, default=4, help="static scales refreshed every N steps")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="no CUDA graphs (the CPU needs this)")
    args = p.parse_args(argv)
    modes = [m for m in args.sampled.split(",") if m]
    if not modes or any(m not in ("compiled", "eager") for m in modes):
        raise SystemExit(f"--sampled {args.sampled!r}: a comma-separated list of compiled, eager")
    files = [Path(f) for f in args.plans.split(",") if f]
    cases = {f.stem: json.loads(f.read_text()) for f in files} if files else {"initial": {}}
    if len(cases) != max(len(files), 1):
        raise SystemExit(f"--plans {args.plans!r}: two files share a name; each names its case")
    cases = with_resets(cases, [r for r in args.reset.split(",") if r])
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "cases": {}}
    for case, plans in cases.items():
        result["cases"][case] = {"plans": plans, "batches": {}}
        for batch in (int(b) for b in args.batches.split(",")):
            runs: dict[str, list[float]] = {}
            ended: dict[str, Any] = {}
            for mode in modes:
                for fold in (True, False):
                    torch._dynamo.reset()
                    key = f"fold={'on' if fold else 'off'} sampled={mode}"
                    with tempfile.TemporaryDirectory() as tmp:
                        run = train(fold=fold, sampled_compiled=mode == "compiled", plans=plans, batch=batch,
                                    steps=args.steps, every=args.every, interval=args.interval,
                                    device=args.device, graphs=args.graphs, out_dir=Path(tmp))
                    runs[key], ended = run["losses"], run
                    if run["missing"]:
                        print(f"[sampled_fold] {case}: the model has no site {', '.join(run['missing'])}: their "
                              "plans are not set", flush=True)
                    print(f"[sampled_fold] {case} b{batch} {key}: " + " ".join(f"{x:.6f}" for x in runs[key]),
                          flush=True)
            gaps = gaps_of(runs)
            for what, g in gaps.items():
                print(f"[sampled_fold] {case} b{batch} {what}: {g['step1']:.2e} at step 1, largest {g['gap']:.2e} "
                      f"at step {g['step']}", flush=True)
            result["cases"][case]["batches"][str(batch)] = {
                "losses": runs, "gaps": gaps, "plans_run": ended["plans"], "plans_missing": ended["missing"],
                "casts_fold": ended["casts_fold"]}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sampled_fold.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
