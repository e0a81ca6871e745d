"""GPU tests of loka_train.export: a served site computes its training forward on the real
backends (torch._scaled_mm and Triton), with its weight quantized once, eagerly, through the
fused LayerNorm kernel, and under torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

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


@pytest.mark.parametrize("backend", ["torch_scaled_mm", "triton"])
def test_served_towers_export_and_compile_ahead_of_time_on_the_gpu(backend, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from loka_train.export import (
        aoti_package,
        export_dense,
        install_programs,
        load_programs,
        save_programs,
    )

    _needs_fp8()
    model = convert(Towers(256, 512), config=ModsConfig(enabled=True, keep_last_layer_high=True)).cuda()
    for site in sites(model).values():  # the logit layer stays an nn.Linear (keep_last_layer_high)
        site.set_plan(LinearPlan.fp8(backend=backend, scaling=Scaling.ROWWISE))
    served = serve(model)  # bf16
    batch = SimpleNamespace(dense_features=torch.randn(4096, 256, device="cuda"),
                            sparse_features=torch.randn(4096, 256, device="cuda"))
    programs = export_dense(served, batch)
    save_programs(programs, tmp_path)
    compiled = copy.deepcopy(served)
    for module in (compiled.dense_arch, compiled.over_arch):
        module.compile(backend="aot_eager", dynamic=False)
    fresh = install_programs(copy.deepcopy(served), load_programs(tmp_path))
    x, s = torch.randn(1000, 256, device="cuda"), torch.randn(1000, 256, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = compiled(x, s)
        assert torch.equal(fresh(x, s), expected)
        if backend != "torch_scaled_mm":  # one AOTInductor build (a C++ compile) per run of this file
            return
        package = torch._inductor.aoti_load_package(str(aoti_package(programs["dense_arch"], tmp_path / "d.pt2")))
        assert torch.allclose(package(x).float(), programs["dense_arch"].module()(x).float(), rtol=2e-2, atol=2e-2)


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
