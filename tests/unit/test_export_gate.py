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


def test_the_gate_takes_the_cheapest_move_within_the_budget_else_the_most_ne_for_its_price() -> None:
    model = _served()
    cost = {"0": 1e-3, "2": 1e-4, "4": 3e-4}  # what each FP8 forward adds to the NE

    def ne(m: nn.Module) -> float:
        return 1.0 + sum(cost[n] for n in _fp8(m))

    steps = hold_ne(model, ne, reference_ne=1.0, budget=5e-4, config=FP32, allow_rowwise=False)
    assert [s.moved for s in steps] == [None, "0"]
    assert steps[0].ne_delta == pytest.approx(1.4e-3) and steps[1].ne_delta == pytest.approx(4e-4)
    assert {n: t["high"] for n, t in steps[1].tried.items()} == pytest.approx({"0": 4e-4, "2": 1.3e-3, "4": 1.1e-3})
    assert all(list(t) == ["high"] for t in steps[1].tried.values())  # no row-wise move tried
    assert _fp8(model) == {"2", "4"} and steps[-1].fp8_forwards == 2
    # Within the budget as served: nothing moves.
    kept = hold_ne(_served(), ne, reference_ne=1.0, budget=2e-3, config=FP32, allow_rowwise=False)
    assert [s.moved for s in kept] == [None]
    # Each of the three moves reaches 1.3e-3: the cheapest, the smallest forward (48 x 40 < 32 x
    # 64 < 64 x 48), not the one that lowers the NE most.
    just_over = hold_ne(_served(), ne, reference_ne=1.0, budget=1.3e-3, config=FP32, allow_rowwise=False)
    assert [s.moved for s in just_over] == [None, "4"] and just_over[1].ne_delta == pytest.approx(1.1e-3)
    # A budget no FP8 forward meets: every one moves, the most NE for its price first ("0": 1e-3
    # for 2048, "4": 3e-4 for 1920, "2": 1e-4 for 3072).
    model = _served()
    steps = hold_ne(model, ne, reference_ne=1.0, budget=0.0, config=FP32, allow_rowwise=False)
    assert [s.moved for s in steps] == [None, "0", "4", "2"] and not _fp8(model)
    assert [s.to for s in steps] == [None, "high", "high", "high"] and "| 1 | 0 | high |" in format_gate(steps)


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
        steps = hold_ne(model, ne, reference_ne=ne(high), budget=0.0, config=FP32, allow_rowwise=False)
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
        hold_ne(model, ne, reference_ne=1.0, budget=0.0, config=FP32, allow_rowwise=False)
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


RW = "fp8:e4m3/rowwise@emulated"


def test_the_gate_takes_a_rowwise_move_where_one_brings_the_ne_within_the_budget() -> None:
    cost = {"0": {"tensorwise": 1e-3, "rowwise": 1e-4, "high": 0.0},
            "2": {"tensorwise": 1e-4, "rowwise": 1e-4, "high": 0.0},
            "4": {"tensorwise": 3e-4, "rowwise": 0.0, "high": 0.0}}
    model = _served()
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=1.0, budget=6e-4, config=FP32)
    # As served +1.4e-3. No move reaches 6e-4 but "0" high (4e-4) and "0" row-wise (5e-4): row-wise.
    assert [(s.moved, s.to) for s in steps] == [(None, None), ("0", RW)]
    expected = {"0": {RW: 5e-4, "high": 4e-4}, "2": {RW: 1.4e-3, "high": 1.3e-3}, "4": {RW: 1.1e-3, "high": 1.1e-3}}
    assert steps[1].tried.keys() == expected.keys()
    assert all(steps[1].tried[n] == pytest.approx(expected[n]) for n in expected)
    assert _scalings(model) == {"0": "rowwise", "2": "tensorwise", "4": "tensorwise"}
    assert steps[-1].ne_delta == pytest.approx(5e-4) and steps[-1].fp8_forwards == 3
    # Each weight quantized again for the plan it serves.
    assert all(sites(model)[n].served.gemm == sites(model)[n].plan.forward for n in ("0", "2", "4"))
    # Each move's price, by which the step chose: a fifth of the forward (32 x 64, never run) row-wise.
    assert steps[1].prices["0"] == pytest.approx({RW: 0.2 * 2048, "high": 2048.0})
    assert "| 1 | 0 | fp8:e4m3/rowwise@emulated | 410 | +0.0500% | 3 |" in format_gate(steps)
    # Out of reach in one move: the most NE for its price ("0" row-wise: 9e-4 for a fifth of its
    # forward, where high lowers 1e-3 for all of it), then, within 2e-4, "4" row-wise (2e-4),
    # cheaper than "4" high (2e-4 too) and than "0" high.
    model = _served()
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=1.0, budget=2e-4, config=FP32)
    assert [(s.moved, s.to) for s in steps[1:]] == [("0", RW), ("4", RW)]
    assert _scalings(model) == {"0": "rowwise", "2": "tensorwise", "4": "rowwise"} and steps[-1].fp8_forwards == 3
    assert steps[-1].ne_delta == pytest.approx(2e-4)


