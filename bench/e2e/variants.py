"""The model variants of the benchmark and the job each of them runs.

A variant is a name (``bf16``, ``fp8_everywhere``, ``loka_safe``, ``torchao_rowwise``, ...) with
suffixes (``+compile``, ``+graphs``, ``+pageable``); :func:`resolve_variants` turns names into
:class:`Variant` records, and :func:`job_overrides` into the hydra overrides of one run, composed
by :class:`Composer` from ``conf/`` exactly as ``launch/train.py`` composes them. The torchao
variants convert the dense Linears with :class:`TorchaoFloat8`.

Example:
    >>> (v,) = resolve_variants(["loka_safe+compile+graphs"], "torch_scaled_mm")
    >>> (v.loka, v.compile, v.graphs)
    ('safe', True, True)
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from loka_train.runtime.callbacks import Callback
from loka_train.runtime.config import TrainerConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# ---------------------------------------------------------------------------- the grid
CONFIGS: dict[str, tuple[str, ...]] = {
    "dlrm": ("model=dlrm",),
    "dcn": (
        "model=dcn",
        "model.embedding_dim=128",
        "model.dense_arch_layer_sizes=[512,256,128]",
        "model.over_arch_layer_sizes=[1024,1024,512,256,1]",
        "model.dcn_num_layers=3",
        "model.dcn_low_rank_dim=512",
    ),
    "wukong": (
        "model=wukong",
        "model.embedding_dim=128",
        "model.dense_arch_layer_sizes=[512,256,128]",
        "model.over_arch_layer_sizes=[4096,2048,1024,1]",
        "model.wukong_num_layers=2",
        "model.wukong_num_fm_out=16",
        "model.wukong_fm_rank=16",
        "model.wukong_num_lcb_out=16",
        "model.wukong_mlp_hidden=4096",
    ),
}
DATA: tuple[str, ...] = ("data=synthetic",)
"""26 Criteo-like sparse features of 10k rows, 13 dense (conf/data/synthetic.yaml)."""

# Tiny, but with some dims that are multiples of 16 (torchao converts only those).
DRY_CONFIGS: dict[str, tuple[str, ...]] = {
    "dlrm": (
        "model=dlrm",
        "model.embedding_dim=16",
        "model.dense_arch_layer_sizes=[32,16]",
        "model.over_arch_layer_sizes=[32,1]",
    ),
    "dcn": (
        "model=dcn",
        "model.embedding_dim=16",
        "model.dense_arch_layer_sizes=[32,16]",
        "model.over_arch_layer_sizes=[32,1]",
        "model.dcn_num_layers=2",
        "model.dcn_low_rank_dim=4",
    ),
    "wukong": (
        "model=wukong",
        "model.embedding_dim=16",
        "model.dense_arch_layer_sizes=[32,16]",
        "model.over_arch_layer_sizes=[32,1]",
        "model.wukong_num_layers=1",
        "model.wukong_num_fm_out=4",
        "model.wukong_fm_rank=4",
        "model.wukong_num_lcb_out=4",
        "model.wukong_mlp_hidden=16",
    ),
}
DRY_DATA: tuple[str, ...] = (
    "data=synthetic",
    "data.num_sparse=4",
    "data.num_embeddings=200",
    "data.chunk_size=16",
    "data.max_pooling=3",
)

DEFAULT_VARIANTS = (
    "bf16",
    "bf16+compile",
    "fp8_everywhere",
    "torchao_tensorwise",
    "torchao_rowwise",
    "loka_safe",
    "loka_aggressive",
)
REFERENCE = "bf16"
LOKA_VARIANTS = ("loka_safe", "loka_aggressive")
TORCHAO_VARIANTS = ("torchao_tensorwise", "torchao_rowwise")


@dataclass(frozen=True)
class Variant:
    """One way of training the same job."""

    name: str
    description: str
    loka: str = "off"
    """conf/loka preset."""
    loka_overrides: tuple[str, ...] = ()
    """Hydra overrides of the preset (``loka.*``)."""
    compile: bool = False
    """``trainer.compile_dense``."""
    graphs: bool = False
    """``trainer.cuda_graphs``."""
    torchao: str | None = None
    """torchao float8 recipe name, or None."""
    decide: bool = False
    """LoKA: a decision run before the timed run (see the module docstring)."""
    pageable: bool = False
    """``trainer.pin_memory=false``: batches copied to the GPU from pageable memory."""
    replay_sampled: bool = False
    """``trainer.cuda_graphs_requested=true``: the Probe's sampled steps replay a capture of the
    sampled modules instead of running them eagerly."""
    compile_sampled: bool | None = None
    """``trainer.compile_sampled`` (only where ``compile`` is on: not in a decision run): None
    leaves the trainer's default (the Probe's sampled steps run the compiled modules, their
    sites reporting through taps), False runs the sampled modules' uncompiled code."""
    tile_grid: bool = False
    """The tensor-wise casts on one program a tile instead of their persistent grid
    (``kernels.triton_tensorwise._PROGRAMS_PER_SM``): what the grid changes in the step, on the
    same plans (``--share-decisions``)."""

    @property
    def sampled_compiled(self) -> bool:
        """Whether the timed run's sampled steps run the compiled modules: ``compile_sampled``
        as the trainer resolves it (``TrainerConfig.sampled_compiled``)."""
        return TrainerConfig(
            compile_dense=self.compile, cuda_graphs=self.graphs,
            cuda_graphs_requested=self.replay_sampled and self.graphs,
            compile_sampled=self.compile_sampled if self.compile else None,
        ).sampled_compiled


