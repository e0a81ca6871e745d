"""GPU tests of loka_train.export: a served site computes its training forward on the real
backends (torch._scaled_mm and Triton), with its weight quantized once, eagerly, through the
fused LayerNorm kernel, and under torch.compile."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import loka_train.export.serving as serving_module
from loka_train.export import compare_sites, serve, served_sites
from loka_train.kernels.capability import fp8_available
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import LinearPlan
from loka_train.mods import ModsConfig, convert, sites
from loka_train.mods.site import Fp8Linear
from tests.towers import Towers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _needs_fp8() -> None:
    ok, why = fp8_available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))
    return convert(net, config=ModsConfig(enabled=True)).cuda()


@pytest.mark.parametrize("backend", ["torch_scaled_mm", "triton"])
@pytest.mark.parametrize("scaling", [Scaling.TENSORWISE, Scaling.ROWWISE])
def test_served_sites_are_their_training_forward_on_the_gpu(backend, scaling, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _needs_fp8()
    trained = _mlp()
    plan = LinearPlan.fp8(backend=backend, scaling=scaling)
    for site in sites(trained).values():
        site.set_plan(plan)
    served = serve(copy.deepcopy(trained))  # bf16
    x = torch.randn(4096, 256, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = trained(x)
        weights: list[bool] = []
        real = serving_module.quantize_operand
        monkeypatch.setattr(serving_module, "quantize_operand",
                            lambda *a, **k: (weights.append(k["is_weight"]), real(*a, **k))[1])
        got = served(x)
        eager_casts = list(weights)
        compiled = torch.compile(served)(x)
    assert torch.equal(got, expected)
    assert eager_casts == [False, False]  # two FP8 sites, their inputs only
    assert torch.equal(compiled, got)
    assert all(v.endswith("weight quantized once") for v in served_sites(served).values())


def test_the_fused_layernorm_feeds_a_served_site_on_the_gpu() -> None:
    _needs_fp8()
    torch.manual_seed(3)
    norm = nn.LayerNorm(512).cuda()
    site = Fp8Linear.from_linear(nn.Linear(512, 1024).cuda(), plan=LinearPlan.fp8(backend="torch_scaled_mm"))
    site.site_name = "s"
    holder = nn.ModuleDict({"s": site})
    x = torch.randn(8192, 512, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = site.forward_layernorm(x, norm, activation="relu")
        serve(holder)
        got = site.forward_layernorm(x, norm, activation="relu")
        rows = compare_sites(holder, lambda m: m["s"].forward_layernorm(x, norm, activation="relu"))
    assert torch.equal(got, expected)
    assert rows[0].local_sqnr_db > 25


def _served_towers(plan: LinearPlan | None) -> tuple[nn.Module, dict[str, Any]]:
    from types import SimpleNamespace

    from loka_train.export import export_dense

    model = convert(Towers(256, 512), config=ModsConfig(enabled=True, keep_last_layer_high=True)).cuda()
    if plan is not None:
        for site in sites(model).values():  # the logit layer stays an nn.Linear (keep_last_layer_high)
            site.set_plan(plan)
    served = serve(model)  # bf16
    batch = SimpleNamespace(dense_features=torch.randn(4096, 256, device="cuda"),
                            sparse_features=torch.randn(4096, 256, device="cuda"))
    return served, export_dense(served, batch)


@pytest.mark.parametrize("backend", ["torch_scaled_mm", "triton"])
def test_served_towers_export_as_programs_on_the_gpu(backend, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from loka_train.export import install_programs, load_programs, save_programs

    _needs_fp8()
    served, programs = _served_towers(LinearPlan.fp8(backend=backend, scaling=Scaling.ROWWISE))
    save_programs(programs, tmp_path)
    compiled = copy.deepcopy(served)
    for module in (compiled.dense_arch, compiled.over_arch):
        module.compile(backend="aot_eager", dynamic=False)
    fresh = install_programs(copy.deepcopy(served), load_programs(tmp_path))
    x, s = torch.randn(1000, 256, device="cuda"), torch.randn(1000, 256, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.equal(fresh(x, s), compiled(x, s))


@pytest.mark.parametrize("scaling", [Scaling.TENSORWISE, Scaling.ROWWISE])
def test_served_sites_compile_without_graph_breaks_on_the_gpu(scaling) -> None:  # type: ignore[no-untyped-def]
    # A graph break per served site splits a compiled tower into pieces: a dynamo cache lookup
    # and, under CUDA graphs, a graph launch each, which costs more than the FP8 GEMMs save.
    _needs_fp8()
    model = _mlp()
    plan = LinearPlan.fp8(backend="torch_scaled_mm", scaling=scaling)
    for site in sites(model).values():
        site.set_plan(plan)
        if scaling is Scaling.TENSORWISE:
            site.enable_static_scales(margin=2.0, spread=16.0, device=torch.device("cuda"))
    served = serve(model)  # bf16
    x = torch.randn(4096, 256, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        served(x)  # seeds the static scales: later calls quantize x with the seeded scale
        expected = served(x)
        explained = torch._dynamo.explain(served)(x)
        torch._dynamo.reset()
        compiled = torch.compile(served)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert torch.equal(compiled, expected)


def test_skip_guards_replays_each_tower_and_batch_size_its_own_cuda_graph() -> None:
    from loka_train.export import SkipGuards, compile_served

    _needs_fp8()
    served, _ = _served_towers(LinearPlan.fp8(backend="torch_scaled_mm", scaling=Scaling.ROWWISE))
    calls = [(torch.randn(b, 256, device="cuda"), torch.randn(b, 256, device="cuda")) for b in (512, 4096) * 3]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = [served(d, s).clone() for d, s in calls]
        torch._dynamo.reset()
        compile_served(served, graphs=True)
        fast = SkipGuards(served)
        got = []
        for d, s in calls:
            torch.compiler.cudagraph_mark_step_begin()
            got.append(fast(d, s).clone())
    for g, want in zip(got, expected, strict=True):
        torch.testing.assert_close(g, want, atol=2e-2, rtol=2e-2)
    assert (fast.cold_calls, fast.warm_calls) == (2, 4)


# Last: two AOTInductor builds and two fresh processes take minutes, a run's time limit reaches them last.
_LOAD_PACKAGE = """
import sys, torch
import loka_train.export  # registers the FP8 ops a package may call
package = torch._inductor.aoti_load_package(sys.argv[1])
with torch.no_grad():
    torch.save(package(torch.load(sys.argv[2])).cpu(), sys.argv[3])