def test_the_moves_are_priced_by_the_forward_they_give_up() -> None:
    from loka_train.export import ROWWISE_PRICE, forward_price
    from loka_train.kernels.plan import GemmPlan

    model = _served()
    with torch.no_grad():
        model(torch.randn(16, 32))
    site = sites(model)["2"]  # 64 -> 48, 16 rows as last run
    tensorwise = site.plan.forward
    assert forward_price(site, GemmPlan()) == 16 * 64 * 48
    assert forward_price(site, tensorwise) == 0.0
    assert forward_price(site, LinearPlan.fp8(backend="emulated", scaling=Scaling.ROWWISE).forward) \
        == pytest.approx(ROWWISE_PRICE * 16 * 64 * 48)
    # A price of the caller's: "0" costs most to move, so the others go first, cheapest within the
    # budget when one is.
    cost = {"0": 1e-3, "2": 6e-4, "4": 8e-4}
    price = {"0": 100.0, "2": 1.0, "4": 1.0}

    def ne(m: nn.Module) -> float:
        return 1.0 + sum(cost[n] for n in _fp8(m))

    def priced(name: str, forward: GemmPlan) -> float:
        return 0.0 if forward.is_fp8 else price[name]

    steps = hold_ne(_served(), ne, reference_ne=1.0, budget=0.0, config=FP32, allow_rowwise=False, price=priced)
    assert [s.moved for s in steps[1:]] == ["4", "2", "0"]
    # Within 1.85e-3 (as served 2.4e-3) go "0" (to 1.4e-3, at 100), "4" (1.6e-3, at 1) and "2"
    # (1.8e-3, at 1): the cheapest, the lower NE of the two at 1.
    steps = hold_ne(_served(), ne, reference_ne=1.0, budget=1.85e-3, config=FP32, allow_rowwise=False, price=priced)
    assert [s.moved for s in steps[1:]] == ["4"]
    with pytest.raises(ValueError, match="price of serving 0's forward as high is nan"):
        hold_ne(_served(), ne, reference_ne=1.0, budget=0.0, config=FP32, allow_rowwise=False,
                price=lambda name, forward: float("nan") if name == "0" and not forward.is_fp8 else 1.0)


def test_the_gate_stops_where_no_move_lowers_the_ne() -> None:
    cost = {"0": {"tensorwise": 2e-4, "rowwise": 2e-4, "high": 0.0}}  # "2" and "4" cost nothing
    model = _served()
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=0.999, budget=0.0, config=FP32)
    # "0" high lowers the NE; then nothing does (the 0.1% left is not the FP8 forwards'): "2" and
    # "4" keep their FP8 forwards, and the last step records the round that found no move.
    assert [(s.moved, s.to) for s in steps[1:]] == [("0", "high"), (None, None)]
    assert _fp8(model) == {"2", "4"} and steps[-1].ne_delta == pytest.approx(1 / 0.999 - 1)
    assert steps[-1].fp8_forwards == 2 and set(steps[-1].tried) == {"2", "4"}
    assert all(d == pytest.approx(steps[-1].ne_delta) for t in steps[-1].tried.values() for d in t.values())
    assert "| 2 | (none: no move lowers the NE) |  |" in format_gate(steps)
    # Nor does it take a move whose gain is the evaluation's rounding (min_gain).
    cost = {"0": {"tensorwise": 2e-4, "rowwise": 2e-4, "high": 0.0}, "2": {"tensorwise": 5e-7, "rowwise": 5e-7,
                                                                           "high": 0.0}}
    model = _served()
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=0.999, budget=0.0, config=FP32)
    assert [s.moved for s in steps[1:]] == ["0", None] and _fp8(model) == {"2", "4"}
    steps = hold_ne(_served(), _ladder_ne(cost), reference_ne=0.999, budget=0.0, config=FP32, min_gain=1e-7)
    assert [s.moved for s in steps[1:]] == ["0", "2", None]
    with pytest.raises(ValueError, match="min_gain"):
        hold_ne(_served(), _ladder_ne(cost), reference_ne=1.0, budget=0.0, config=FP32, min_gain=-1.0)