def base_variants(fp8_backend: str) -> dict[str, Variant]:
    everywhere = (
        "loka.enabled=true",
        "loka.mods.initial_plan=fp8_tensorwise",
        f"loka.mods.backend={fp8_backend}",
        "loka.probe.enabled=false",
        "loka.dispatch.enabled=false",
        "loka.guard.enabled=false",
        "loka.comm_enabled=false",
    )
    return {
        "bf16": Variant(name="bf16", description="bf16 autocast, eager, LoKA off"),
        "fp8_everywhere": Variant(
            name="fp8_everywhere",
            description=f"every site FP8 tensor-wise on {fp8_backend}, no probe/dispatch/guard/comm",
            loka_overrides=everywhere,
        ),
        "loka_high": Variant(
            name="loka_high",
            description="LoKA's converted sites, all in high precision; probe, dispatch, guard and comm "
            "off (what the conversion alone costs and changes)",
            loka_overrides=(
                "loka.enabled=true",
                "loka.mods.initial_plan=high",
                "loka.probe.enabled=false",
                "loka.dispatch.enabled=false",
                "loka.guard.enabled=false",
                "loka.comm_enabled=false",
            ),
        ),
        "torchao_tensorwise": Variant(
            name="torchao_tensorwise",
            description="torchao convert_to_float8_training, tensorwise recipe, compiled",
            compile=True,
            torchao="tensorwise",
        ),
        "torchao_rowwise": Variant(
            name="torchao_rowwise",
            description="torchao convert_to_float8_training, rowwise recipe, compiled",
            compile=True,
            torchao="rowwise",
        ),
        "loka_safe": Variant(
            name="loka_safe", description="LoKA, conf/loka/safe.yaml", loka="safe", decide=True
        ),
        "loka_aggressive": Variant(
            name="loka_aggressive",
            description="LoKA, conf/loka/aggressive.yaml",
            loka="aggressive",
            decide=True,
        ),
    }


SUFFIXES = ("compile", "graphs", "pageable", "replaysampled", "compilesampled", "eagersampled", "static", "dynamic",
            "nofold", "bits", "nobits", "foldgrad", "tail", "notail", "rotate", "rowwise", "highgw", "tilegrid")