"""


def _load_in_a_process(package: Path, x: Tensor, tmp_path: Path) -> tuple[int, str, Tensor | None]:
    """Load and call `package` in a fresh process (a runtime that crashes or hangs takes only that
    one): its return code (-1 where it ran past 150 s), the end of its error output, its output."""
    import subprocess
    import sys

    x_path, y_path = tmp_path / f"{package.stem}_x.pt", tmp_path / f"{package.stem}_y.pt"
    torch.save(x, x_path)
    try:
        done = subprocess.run([sys.executable, "-c", _LOAD_PACKAGE, str(package), str(x_path), str(y_path)],
                              capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as exc:
        return -1, f"did not finish loading and calling the package within {exc.timeout} s", None
    return done.returncode, done.stderr[-500:], torch.load(y_path) if done.returncode == 0 else None


def test_served_towers_compile_ahead_of_time_on_the_gpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # First an AOTInductor build (a C++ compile) of a bf16 tower without LoKA's ops: where this
    # torch's AOTInductor runtime cannot load even that one, the FP8 package is not LoKA's to fix
    # (the test says so instead of asserting on it, without building the FP8 one). Then the FP8
    # tower's.
    from loka_train.export import aoti_package

    _needs_fp8()
    x = torch.randn(1000, 256, device="cuda")
    _, bf16 = _served_towers(None)
    rc_bf16, err_bf16, _ = _load_in_a_process(aoti_package(bf16["dense_arch"], tmp_path / "bf16.pt2"), x, tmp_path)
    if rc_bf16 != 0:
        pytest.skip(f"torch {torch.__version__}'s AOTInductor runtime fails to load a bf16 package without "
                    f"LoKA's ops (return code {rc_bf16}: {err_bf16[-200:]})")
    _, fp8 = _served_towers(LinearPlan.fp8(backend="torch_scaled_mm", scaling=Scaling.ROWWISE))
    rc, err, got = _load_in_a_process(aoti_package(fp8["dense_arch"], tmp_path / "fp8.pt2"), x, tmp_path)
    assert rc == 0, err
    with torch.no_grad():
        expected = fp8["dense_arch"].module()(x).float().cpu()
    assert got is not None and torch.allclose(got.float(), expected, rtol=2e-2, atol=2e-2)
