"""The NE gate of a served model (``loka_train.export.gate``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_train.data.metrics import normalized_entropy
from loka_train.export import ServeConfig, format_gate, hold_ne, serve
from loka_train.kernels.formats import Scaling
from loka_train.kernels.plan import LinearPlan
from loka_train.mods import ModsConfig, convert, sites

FP32 = ServeConfig(dtype="fp32")


def _served(names_fp8: tuple[str, ...] = ("0", "2", "4")) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40), nn.ReLU(),
                        nn.Linear(40, 1))
    model = convert(net, config=ModsConfig(enabled=True))
    plan = LinearPlan.fp8(backend="emulated", scaling=Scaling.TENSORWISE)
    return serve(model, plans=dict.fromkeys(names_fp8, plan), config=FP32)


def _fp8(model: nn.Module) -> set[str]:
    return {n for n, s in sites(model).items() if s.plan.forward.is_fp8}


def test_the_gate_moves_the_forward_whose_move_lowers_the_ne_most_and_stops_within_the_budget() -> None:
    model = _served()
    cost = {"0": 1e-3, "2": 1e-4, "4": 3e-4}  # what each FP8 forward adds to the NE

    def ne(m: nn.Module) -> float:
        return 1.0 + sum(cost[n] for n in _fp8(m))

    steps = hold_ne(model, ne, reference_ne=1.0, budget=5e-4, config=FP32, rowwise_first=False)
    assert [s.moved for s in steps] == [None, "0"]
    assert steps[0].ne_delta == pytest.approx(1.4e-3) and steps[1].ne_delta == pytest.approx(4e-4)
    assert steps[1].tried == pytest.approx({"0": 4e-4, "2": 1.3e-3, "4": 1.1e-3})
    assert _fp8(model) == {"2", "4"} and steps[-1].fp8_forwards == 2
    # Within the budget as served: nothing moves.
    kept = hold_ne(_served(), ne, reference_ne=1.0, budget=2e-3, config=FP32, rowwise_first=False)
    assert [s.moved for s in kept] == [None]
    just_over = hold_ne(_served(), ne, reference_ne=1.0, budget=1.3e-3, config=FP32, rowwise_first=False)
    assert [s.moved for s in just_over] == [None, "0"]
    # A budget no FP8 forward meets: every one moves, in the order of what they cost.
    model = _served()
    steps = hold_ne(model, ne, reference_ne=1.0, budget=0.0, config=FP32, rowwise_first=False)
    assert [s.moved for s in steps] == [None, "0", "4", "2"] and not _fp8(model)
    assert {s.to for s in steps} == {"high"} and "| 1 | 0 | high |" in format_gate(steps)


def test_the_gate_serves_the_moved_sites_in_high_precision_and_the_rest_as_before() -> None:
    model = _served()
    x = torch.randn(256, 32)
    high = serve(_served(()), config=FP32)
    with torch.no_grad():
        labels = torch.bernoulli(torch.sigmoid(high(x).reshape(-1)), generator=torch.Generator().manual_seed(1))

        def ne(m: nn.Module) -> float:
            with torch.no_grad():
                return normalized_entropy(m(x).reshape(-1), labels)

        kept = model(x)
        steps = hold_ne(model, ne, reference_ne=ne(high), budget=0.0, config=FP32, rowwise_first=False)
        moved = {st.moved for st in steps[1:]}
        assert moved and all(not sites(model)[n].plan.forward.is_fp8 for n in moved)
        # The rest as before: their FP8 forward, their weight served once.
        assert all(sites(model)[n].plan.forward.is_fp8 and sites(model)[n].served is not None
                   for n in {"0", "2", "4"} - moved)
        assert steps[0].ne_delta == pytest.approx(ne(_served()) / ne(high) - 1)
        # Every FP8 forward moved (a budget of 0 that FP8 misses): the model is the high one.
        if steps[-1].fp8_forwards == 0:
            assert torch.allclose(model(x), high(x), atol=1e-6)
        else:  # stopped within the budget: what it served then, recomputed
            assert ne(model) / ne(high) - 1 == pytest.approx(steps[-1].ne_delta) and steps[-1].ne_delta <= 0
        assert not torch.equal(kept, model(x))


def test_a_trial_that_raises_leaves_the_model_as_served() -> None:
    model = _served()

    def ne(m: nn.Module) -> float:
        if "0" not in _fp8(m):
            raise RuntimeError("evaluation failed")
        return 1.01

    with pytest.raises(RuntimeError, match="evaluation failed"):
        hold_ne(model, ne, reference_ne=1.0, budget=0.0, config=FP32, rowwise_first=False)
    assert _fp8(model) == {"0", "2", "4"}
    assert all(sites(model)[n].served is not None for n in ("0", "2", "4"))  # each weight served again
    with pytest.raises(ValueError, match="NE is nan"):
        hold_ne(_served(), lambda m: float("nan"), reference_ne=1.0, budget=1e-4, config=FP32)


def test_the_gate_refuses_a_negative_budget_and_a_reference_without_an_ne() -> None:
    with pytest.raises(ValueError, match="budget"):
        hold_ne(_served(), lambda m: 1.0, reference_ne=1.0, budget=-1e-4, config=FP32)
    with pytest.raises(ValueError, match="reference_ne"):
        hold_ne(_served(), lambda m: 1.0, reference_ne=float("nan"), budget=1e-4, config=FP32)


def _scalings(model: nn.Module) -> dict[str, str]:
    return {n: str(s.plan.forward.scaling) if s.plan.forward.is_fp8 else "high" for n, s in sites(model).items()}


def _ladder_ne(cost: dict[str, dict[str, float]]):  # type: ignore[no-untyped-def]
    def ne(m: nn.Module) -> float:  # what each site adds to the NE, by how it serves its forward
        return 1.0 + sum(cost[n][k] for n, k in _scalings(m).items() if n in cost)
    return ne


def test_the_gate_moves_a_tensorwise_forward_rowwise_before_high_precision() -> None:
    cost = {"0": {"tensorwise": 1e-3, "rowwise": 1e-4, "high": 0.0},
            "2": {"tensorwise": 1e-4, "rowwise": 1e-4, "high": 0.0},
            "4": {"tensorwise": 3e-4, "rowwise": 0.0, "high": 0.0}}
    model = _served()
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=1.0, budget=3e-4, config=FP32)
    # Step 1: each site one rung finer ("0" row-wise lowers the NE most); step 2: "0" would go
    # high (4e-4), "4" row-wise (2e-4): the budget holds with every forward still FP8.
    assert [(s.moved, s.to) for s in steps] == [(None, "high"), ("0", "fp8:e4m3/rowwise@emulated"),
                                                ("4", "fp8:e4m3/rowwise@emulated")]
    assert steps[1].tried == pytest.approx({"0": 5e-4, "2": 1.4e-3, "4": 1.1e-3})
    assert steps[2].tried == pytest.approx({"0": 4e-4, "2": 5e-4, "4": 2e-4})
    assert _scalings(model) == {"0": "rowwise", "2": "tensorwise", "4": "rowwise"}
    assert steps[-1].ne_delta == pytest.approx(2e-4) and steps[-1].fp8_forwards == 3
    assert all(sites(model)[n].served is not None for n in ("0", "2", "4"))  # each weight quantized for its plan
    assert "| 1 | 0 | fp8:e4m3/rowwise@emulated | +0.0500% | 3 |" in format_gate(steps)
    # A budget of 0: a row-wise forward's next rung is high precision; "4" row-wise costs nothing
    # and stays (a tie goes to the first site).
    model = _served()
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=1.0, budget=0.0, config=FP32)
    rw = "fp8:e4m3/rowwise@emulated"
    assert [(s.moved, s.to) for s in steps[1:]] == [("0", rw), ("4", rw), ("0", "high"), ("2", rw), ("2", "high")]
    assert _scalings(model) == {"0": "high", "2": "high", "4": "rowwise"} and steps[-1].ne_delta == 0


def test_the_probes_verdicts_keep_an_unsafe_rowwise_forward_off_the_ladder() -> None:
    from types import SimpleNamespace

    from loka_train.export import next_rung
    from loka_train.kernels.formats import Fp8Format
    from loka_train.kernels.plan import GemmPlan

    cost = {"0": {"tensorwise": 1e-3, "rowwise": 1e-4, "high": 0.0}}
    verdict = {ok: SimpleNamespace(safe=ok, fmt_b=Fp8Format.E4M3) for ok in (True, False)}
    # The Probe judged "0"'s row-wise forward unsafe: it goes straight to high precision.
    model = _served(("0",))
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=1.0, budget=0.0, config=FP32,
                    verdicts={("0", "forward", Fp8Format.E4M3, Scaling.ROWWISE): verdict[False]})
    assert [(s.moved, s.to) for s in steps[1:]] == [("0", "high")]
    model = _served(("0",))
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=1.0, budget=2e-4, config=FP32,
                    verdicts={("0", "forward", Fp8Format.E4M3, Scaling.ROWWISE): verdict[True]})
    assert [(s.moved, s.to) for s in steps[1:]] == [("0", "fp8:e4m3/rowwise@emulated")]
    # The rungs: no verdict for the twin is no safe verdict; a backend without row-wise scales,
    # a row-wise or a block-scaled forward go to high precision.
    tw = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="torch_scaled_mm", fast_accum=True)
    assert next_rung("0", tw) == GemmPlan(precision="fp8", scaling=Scaling.ROWWISE, backend="torch_scaled_mm",
                                          fast_accum=True)
    assert next_rung("0", tw, {}) == GemmPlan()
    assert next_rung("0", GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="mine")) == GemmPlan()
    assert next_rung("0", GemmPlan(precision="fp8", scaling=Scaling.ROWWISE)) == GemmPlan()
    assert next_rung("0", GemmPlan(precision="fp8", scaling=Scaling.BLOCK)) == GemmPlan()