"""Variant suffixes: ``+compile`` (``trainer.compile_dense``), ``+graphs`` (``trainer.cuda_graphs``);
both together replay the compiled code as CUDA graphs. ``+pageable`` (``trainer.pin_memory=false``)
measures what pinning the batches gains (on by default on CUDA). ``+replaysampled``
(``trainer.cuda_graphs_requested=true``, with ``+graphs``) replays the Probe's sampled steps
instead of running them. With ``+compile`` the sampled steps run the compiled modules, the sites
reporting through opaque ops (the trainer's default); ``+eagersampled``
(``trainer.compile_sampled=false``) runs the sampled modules' uncompiled code instead: what
compiling them gains. ``+compilesampled`` names the default (``trainer.compile_sampled=true``).
``+static``
(``loka.mods.static_scales=true``) quantizes tensor-wise activations and gradients with static
scales (``kernels.static_scales``; the aggressive preset's own setting), ``+dynamic``
(``loka.mods.static_scales=false``) with dynamic ones. ``+nofold`` (``loka.mods.fold_relu=false``)
keeps each ReLU a pass of its own instead of folding it into the next site's FP8 cast: what the
folding gains. ``+nobits`` (``loka.mods.relu_mask_bits=false``) keeps a folded ReLU's bf16
pre-activation for the backward's mask instead of one bit an element: what the bits save in
memory and time; ``+bits`` names the default (``loka.mods.relu_mask_bits=true``). ``+foldgrad``
(``loka.mods.fold_relu_grad=true``) has the site before a folded ReLU apply its backward in its
gradient's FP8 cast: what that saves. ``+tail`` (``loka.mods.dcn_tail_in_gemm=true``) computes a
DCN cross layer's tail in its ``W`` GEMM's epilogue instead of as an ``addcmul`` after it (the
default), and ``+notail`` names the default: what the epilogue saves. ``+rotate``
(``loka.probe.sites_per_step=2``) samples a rotating pair of sites on each sampled step instead
of the preset's schedule of sites: what a sampled step then costs. ``+rowwise``
(``loka.dispatch.scalings=[rowwise]``) lets Dispatch choose row-wise scaling only, and ``+highgw``
(``loka.dispatch.fp8_roles=[forward,grad_input]``) keeps every grad-weight in high precision: each
changes the plans (its own decision run), to tell what a preset's tensor-wise GEMMs or FP8
grad-weights cost in NE and buy in speed. ``+tilegrid`` runs the tensor-wise casts on one program
a tile instead of their persistent grid (:attr:`Variant.tile_grid`; the same plans, the same
payloads): what the grid changes in the step."""

LOKA_OVERRIDE_SUFFIXES = {
    "static": (", static tensor-wise scales", "loka.mods.static_scales=true"),
    "dynamic": (", dynamic tensor-wise scales", "loka.mods.static_scales=false"),
    "nofold": (", ReLUs not folded into the casts", "loka.mods.fold_relu=false"),
    "bits": (", folded ReLUs' masks kept as bits", "loka.mods.relu_mask_bits=true"),
    "nobits": (", folded ReLUs' pre-activations kept for their masks", "loka.mods.relu_mask_bits=false"),
    "foldgrad": (", folded ReLUs' backward in the producer's gradient cast", "loka.mods.fold_relu_grad=true"),
    "tail": (", DCN cross layers' tail in the W GEMM's epilogue", "loka.mods.dcn_tail_in_gemm=true"),
    "notail": (", DCN cross layers' tail after the GEMM", "loka.mods.dcn_tail_in_gemm=false"),
    "rotate": (", 2 sites a sampled step", "loka.probe.sites_per_step=2"),
    "rowwise": (", row-wise scaling only", "loka.dispatch.scalings=[rowwise]"),
    "highgw": (", grad-weights in high precision", "loka.dispatch.fp8_roles=[forward,grad_input]"),
}
"""LoKA suffixes that add one override to the preset: what the description says, the override."""

REFERENCE_SUFFIXES = ("compile", "graphs", "pageable")
"""The suffixes that bf16 shares with a variant in the same-settings comparison."""


def canonical_name(name: str) -> str:
    """`name` with its suffixes in SUFFIXES order: one name per variant whatever the order
    typed (the ratios and --profile-variants look variants up by name)."""
    stem, *suffixes = name.split("+")
    known = [s for s in SUFFIXES if s in suffixes]
    return "+".join([stem, *known, *(s for s in suffixes if s not in SUFFIXES)])