def test_a_rowwise_move_that_fails_is_left_out_and_the_site_can_still_go_high() -> None:
    cost = {"0": {"tensorwise": 1e-3, "rowwise": 0.0, "high": 0.0}}
    ne = _ladder_ne(cost)

    def failing(m: nn.Module) -> float:
        if _scalings(m)["0"] == "rowwise":
            raise RuntimeError("no row-wise kernel at this shape")
        return ne(m)

    model = _served()
    steps = hold_ne(model, failing, reference_ne=1.0, budget=0.0, config=FP32)
    assert [(s.moved, s.to) for s in steps[1:]] == [("0", "high")]
    assert steps[1].failed == {"0": "RuntimeError: no row-wise kernel at this shape"}
    assert RW not in steps[1].tried["0"] and _scalings(model) == {"0": "high", "2": "tensorwise", "4": "tensorwise"}
    assert all(sites(model)[n].served is not None for n in ("2", "4"))  # the others as served
    assert "- step 1: 0: RuntimeError: no row-wise kernel at this shape" in format_gate(steps)
    # A NaN NE under a row-wise move is a defect: raised, not taken for a failed move; the model
    # as served.
    model = _served()

    def nan_rowwise(m: nn.Module) -> float:
        return float("nan") if _scalings(m)["0"] == "rowwise" else ne(m)

    with pytest.raises(ValueError, match="NE is nan with the FP8 forwards .*rowwise"):
        hold_ne(model, nan_rowwise, reference_ne=1.0, budget=0.0, config=FP32)
    assert _scalings(model) == {"0": "tensorwise", "2": "tensorwise", "4": "tensorwise"}
    assert all(sites(model)[n].served.gemm == sites(model)[n].plan.forward for n in ("0", "2", "4"))


def test_the_probes_verdicts_keep_an_unsafe_rowwise_forward_off_the_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from loka_train.export import next_rung
    from loka_train.kernels.formats import Fp8Format
    from loka_train.kernels.plan import BACKEND_CONSTRAINTS, GemmPlan

    cost = {"0": {"tensorwise": 1e-3, "rowwise": 1e-4, "high": 0.0}}
    verdict = {ok: SimpleNamespace(safe=ok, fmt_b=Fp8Format.E4M3) for ok in (True, False)}
    key = ("0", "forward", Fp8Format.E4M3, Scaling.ROWWISE)
    # The Probe judged "0"'s row-wise forward unsafe: it goes to high precision.
    model = _served(("0",))
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=1.0, budget=2e-4, config=FP32, verdicts={key: verdict[False]})
    assert [(s.moved, s.to) for s in steps[1:]] == [("0", "high")] and list(steps[1].tried["0"]) == ["high"]
    model = _served(("0",))
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=1.0, budget=2e-4, config=FP32, verdicts={key: verdict[True]})
    assert [(s.moved, s.to) for s in steps[1:]] == [("0", RW)]
    # No row-wise move: without a safe verdict for it, on a backend without row-wise scales
    # (built in or not), for a forward that is not tensor-wise FP8.
    tw = GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="torch_scaled_mm", fast_accum=True)
    assert next_rung("0", tw) == GemmPlan(precision="fp8", scaling=Scaling.ROWWISE, backend="torch_scaled_mm",
                                          fast_accum=True)
    assert next_rung("0", tw, {}) is None
    monkeypatch.setitem(BACKEND_CONSTRAINTS, "tensorwise_only", (frozenset({Scaling.TENSORWISE}),
                                                                 frozenset({Fp8Format.E4M3}),
                                                                 frozenset({Scaling.TENSORWISE})))
    assert next_rung("0", GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="tensorwise_only")) is None
    assert next_rung("0", GemmPlan(precision="fp8", scaling=Scaling.TENSORWISE, backend="mine")) is None
    assert next_rung("0", GemmPlan(precision="fp8", scaling=Scaling.ROWWISE)) is None
    assert next_rung("0", GemmPlan(precision="fp8", scaling=Scaling.BLOCK)) is None
    assert next_rung("0", GemmPlan()) is None