def resolve_variants(names: list[str], fp8_backend: str) -> list[Variant]:
    base = base_variants(fp8_backend)
    out = []
    for name in names:
        stem, *suffixes = name.split("+")
        if stem not in base or any(s not in SUFFIXES for s in suffixes) or len(set(suffixes)) != len(suffixes):
            loka_only = ("replaysampled", "compilesampled", "eagersampled", "tilegrid", *LOKA_OVERRIDE_SUFFIXES)
            allowed = sorted(base) + [
                f"{b}+{s}" for b in sorted(base) for s in SUFFIXES
                if not (base[b].compile and s == "compile") and not (base[b].loka == "off" and s in loka_only)
            ] + ["<variant>+compile+graphs"]
            raise SystemExit(f"--variants: unknown variant {name!r}; choose from {allowed}")
        v = base[stem]
        if "compile" in suffixes and v.compile:
            raise SystemExit(f"--variants: {stem} is always compiled; drop '+compile'")
        if "compile" in suffixes:
            v = replace(v, description=v.description + ", dense submodules compiled", compile=True)
        if "graphs" in suffixes:
            v = replace(v, description=v.description + ", dense step CUDA-graphed", graphs=True)
        if "pageable" in suffixes:
            v = replace(v, description=v.description + ", batches not pinned", pageable=True)
        if "replaysampled" in suffixes:
            if "graphs" not in suffixes or v.loka == "off":
                raise SystemExit(f"--variants: {name}: '+replaysampled' is for LoKA variants with '+graphs'")
            v = replace(v, description=v.description + ", sampled steps replayed", replay_sampled=True)
        if "compilesampled" in suffixes:
            if "compile" not in suffixes or "replaysampled" in suffixes or v.loka == "off":
                raise SystemExit(f"--variants: {name}: '+compilesampled' is for LoKA variants with '+compile' "
                                 "(and without '+replaysampled')")
            v = replace(v, description=v.description + ", sampled steps compiled", compile_sampled=True)
        if "eagersampled" in suffixes:
            if "compile" not in suffixes or "compilesampled" in suffixes or v.loka == "off":
                raise SystemExit(f"--variants: {name}: '+eagersampled' is for LoKA variants with '+compile' "
                                 "(and without '+compilesampled')")
            v = replace(v, description=v.description + ", sampled steps uncompiled", compile_sampled=False)
        if "dynamic" in suffixes and "static" in suffixes:
            raise SystemExit(f"--variants: {name}: '+dynamic' and '+static' exclude each other")
        if "bits" in suffixes and "nobits" in suffixes:
            raise SystemExit(f"--variants: {name}: '+bits' and '+nobits' exclude each other")
        if "nofold" in suffixes and ("bits" in suffixes or "nobits" in suffixes):
            raise SystemExit(f"--variants: {name}: '+bits' and '+nobits' choose how folded ReLUs keep their "
                             "masks, and '+nofold' folds none: drop one")
        if "nofold" in suffixes and "foldgrad" in suffixes:
            raise SystemExit(f"--variants: {name}: '+foldgrad' moves folded ReLUs' backward, and '+nofold' folds "
                             "none: drop one")
        if "tilegrid" in suffixes:
            if v.loka == "off":
                raise SystemExit(f"--variants: {name}: '+tilegrid' is for LoKA variants")
            v = replace(v, description=v.description + ", casts on one program a tile", tile_grid=True)
        for suffix, (what, override) in LOKA_OVERRIDE_SUFFIXES.items():
            if suffix in suffixes:
                if v.loka == "off":
                    raise SystemExit(f"--variants: {name}: '+{suffix}' is for LoKA variants")
                v = replace(v, description=v.description + what, loka_overrides=(*v.loka_overrides, override))
        out.append(replace(v, name=canonical_name(name)))
    if len({v.name for v in out}) != len(out):
        raise SystemExit(f"--variants: duplicates in {names}")
    return out


def with_loka_overrides(variants: list[Variant], overrides: list[str]) -> list[Variant]:
    """`variants` with `overrides` (``loka.*`` hydra overrides, ``--loka-override``) added to the
    preset of every LoKA variant (``loka_safe``, ``loka_aggressive``); the others unchanged.

    Example:
        >>> v = with_loka_overrides(resolve_variants(["bf16", "loka_safe"], "emulated"), ["loka.probe.sites_per_step=2"])
        >>> [x.loka_overrides for x in v]
        [(), ('loka.probe.sites_per_step=2',)]
    """
    for o in overrides:
        key, eq, _ = o.partition("=")
        if not eq or not key.startswith("loka.") or key.startswith("loka.enabled"):
            raise SystemExit(f"--loka-override {o!r}: give KEY=VALUE with a loka.* key other than loka.enabled "
                             "(e.g. loka.probe.sites_per_step=2)")
    if not overrides:
        return variants
    what = ", " + " ".join(overrides)
    return [
        replace(v, description=v.description + what, loka_overrides=(*v.loka_overrides, *overrides))
        if v.name.split("+")[0] in LOKA_VARIANTS else v
        for v in variants
    ]


# ----------------------------------------------------------------------- composition
class Composer:
    """Composes JobConfigs from conf/ (validated by the schema), like launch/train.py."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        from hydra import initialize_config_dir

        import launch.train  # noqa: F401  (registers the JobConfig schema)

        stack.enter_context(initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"))

    def job(self, overrides: list[str]) -> Any:
        from hydra import compose
        from omegaconf import OmegaConf

        from loka_train.job import JobConfig

        job = OmegaConf.to_object(compose(config_name="config", overrides=overrides))
        assert isinstance(job, JobConfig)
        return job


def job_overrides(
    args: argparse.Namespace,
    config: str,
    batch: int,
    variant: Variant,
    out_dir: str,
    *,
    steps: int,
    eval_batches: int,
    extra: tuple[str, ...] = (),
    resume: str = "never",
    checkpoint_at_end: bool = False,
) -> list[str]:
    """Hydra overrides of one run (also valid for ``launch/train.py``). ``resume="must"``
    continues the checkpoint under `out_dir` whatever callbacks it was written with."""
    configs, data = (DRY_CONFIGS, DRY_DATA) if args.dry_run else (CONFIGS, DATA)
    return [
        *configs[config],
        *data,
        f"data.cache_batches={args.cache_batches}",
        "trainer=gpu",
        f"trainer.device={args.device}",
        f"trainer.batch_size={batch}",
        f"trainer.steps={steps}",
        "trainer.dense_dtype=bf16",
        "trainer.sharding=table_wise",
        "trainer.pipeline=sparse_dist",
        "trainer.eval_every=0",
        f"trainer.eval_batches={eval_batches}",
        f"trainer.log_every={steps}",
        f"trainer.out_dir={out_dir}",
        f"trainer.resume={resume}",
        *(["trainer.resume_new_callbacks=true"] if resume != "never" else []),
        "trainer.tensorboard=false",
        "trainer.progress_bar=false",
        f"trainer.checkpoint_at_end={str(checkpoint_at_end).lower()}",
        f"trainer.compile_dense={str(variant.compile).lower()}",
        f"trainer.cuda_graphs={str(variant.graphs).lower()}",
        *(["trainer.pin_memory=false"] if variant.pageable else []),
        *(["trainer.cuda_graphs_requested=true"] if variant.replay_sampled else []),
        *([f"trainer.compile_sampled={str(variant.compile_sampled).lower()}"]
          if variant.compile_sampled is not None and variant.compile else []),
        f"trainer.compile_backend={args.compile_backend}",
        f"loka={variant.loka}",
        *variant.loka_overrides,
        *extra,
    ]


# ------------------------------------------------------------------------ torchao
def torchao_status() -> str | None:
    """None when torchao's float8 training imports, else why not."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:  # any import failure means: not run, with the reason
        return f"{type(exc).__name__}: {exc}"
    return None


TORCHAO_ROWWISE_TRANSPOSED_INPUT = ("proj", "mix", "residual")
"""Leaf names of the Linears that take a transposed 3-D input (Wukong's FM projection, LCB and
residual: ``Linear(x_BND.transpose(1, 2))``). torchao 0.17's row-wise recipe cannot compile
them ("aten.clone.default with axiswise scaling is not supported yet" on an H100), so that recipe leaves them in bf16 and runs on every other Linear."""


def torchao_modules(model: nn.Module, recipe: str) -> tuple[list[str], dict[str, str]]:
    """The Linear layers torchao ``recipe`` converts, and the others with why.

    Same rules for both recipes (the final logit layer stays high precision, like LoKA's; torchao
    needs both dims multiples of 16), plus, for ``rowwise``, no Linear of
    :data:`TORCHAO_ROWWISE_TRANSPOSED_INPUT`.
    """
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    last = linears[-1][0] if linears else None
    converted: list[str] = []
    skipped: dict[str, str] = {}
    for fqn, module in linears:
        if fqn == last:
            skipped[fqn] = "final logit layer (high precision, like LoKA)"
        elif module.in_features % 16 or module.out_features % 16:
            skipped[fqn] = f"{module.in_features}x{module.out_features}: not multiples of 16"
        elif recipe == "rowwise" and fqn.rsplit(".", 1)[-1] in TORCHAO_ROWWISE_TRANSPOSED_INPUT:
            skipped[fqn] = "transposed 3-D input: torchao's row-wise recipe does not compile it"
        else:
            converted.append(fqn)
    return converted, skipped


class TorchaoFloat8(Callback):
    """Converts the dense Linear layers with torchao ``convert_to_float8_training``
    (the layers :func:`torchao_modules` names)."""

    def __init__(self, recipe: str) -> None:
        self.recipe = recipe
        self.converted: list[str] = []
        self.skipped: dict[str, str] = {}

    def on_before_shard(self, trainer: Any) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        self.converted, self.skipped = torchao_modules(trainer.model, self.recipe)
        chosen = set(self.converted)

        def keep(module: nn.Module, fqn: str) -> bool:
            return not isinstance(module, nn.Linear) or fqn in chosen

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        trainer.model = convert_to_float8_training(trainer.model, config=config, module_filter_fn=keep)