def test_each_evaluation_starts_from_the_static_scales_as_served() -> None:
    # The GPU's served casts (the Triton tensor-wise quantizer, interpreted here) update each
    # site's static-scale slot as they run: the gate judges every trial from the same slots.
    model = convert(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 1)),
                    config=ModsConfig(enabled=True))
    for site in sites(model).values():
        site.enable_static_scales(margin=2.0, spread=16.0, device=torch.device("cpu"))
    plan = LinearPlan.fp8(backend="torch_scaled_mm", scaling=Scaling.TENSORWISE)
    served = serve(model, plans={"0": plan, "2": plan}, config=ServeConfig(dtype="bf16"))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))

    def slots(m: nn.Module) -> dict[str, torch.Tensor]:
        return {n: s.static_slots.clone() for n, s in sites(m).items()}

    def run(m: nn.Module, scale: float) -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            m(x * scale)

    run(served, 1.0)  # seeds the slots
    before = slots(served)
    run(served, 50.0)  # a call that moves them: what the test would miss otherwise
    assert any(not torch.equal(before[n], t) for n, t in slots(served).items())
    for n, t in before.items():
        sites(served)[n].static_slots.copy_(t)
    seen = []

    def ne(m: nn.Module) -> float:
        seen.append(slots(m))
        run(m, 50.0)
        return 1.0 + 1e-3 * len(_fp8(m))

    steps = hold_ne(served, ne, reference_ne=1.0, budget=0.0, config=ServeConfig(dtype="bf16"), allow_rowwise=False)
    assert len(seen) == 1 + 2 + 1 and [s.moved for s in steps[1:]] == ["0", "2"]
    assert all(torch.equal(got[n], before[n]) for got in seen for n in before)
    assert all(torch.equal(t, before[n]) for n, t in slots(served).items())  # and the gate leaves them so


def test_a_move_is_priced_from_the_forward_the_site_serves_and_noise_is_no_step() -> None:
    from loka_train.kernels.plan import GemmPlan

    def priced(name: str, forward: GemmPlan) -> float:  # the same size everywhere
        return 0.0 if forward.is_fp8 and forward.scaling is Scaling.TENSORWISE else (
            0.2 if forward.is_fp8 else 1.0)

    # "0" serves row-wise already: to high it gives up 0.8, not 1, and so goes first (8e-4 for 0.8
    # against "2"'s 9e-4 for 1).
    model = _served()
    serve(model, plans={"0": LinearPlan.fp8(backend="emulated", scaling=Scaling.ROWWISE)}, config=FP32)
    cost = {"0": {"rowwise": 8e-4, "high": 0.0}, "2": {"tensorwise": 9e-4, "high": 0.0},
            "4": {"tensorwise": 0.0, "high": 0.0}}
    steps = hold_ne(model, _ladder_ne(cost), reference_ne=1.0, budget=0.0, config=FP32, allow_rowwise=False,
                    price=priced)
    assert [s.moved for s in steps[1:]] == ["0", "2"]
    # A cheap move whose gain is noise-sized does not go before one that lowers the NE by far more:
    # "2" (3e-6 for 0.001) would win by its ratio; it is under half the best gain (1e-3).
    cost = {"0": {"tensorwise": 1e-3, "high": 0.0}, "2": {"tensorwise": 3e-6, "high": 0.0},
            "4": {"tensorwise": 0.0, "high": 0.0}}
    price = {"0": 100.0, "2": 0.001, "4": 1.0}
    steps = hold_ne(_served(), _ladder_ne(cost), reference_ne=1.0, budget=0.0, config=FP32, allow_rowwise=False,
                    price=lambda name, forward: 0.0 if forward.is_fp8 else price[name])
    assert [s.moved for s in steps[1:]] == ["0", "2"]
