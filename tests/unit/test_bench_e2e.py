"""bench.e2e's aggregation of repeated runs (``--repeats``): medians, means and NE deltas
paired by seed."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from bench.e2e.cli import main, parse_args
from bench.e2e.measure import StepClock
from bench.e2e.protocol import aggregate, run_order
from bench.e2e.report import _fp8_cell, _ne_delta_cell, _slow_steps_section
from bench.e2e.variants import job_overrides, resolve_variants, torchao_modules, with_loka_overrides
from bench.e2e.verdicts import SPEED_ONLY, add_ratios, evaluate_targets, fp8_ceiling, ne_measured

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _run(variant: str, seed: int, ms: float, ne: float, status: str = "ok") -> dict:
    return {
        "config": "dcn", "batch": 64, "variant": variant, "seed": seed, "status": status,
        "step_ms_median": ms, "step_ms_p10": ms - 1, "step_ms_p90": ms + 1, "step_ms_mean": ms,
        "step_ms": [ms], "eval_ne": ne, "eval_auc": 0.8, **({"error": "boom"} if status != "ok" else {}),
    }


def test_repeats_aggregate_and_pair_by_seed() -> None:
    raw = [
        _run("bf16", 0, 10.0, 0.70), _run("loka_safe", 0, 8.0, 0.707),
        _run("bf16", 1, 12.0, 0.66), _run("loka_safe", 1, 9.0, 0.6666),
        _run("bf16", 2, 11.0, 0.68), _run("loka_safe", 2, 20.0, 0.6868),
    ]
    results = aggregate(raw)
    add_ratios(results)
    base, loka = results
    assert (base["variant"], loka["variant"]) == ("bf16", "loka_safe")
    assert base["step_ms_median"] == 11.0 and loka["step_ms_median"] == 9.0
    assert math.isclose(loka["speedup_vs_bf16"], 11.0 / 9.0)
    assert math.isclose(base["eval_ne"], (0.70 + 0.66 + 0.68) / 3)
    # Every seed: LoKA exactly 1% worse, although the NE itself moves 6% across seeds: the
    # paired delta is 1% with no spread; unpaired means would not show that.
    assert math.isclose(loka["ne_delta_rel_vs_bf16"], 0.01, rel_tol=1e-9)
    assert loka["ne_delta_rel_se_vs_bf16"] < 1e-12
    assert [x["seed"] for x in loka["repeats"]] == [0, 1, 2]


def test_the_forwards_high_ne_pairs_by_seed_and_only_over_every_seed() -> None:
    def loka(seed: int, ne: float, high: float | None) -> dict:
        return {**_run("loka_safe", seed, 9.0, ne), **({"eval_ne_forwards_high": high} if high is not None else {})}

    bf16 = [_run("bf16", 0, 10.0, 0.70), _run("bf16", 1, 12.0, 0.66)]
    results = aggregate([*bf16, loka(0, 0.707, 0.7007), loka(1, 0.6666, 0.66066)])
    add_ratios(results)
    (rec,) = [r for r in results if r["variant"] == "loka_safe"]
    # Each seed against its own bf16: 0.1% above, though the NE moves 6% between the seeds.
    assert math.isclose(rec["ne_delta_rel_forwards_high_vs_bf16"], 0.001, rel_tol=1e-9)
    assert math.isclose(rec["eval_ne_forwards_high"], (0.7007 + 0.66066) / 2)
    # A round without it (its evaluation failed): no mean of the others passes for the run's.
    for partial in ([loka(0, 0.707, 0.7007), loka(1, 0.6666, None)], [loka(0, 0.707, None), loka(1, 0.6666, 0.66066)]):
        results = aggregate([*bf16, *partial])
        add_ratios(results)
        (rec,) = [r for r in results if r["variant"] == "loka_safe"]
        assert "eval_ne_forwards_high" not in rec and "ne_delta_rel_forwards_high_vs_bf16" not in rec
        assert math.isclose(rec["ne_delta_rel_vs_bf16"], 0.01, rel_tol=1e-9)  # the NE itself stands


def test_the_report_lists_every_bf16_variant_in_the_noise_floor(tmp_path: Path) -> None:
    source = RESULTS / "ne_attribution_h100_2026-11-27" / "call2" / "e2enebf1" / "e2e.json"
    (tmp_path / "e2e.json").write_text(source.read_text())
    assert main(["--render", str(tmp_path)]) == 0
    (line,) = [x for x in (tmp_path / "e2e.md").read_text().splitlines() if x.startswith("NE noise floor")]
    # bf16+pageable (the same kernels) and bf16+compile against eager bf16 of the same checkpoint.
    assert "wukong bf16+pageable +0.000%" in line and "wukong bf16+compile -0.010%" in line


def test_the_fp8_cell_shows_each_round_s_coverage_when_dispatch_chose_differently() -> None:
    def loka(seed: int, coverage: float, num_fp8: int) -> dict:
        return {**_run("loka_safe", seed, 9.0, 0.7),
                "loka": {"fp8_coverage": coverage, "num_fp8_gemms": num_fp8, "num_gemms": 39}}

    (same,) = aggregate([loka(0, 0.0, 0), loka(1, 0.0, 0)])
    assert _fp8_cell(same) == "0% (0/39 GEMMs)"
    (differ,) = aggregate([loka(0, 0.0, 0), loka(1, 1 / 39, 1)])
    assert [x["fp8_coverage"] for x in differ["repeats"]] == [0.0, 1 / 39]
    assert _fp8_cell(differ) == "0% (0/39 GEMMs); by round 0%, 3%"


def test_a_failed_repeat_fails_the_variant() -> None:
    results = aggregate([_run("bf16", 0, 10.0, 0.7), _run("bf16", 1, 10.0, 0.7, status="error")])
    assert results[0]["status"] == "error"
    assert "1 of 2 runs failed" in results[0]["error"]


def test_a_single_run_is_passed_through() -> None:
    run = _run("bf16", 0, 10.0, 0.7)
    assert aggregate([run]) == [run]


def test_a_baseline_that_fails_in_a_later_round_leaves_no_stale_ratio() -> None:
    # add_ratios writes into the records aggregate() returns; this fails if those were the
    # raw runs themselves (round 0's ratio would survive into round 1's report).
    raw = [_run("bf16", 0, 10.0, 0.7), _run("loka_safe", 0, 5.0, 0.84)]
    add_ratios(aggregate(raw))  # the report after round 0
    raw += [_run("bf16", 1, 10.0, 0.7, status="error"), _run("loka_safe", 1, 5.0, 0.84)]
    results = aggregate(raw)
    add_ratios(results)
    assert results[0]["status"] == "error"
    assert "speedup_vs_bf16" not in results[1] and "ne_delta_rel_vs_bf16" not in results[1]


def _wukong_target(raw: list[dict]) -> str:
    for r in raw:
        r["config"] = "wukong"
    results = aggregate(raw)
    add_ratios(results)
    targets = evaluate_targets(results, ["wukong"], 64)
    (status,) = [t["status"] for t in targets if t["target"].startswith("dense-heavy")]
    return status


def test_a_speed_target_with_an_unresolved_ne_is_not_called_missed() -> None:
    base = _run("bf16", 0, 15.0, 0.70)
    # 1.5x faster, NE 2% worse in one run: within one run's noise (SINGLE_RUN_NE_NOISE).
    assert _wukong_target([dict(base), _run("loka_safe", 0, 10.0, 0.714)]) == "unresolved"
    # 10% worse in one run: beyond that noise, missed.
    assert _wukong_target([dict(base), _run("loka_safe", 0, 10.0, 0.77)]) == "missed"
    # Too slow: missed whatever the NE.
    assert _wukong_target([dict(base), _run("loka_safe", 0, 14.0, 0.70)]) == "missed"
    # Within the tolerance, or better: met.
    assert _wukong_target([dict(base), _run("loka_safe", 0, 10.0, 0.7003)]) == "met"
    assert _wukong_target([dict(base), _run("loka_safe", 0, 10.0, 0.68)]) == "met"
    # 1% worse on every seed (no spread): resolved, and missed.
    raw = [_run(v, s, ms, ne) for s, b in enumerate((0.70, 0.66, 0.68))
           for v, ms, ne in (("bf16", 15.0, b), ("loka_safe", 10.0, b * 1.01))]
    assert _wukong_target(raw) == "missed"


def test_a_speed_only_run_judges_no_ne() -> None:
    raw = [_run("bf16", 0, 15.0, 0.70), _run("loka_safe", 0, 10.0, 0.90),  # NE 29% worse
           _run("torchao_tensorwise", 0, 11.0, 0.60), _run("torchao_rowwise", 0, 12.0, 0.60)]
    for r in raw:
        r["config"] = "wukong"
    results = aggregate(raw)
    add_ratios(results)
    judged = {t["target"][:12]: t for t in evaluate_targets(results, ["wukong"], 64)}
    speed_only = {t["target"][:12]: t for t in evaluate_targets(results, ["wukong"], 64, ne_measured=False)}
    assert judged["dense-heavy "]["status"] == judged["LoKA faster "]["status"] == "missed"
    assert speed_only["dense-heavy "]["status"] == speed_only["LoKA faster "]["status"] == SPEED_ONLY
    assert "NE" not in speed_only["dense-heavy "]["detail"] and "NE" not in speed_only["LoKA faster "]["detail"]
    # Which runs measure NE: --ne-steps, or continuations of a trained checkpoint (--ne-from).
    assert not ne_measured({"ne_steps": 0}) and not ne_measured({"ne_steps": 0, "ne_from": 0})
    assert ne_measured({"ne_steps": 200}) and ne_measured({"ne_steps": 0, "ne_from": 1000})
    # The speed side still misses on its own.
    raw[1]["step_ms_median"] = raw[1]["step_ms_p10"] = raw[1]["step_ms_p90"] = 12.0  # 1.25x of bf16
    results = aggregate(raw)
    add_ratios(results)
    slow = {t["target"][:12]: t["status"] for t in evaluate_targets(results, ["wukong"], 64, ne_measured=False)}
    assert slow["dense-heavy "] == "missed" and slow["LoKA faster "] == "missed"


def _rounds(spec: dict[str, list[float]], config: str = "dlrm") -> list[dict]:
    """Rotated rounds: per variant, its median step ms of seeds 0, 1, ... (equal NE)."""
    return [dict(_run(v, seed, ms, 0.70), config=config) for v, times in spec.items() for seed, ms in enumerate(times)]


def _targets(raw: list[dict], config: str = "dlrm") -> dict[str, dict]:
    results = aggregate(raw)
    add_ratios(results)
    return {t["target"][:12]: t for t in evaluate_targets(results, [config], 64)}


def test_rotated_rounds_turn_a_tie_within_their_spread_into_unresolved() -> None:
    # DLRM at 32768 on 2026-11-25 (four rounds, ms): LoKA's median of the runs is 1.02x of
    # tensor-wise's, but the paired ratios of the rounds run 0.70-1.22: a tie, not a win.
    tie = {"bf16": [14.0, 14.0, 14.0, 14.0], "loka_safe": [6.61, 9.57, 10.22, 8.20],
           "torchao_tensorwise": [9.47, 8.58, 8.35, 9.85], "torchao_rowwise": [8.47, 8.63, 9.89, 9.37]}
    t = _targets(_rounds(tie))
    assert t["LoKA faster "]["status"] == "unresolved"
    assert "dlrm/torchao_tensorwise: 1.02x faster [" in t["LoKA faster "]["detail"]
    assert t["LoKA is neve"]["status"] == "met"  # 1.5x of bf16 in every round
    # The same medians with every round agreeing: resolved, met.
    steady = {"bf16": [14.0] * 4, "loka_safe": [8.2, 8.2, 8.3, 8.2],
              "torchao_tensorwise": [9.0, 9.1, 9.0, 9.0], "torchao_rowwise": [9.4, 9.3, 9.4, 9.4]}
    assert _targets(_rounds(steady))["LoKA faster "]["status"] == "met"
    # Slower in every round: missed.
    slower = dict(steady, loka_safe=[9.5, 9.6, 9.5, 9.6])
    assert _targets(_rounds(slower))["LoKA faster "]["status"] == "missed"


def test_never_slower_is_unresolved_within_the_rounds_and_missed_beyond_them() -> None:
    noisy = {"bf16": [11.8, 12.9, 11.6], "loka_safe": [12.2, 12.7, 9.8]}  # 0.97x by the medians
    assert _targets(_rounds(noisy))["LoKA is neve"]["status"] == "unresolved"
    slow = {"bf16": [11.8, 12.9, 11.6], "loka_safe": [12.6, 13.8, 12.4]}  # 7% slower in each
    assert _targets(_rounds(slow))["LoKA is neve"]["status"] == "missed"
    # A speed-up target too: 1.3x needed, rounds between 1.1x and 1.6x.
    spread = {"bf16": [15.0, 15.0, 15.0], "loka_safe": [13.6, 9.4, 11.0]}
    assert _targets(_rounds(spread, "wukong"), "wukong")["dense-heavy "]["status"] == "unresolved"
    # One run each: the median ratio alone decides, as before.
    one = {"bf16": [11.8], "loka_safe": [12.2]}
    assert _targets(_rounds(one))["LoKA is neve"]["status"] == "missed"


def test_variant_suffixes_combine() -> None:
    (v,) = resolve_variants(["loka_safe+compile+graphs"], "torch_scaled_mm")
    assert (v.name, v.compile, v.graphs, v.loka) == ("loka_safe+compile+graphs", True, True, "safe")
    (ao,) = resolve_variants(["torchao_rowwise+graphs"], "torch_scaled_mm")
    assert ao.compile and ao.graphs and ao.torchao == "rowwise"
    for bad in ("torchao_rowwise+compile", "bf16+graphs+graphs", "bf16+fast"):
        with pytest.raises(SystemExit):
            resolve_variants([bad], "torch_scaled_mm")
    # Suffix order does not make a new variant (the ratios look names up).
    (same,) = resolve_variants(["bf16+graphs+compile"], "torch_scaled_mm")
    assert same.name == "bf16+compile+graphs"
    with pytest.raises(SystemExit, match="duplicates"):
        resolve_variants(["bf16+graphs+compile", "bf16+compile+graphs"], "torch_scaled_mm")
    # Sampled steps replayed: a LoKA variant with graphs only, compared with bf16+compile+graphs.
    (replayed,) = resolve_variants(["loka_safe+compile+graphs+replaysampled"], "torch_scaled_mm")
    assert replayed.replay_sampled and replayed.graphs and not v.replay_sampled
    from bench.e2e.verdicts import same_settings_reference

    assert same_settings_reference(replayed.name) == "bf16+compile+graphs"
    args = parse_args(["--dry-run", "--out", "unused"])
    assert "trainer.cuda_graphs_requested=true" in job_overrides(args, "dcn", 64, replayed, "o", steps=1, eval_batches=1)
    assert not any("cuda_graphs_requested" in o for o in job_overrides(args, "dcn", 64, v, "o", steps=1, eval_batches=1))
    # Sampled steps compiled: a LoKA variant with +compile only; the decision run (compile off) leaves it out.
    (comp,) = resolve_variants(["loka_aggressive+compile+graphs+compilesampled"], "torch_scaled_mm")
    assert comp.compile_sampled and same_settings_reference(comp.name) == "bf16+compile+graphs"
    assert "trainer.compile_sampled=true" in job_overrides(args, "dcn", 64, comp, "o", steps=1, eval_batches=1)
    decide = replace(comp, compile=False)
    assert not any("compile_sampled" in o for o in job_overrides(args, "dcn", 64, decide, "o", steps=1, eval_batches=1))
    for bad in ("loka_safe+graphs+compilesampled", "bf16+compile+compilesampled",
                "loka_safe+compile+graphs+replaysampled+compilesampled"):
        with pytest.raises(SystemExit, match="compilesampled"):
            resolve_variants([bad], "torch_scaled_mm")
    # +compile alone leaves the trainer's default (sampled steps compiled); +eagersampled turns it off.
    assert v.compile_sampled is None
    assert not any("compile_sampled" in o for o in job_overrides(args, "dcn", 64, v, "o", steps=1, eval_batches=1))
    (eager,) = resolve_variants(["loka_aggressive+compile+graphs+eagersampled"], "torch_scaled_mm")
    assert eager.compile_sampled is False and same_settings_reference(eager.name) == "bf16+compile+graphs"
    assert "trainer.compile_sampled=false" in job_overrides(args, "dcn", 64, eager, "o", steps=1, eval_batches=1)
    for bad in ("loka_safe+graphs+eagersampled", "bf16+compile+eagersampled",
                "loka_safe+compile+compilesampled+eagersampled"):
        with pytest.raises(SystemExit, match="eagersampled"):
            resolve_variants([bad], "torch_scaled_mm")
    for bad in ("bf16+compile+graphs+replaysampled", "loka_safe+compile+replaysampled"):
        with pytest.raises(SystemExit, match="replaysampled"):
            resolve_variants([bad], "torch_scaled_mm")


def test_torchao_target_takes_the_faster_recipe_run_and_lists_a_failed_one() -> None:
    raw = [_run("bf16", 0, 15.0, 0.70), _run("loka_safe", 0, 10.0, 0.70),
           _run("torchao_rowwise", 0, 12.0, 0.70), _run("torchao_rowwise+graphs", 0, 9.0, 0.70),
           _run("torchao_tensorwise", 0, 11.0, 0.70), _run("torchao_tensorwise+graphs", 0, 9.0, 0.70, status="error")]
    for r in raw:
        r["config"] = "wukong"
    results = aggregate(raw)
    add_ratios(results)
    (t,) = [t for t in evaluate_targets(results, ["wukong"], 64) if "torchao" in t["target"]]
    assert t["status"] == "missed"  # slower than torchao_rowwise+graphs (9 ms)
    assert "wukong/torchao_rowwise+graphs: 0.90x" in t["detail"]
    assert "wukong/torchao_tensorwise: 1.10x" in t["detail"]
    assert "wukong/torchao_tensorwise+graphs: boom" in t["detail"]


def test_torchao_rowwise_leaves_out_exactly_the_linears_with_transposed_3d_inputs() -> None:
    # The benchmark's Wukong shape (2 layers, 16 FM + 16 LCB outputs), small dims that are
    # multiples of 16 so that the 16-multiple rule alone would convert the 3-D-input Linears.
    from loka_train.models import ModelConfig, build_model

    cfg = ModelConfig(kind="wukong", embedding_dim=16, dense_arch_layer_sizes=[32, 16],
                      over_arch_layer_sizes=[32, 1], wukong_num_layers=2, wukong_num_fm_out=16,
                      wukong_fm_rank=16, wukong_num_lcb_out=16, wukong_mlp_hidden=32)
    model = build_model(cfg, feature_names=[f"cat_{i}" for i in range(15)],
                        num_embeddings_per_feature=[10] * 15, num_dense=4, seed=0)
    inter = next(m for fqn, m in model.named_modules() if fqn.endswith("inter_arch"))
    prefix = next(fqn for fqn, m in model.named_modules() if m is inter)
    transposed_3d: dict[str, bool] = {}

    def recorder(fqn: str):
        def hook(module: nn.Module, args: tuple) -> None:
            transposed_3d[fqn] = args[0].ndim == 3 and not args[0].is_contiguous()
        return hook

    hooks = [m.register_forward_pre_hook(recorder(fqn))
             for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn.startswith(prefix)]
    inter(torch.randn(4, 16, 16))  # 15 sparse features + the dense embedding, dim 16
    for h in hooks:
        h.remove()
    three_d = {fqn for fqn, yes in transposed_3d.items() if yes}
    assert three_d, "the Wukong layers have Linears over transposed 3-D inputs"

    row_converted, row_skipped = torchao_modules(model, "rowwise")
    tensor_converted, _ = torchao_modules(model, "tensorwise")
    assert not three_d & set(row_converted)
    assert all("transposed 3-D input" in row_skipped[f] for f in three_d & set(tensor_converted))
    # Nothing else is left out: the row-wise recipe converts every other Linear tensor-wise takes.
    assert set(tensor_converted) - set(row_converted) == three_d & set(tensor_converted)
    assert three_d & set(tensor_converted), "some 3-D-input Linears have 16-multiple dims here"


def test_loka_overrides_reach_every_loka_variant_and_no_other() -> None:
    args = parse_args(["--dry-run", "--out", "unused"])
    variants = with_loka_overrides(
        resolve_variants(["bf16+compile+graphs", "loka_aggressive+compile+graphs", "loka_safe", "fp8_everywhere"],
                         "emulated"),
        ["loka.probe.sites_per_step=2", "loka.probe.every_k_steps=10"],
    )
    runs = {v.name: job_overrides(args, "dcn", 64, v, "o", steps=1, eval_batches=1) for v in variants}
    for name in ("loka_aggressive+compile+graphs", "loka_safe"):
        assert runs[name][-2:] == ["loka.probe.sites_per_step=2", "loka.probe.every_k_steps=10"], name
    for name in ("bf16+compile+graphs", "fp8_everywhere"):
        assert not any("sites_per_step" in o for o in runs[name]), name
    # +rotate: two sites a sampled step, on the same plans as the preset's schedule (shared decision).
    from bench.e2e.protocol import decision_key

    (plain, rotated) = resolve_variants(["loka_safe+graphs", "loka_safe+graphs+rotate"], "emulated")
    assert "loka.probe.sites_per_step=2" in job_overrides(args, "dcn", 64, rotated, "o", steps=1, eval_batches=1)
    assert decision_key("dcn", 64, 0, plain) == decision_key("dcn", 64, 0, rotated)
    for bad in ("probe.sites_per_step=2", "loka.probe.sites_per_step", "loka.enabled=false"):
        with pytest.raises(SystemExit, match="--loka-override"):
            with_loka_overrides(variants, [bad])


def test_rounds_rotate_the_variant_order() -> None:
    variants = resolve_variants(["bf16", "loka_high", "fp8_everywhere"], "emulated")
    order = [(v.name, i) for v, i in run_order(variants, 3)]
    assert order == [
        ("bf16", 0), ("loka_high", 0), ("fp8_everywhere", 0),
        ("loka_high", 1), ("fp8_everywhere", 1), ("bf16", 1),
        ("fp8_everywhere", 2), ("bf16", 2), ("loka_high", 2),
    ]
    # Each variant runs once per round and is first in exactly one round.
    assert sorted(order) == sorted((v.name, i) for v in variants for i in range(3))


def test_the_pageable_suffix_turns_batch_pinning_off() -> None:
    args = parse_args(["--dry-run", "--out", "unused", "--variants", "bf16+compile,bf16+compile+pageable"])
    pinned, pageable = resolve_variants(args.variant_names, "emulated")
    assert pageable.name == "bf16+compile+pageable" and pageable.pageable and not pinned.pageable
    assert "trainer.pin_memory=false" in job_overrides(args, "dcn", 64, pageable, "o", steps=1, eval_batches=1)
    assert not any("pin_memory" in o
                   for o in job_overrides(args, "dcn", 64, pinned, "o", steps=1, eval_batches=1))


def test_the_fp8_ceiling_is_what_halving_every_gemm_would_save() -> None:
    def profiled(variant: str, **extra: object) -> dict:
        return {**_run(variant, 0, 10.0, 0.7), **extra,
                "profile": {"categories": {"gemm": {"ms_per_step": 4.0, "share": 0.4}}}}

    # 4 ms of GEMMs at twice the speed save 2 ms of a 10 ms step.
    assert math.isclose(fp8_ceiling(profiled("bf16+compile+graphs")), 10.0 / 8.0)
    # Runs with FP8 GEMMs of their own, or without a profile, have no ceiling.
    assert fp8_ceiling(profiled("loka_safe+compile+graphs", loka={"fp8_coverage": 0.2})) is None
    assert fp8_ceiling(profiled("torchao_tensorwise+graphs")) is None
    assert fp8_ceiling(_run("bf16", 0, 10.0, 0.7)) is None


def test_render_rewrites_the_report_from_its_json(tmp_path: Path) -> None:
    source = RESULTS / "e2e_torchao_ne_floor_h100_2026-11-24" / "e2e_dcn" / "e2e.json"
    (tmp_path / "e2e.json").write_text(source.read_text())
    assert main(["--render", str(tmp_path)]) == 0
    report = (tmp_path / "e2e.md").read_text()
    # bf16+compile+graphs: GEMMs 1.27 ms of a 9.19 ms step -> 9.19 / (9.19 - 0.635) = 1.07x.
    assert "| dcn | bf16+compile+graphs | 4.48 | 49% | 28% | 0% | 6% | 16% | 50% | 1.07x |" in report
    assert "FP8 GEMM ceiling over bf16+compile+graphs 1.07x" in report
    with pytest.raises(SystemExit, match="no .*e2e.json"):
        main(["--render", str(tmp_path / "missing")])


class _Callbacks:
    """What StepClock reads of a trainer's callbacks: the steps that run modules eagerly."""

    def __init__(self, sampled: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.sampled = sampled

    def eager_modules(self, trainer: object, step: int) -> list[nn.Module]:
        return [nn.Identity()] if step in self.sampled else []


class _Trainer:
    def __init__(self, sampled: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.callbacks = _Callbacks(sampled)
        self.step = 0


_TRAINER = _Trainer()


def test_the_step_clock_splits_sampled_from_unsampled_steps() -> None:
    import time

    clock = StepClock(warmup=2, timed=6, profile_steps=0, device=torch.device("cpu"), timing="sync")
    trainer = _Trainer(sampled={1, 4})  # step 1 is a warm-up step: not counted
    clock.on_train_start(trainer)
    for step in range(8):
        clock.on_step_start(trainer, step)
        if step == 4:
            time.sleep(0.03)  # the sampled step is slower
        clock.on_step_end(trainer, step, {})
    split = clock.split_by_sampling()
    assert split["steps_sampled"] == 1 and split["steps_unsampled"] == 5
    assert split["step_ms_median_sampled"] >= 30.0 > split["step_ms_median_unsampled"]
    assert math.isnan(split["peak_allocated_gb_sampled"])  # no CUDA allocator on the CPU
    assert all(math.isnan(v) for v in clock.peak_gb())


def test_the_profiled_window_is_shifted_off_the_probes_sampled_steps() -> None:
    """With the Probe sampling every 8th step, a 3-step window that would begin at step 8 begins
    at 9; the profile covers steps 9-11 and none is sampled. No Probe: no shift."""
    from bench.e2e.measure import profile_offset, summarize_profile

    assert profile_offset(8, 3, 8) == 1 and profile_offset(6, 3, 8) == 3 and profile_offset(9, 3, 8) == 0
    assert profile_offset(8, 3, None) == 0 and profile_offset(8, 3, 3) == 0  # nothing to gain
    clock = StepClock(warmup=2, timed=6, profile_steps=3, device=torch.device("cpu"), timing="sync",
                      sampled_every=8)
    trainer = _Trainer(sampled={0, 8, 16})
    clock.on_train_start(trainer)
    for step in range(14):
        clock.on_step_start(trainer, step)
        if clock.profiler is not None:
            torch.ones(4).add_(1)  # an operator for the CPU profile
        clock.on_step_end(trainer, step, {})
    assert clock.profile_offset == 1 and clock.profile is not None
    summary = summarize_profile(clock, median_ms=1.0)
    assert summary["first_step"] == 9 and summary["sampled_steps"] == 0


def test_the_step_clock_times_gc_pauses_only_in_the_timed_window() -> None:
    import gc

    clock = StepClock(warmup=1, timed=2, profile_steps=0, device=torch.device("cpu"), timing="sync")
    gc.collect()
    assert clock.gc_pauses_ms == []  # before the window
    clock.on_step_end(_TRAINER, 0, {})  # the warm-up step ends: the timed window opens
    gc.collect()
    assert len(clock.gc_pauses_ms) == 1 and clock.gc_pauses_ms[0] >= 0.0
    clock.on_step_end(_TRAINER, 1, {})
    clock.on_step_end(_TRAINER, 2, {})  # the last timed step: the window closes
    gc.collect()
    assert len(clock.gc_pauses_ms) == 1 and clock._on_gc not in gc.callbacks


def test_step_diag_times_the_host_per_timed_step_and_lists_the_slow_steps() -> None:
    import time

    clock = StepClock(warmup=1, timed=3, profile_steps=0, device=torch.device("cpu"), timing="sync",
                          step_diag=True)
    clock.first_step = 100  # a resumed run
    for step in range(100, 104):
        if step == 102:
            time.sleep(0.05)  # a host stall inside step 102
        clock.on_step_end(_TRAINER, step, {})
    diag = clock.step_diagnostics()
    assert len(diag) == 3 and diag[1]["host_ms"] >= 50.0 > diag[0]["host_ms"]
    assert all(d["cuda_malloc"] == d["cuda_free"] == 0 for d in diag)  # no allocator on the CPU
    run = {"config": "dcn", "batch": 64, "variant": "loka_safe", "seed": 0, "step_ms_median": 10.0,
           "step_ms": [10.0, 40.0, 10.0], "first_timed_step": 101,
           "step_diag": [dict(d, cuda_malloc=0, cuda_free=0) for d in diag]}
    run["step_diag"][1].update(cuda_malloc=3, alloc_retries=1)
    quiet = dict(run, variant="bf16", step_ms=[10.0, 10.0, 11.0], step_diag=[dict(d, cuda_malloc=0) for d in diag])
    lines = _slow_steps_section({"results": [run, quiet]})
    (loka,) = [line for line in lines if "loka_safe" in line]
    assert "| 1 | 10.00 |" in loka  # one slow step, 30 ms over the median / 3 steps
    assert "102: 40 ms (host " in loka and "3 cudaMalloc" in loka and "1 retries" in loka
    (bf16,) = [line for line in lines if "| bf16 |" in line]
    assert bf16.endswith("| 0 | 0.00 | 0 | - |")
    assert _slow_steps_section({"results": [dict(run, step_diag=None)]}) == []


def test_a_frame_dynamo_runs_eagerly_is_named_in_the_row(tmp_path: Path) -> None:
    source = RESULTS / "e2e_torchao_ne_floor_h100_2026-11-24" / "e2e_dcn" / "e2e.json"
    data = json.loads(source.read_text())
    (row,) = [r for r in data["results"] if r["variant"] == "loka_safe+compile+graphs"]
    row["fallbacks"] = ["compile_dense: torch.compile runs forward (...) eagerly for the rest of the run"]
    row["compile_skipped_frames"] = ["forward (/x/loka_train/mods/interaction.py line 161)"]
    (tmp_path / "e2e.json").write_text(json.dumps(data))
    assert main(["--render", str(tmp_path)]) == 0
    rows = [x for x in (tmp_path / "e2e.md").read_text().splitlines()
            if x.startswith("| dcn | loka_safe+compile+graphs | ") and "fallbacks" in x]
    assert len(rows) == 1 and "1 fallbacks; run eagerly by dynamo: forward (interaction.py line 161)" in rows[0]


def test_paired_continuations_resume_the_shared_checkpoint(tmp_path: Path) -> None:
    common = ["--dry-run", "--configs", "dlrm", "--warmup", "2", "--steps", "2", "--eval-batches", "1",
              "--no-profile", "--ne-steps", "6"]
    assert main([*common, "--variants", "bf16,bf16+compile", "--ne-from", "4", "--out", str(tmp_path / "c")]) == 0
    assert main([*common[:-1], "10", "--variants", "bf16", "--out", str(tmp_path / "s")]) == 0
    cont = json.loads((tmp_path / "c" / "e2e.json").read_text())
    scratch = json.loads((tmp_path / "s" / "e2e.json").read_text())
    (base,) = cont["ne_bases"]
    assert (base["variant"], base["steps"], base["seed"]) == ("bf16", 4, 0)
    runs = {r["variant"]: r for r in cont["results"]}
    assert all(r["status"] == "ok" and r["steps"] == 10 for r in runs.values())
    assert all(len(r["step_ms"]) == 2 for r in runs.values())  # timed from the resumed step
    # Resuming is exact on the CPU: bf16 from the step-4 checkpoint ends where 10 steps from 0 do.
    assert runs["bf16"]["eval_ne"] == scratch["results"][0]["eval_ne"]
    assert "paired continuations" in (tmp_path / "c" / "e2e.md").read_text()


def test_the_warm_run_runs_first_and_stays_out_of_the_results(tmp_path: Path) -> None:
    args = ["--dry-run", "--configs", "dlrm", "--warmup", "2", "--steps", "3", "--eval-batches", "1",
            "--no-profile", "--variants", "bf16,bf16+compile", "--repeats", "2", "--warm-run",
            "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    (warm,) = report["warm_runs"]
    assert (warm["variant"], warm["status"]) == ("bf16", "ok") and warm["step_ms_median"] > 0
    # The measured runs are exactly the requested ones, each timed over --steps, none before the warm run.
    assert sorted((r["variant"], r["seed"]) for r in report["runs"]) == [
        ("bf16", 0), ("bf16", 1), ("bf16+compile", 0), ("bf16+compile", 1)]
    assert all(len(r["step_ms"]) == 3 for r in report["runs"])
    assert all(r["started_unix"] > warm["started_unix"] for r in report["runs"])
    assert "discarded warm run of bf16" in (tmp_path / "e2e.md").read_text()


def test_the_ne_cell_shows_the_seed_paired_standard_error_when_there_is_one() -> None:
    assert _ne_delta_cell({"ne_delta_rel_vs_bf16": 0.000068, "ne_delta_rel_se_vs_bf16": 0.00001}) == (
        "+0.007% ± 0.0010%")
    assert _ne_delta_cell({"ne_delta_rel_vs_bf16": -0.01}) == "-1.000%"  # one run: no s.e.
    assert _ne_delta_cell({}) == "n/a"


def test_ratios_are_recomputed_from_scratch_when_a_report_is_re_rendered() -> None:
    # A reference run read back from an older JSON still carries a paired s.e. against itself.
    ref = {"config": "dcn", "batch": 8, "variant": "bf16", "status": "ok", "step_ms_median": 2.0, "eval_ne": 0.5,
           "ne_delta_rel_se_vs_bf16": 0.0, "speedup_vs_bf16_compile": 9.9}
    add_ratios([ref])
    assert ref["speedup_vs_bf16"] == 1.0 and ref["ne_delta_rel_vs_bf16"] == 0.0
    assert "ne_delta_rel_se_vs_bf16" not in ref and "speedup_vs_bf16_compile" not in ref
    assert _ne_delta_cell(ref) == "+0.000%"


def test_loka_runs_measure_the_ledger_when_asked(tmp_path: Path) -> None:
    args = ["--dry-run", "--configs", "dlrm", "--warmup", "2", "--steps", "3", "--eval-batches", "1",
            "--no-profile", "--variants", "loka_aggressive", "--ledger", "--out", str(tmp_path)]
    assert main(args) == 0
    (run,) = json.loads((tmp_path / "e2e.json").read_text())["results"]
    assert "loka.ledger=true" in run["overrides"]
    ledger = run["loka"]["ledger"]
    assert ledger["rows"] and ledger["timing"] == "host_clock" and ledger["prediction"]["high_step_ms"] > 0
    assert {r["role"] for r in ledger["rows"]} == {"forward", "grad_input", "grad_weight"}
    assert "### Per-GEMM ledger: dlrm loka_aggressive" in (tmp_path / "e2e.md").read_text()


def test_the_memory_section_compares_with_bf16_under_the_same_settings() -> None:
    from bench.e2e.report import _memory_section

    def row(variant: str, reserved: float) -> dict:
        return {"config": "dcn", "variant": variant, "status": "ok",
                "gpu_peak_allocated_gb": reserved / 2, "gpu_peak_reserved_gb": reserved}

    split = {"steps_unsampled": 58, "step_ms_median_unsampled": 9.5, "peak_allocated_gb_unsampled": 6.0,
             "steps_sampled": 2, "step_ms_median_sampled": 28.0, "peak_allocated_gb_sampled": 12.5}
    lines = _memory_section([row("bf16+compile+graphs", 10.0),
                             {**row("loka_safe+compile+graphs", 13.0), "by_sampling": split,
                              "gpu_allocated_before_gb": 1.25},
                             row("bf16", 8.0), row("loka_safe", 8.4)], isolated=False)
    assert "variants share one process" in lines[1]
    assert "each run in its own process" in _memory_section([row("bf16", 8.0)], isolated=True)[1]
    assert ("| dcn | loka_safe+compile+graphs | 1.25 | 6.50 | 13.00 | 1.30x | 58 steps: 9.50 ms, 6.00 GB "
            "| 2 steps: 28.00 ms, 12.50 GB |") in lines
    assert "| dcn | loka_safe | - | 4.20 | 8.40 | 1.05x | - | - |" in lines
    # A torchao variant is compiled: its reference is bf16+compile, not eager bf16.
    torchao = _memory_section([row("bf16", 8.0), row("bf16+compile", 10.0), row("torchao_rowwise", 12.0)],
                              isolated=False)
    assert "| dcn | torchao_rowwise | - | 6.00 | 12.00 | 1.20x | - | - |" in torchao
    assert _memory_section([{**row("bf16", 1.0), "gpu_peak_reserved_gb": math.nan}], isolated=False) == []


def test_every_run_is_compared_with_bf16_under_its_own_settings() -> None:
    from bench.e2e.verdicts import same_settings_reference

    assert same_settings_reference("loka_safe+compile+graphs") == "bf16+compile+graphs"
    assert same_settings_reference("loka_safe") == "bf16"
    assert same_settings_reference("fp8_everywhere+graphs") == "bf16+graphs"
    assert same_settings_reference("torchao_rowwise+graphs") == "bf16+compile+graphs"
    assert same_settings_reference("torchao_tensorwise") == "bf16+compile"
    assert same_settings_reference("loka_safe+pageable") == "bf16+pageable"

    def run(variant: str, median: float, mean: float) -> dict:
        return {**_run(variant, 0, median, 0.7), "step_ms_mean": mean}

    results = [run("bf16+compile+graphs", 30.0, 30.0), run("loka_aggressive+compile+graphs", 31.0, 33.6),
               run("loka_safe+compile+graphs", 28.5, 28.8), run("loka_safe", 40.0, 40.0)]
    add_ratios(results)
    _, aggr, safe, eager = results
    assert aggr["speedup_vs_same_settings"] == pytest.approx(30 / 31)
    assert aggr["speedup_vs_same_settings_mean"] == pytest.approx(30 / 33.6)
    assert safe["speedup_vs_same_settings"] == pytest.approx(30 / 28.5)
    assert "speedup_vs_same_settings" not in eager  # no plain bf16 in this grid


def test_isolate_runs_each_variant_and_round_in_its_own_process_and_merges_them(tmp_path, monkeypatch) -> None:
    from bench.e2e import isolate

    assert isolate.child_argv(
        ["--dry-run", "--isolate", "--variants", "a,b", "--repeats=3", "--ledger", "--out", "x", "--configs", "dcn",
         "--decisions", "d"],
        config="dcn", batch=64, variant="b", seed=2, out=tmp_path / "o",
    ) == ["--dry-run", "--ledger", "--decisions", "d", "--configs", "dcn", "--batches", "64", "--variants", "b", "--repeats", "1",
          "--first-seed", "2", "--out", str(tmp_path / "o")]
    calls: list[list[str]] = []
    ms = {("bf16", 0): 10.0, ("loka_safe", 0): 8.0, ("bf16", 1): 12.0, ("loka_safe", 1): 9.0}

    def fake_launch(cmd: list[str], log) -> tuple[int | None, bool]:
        calls.append(cmd)
        args = parse_args(cmd[3:])
        (variant,) = args.variant_names
        if variant == "loka_safe" and args.first_seed == 1:
            return 1, False  # a child that dies without a report
        rec = _run(variant, args.first_seed, ms[variant, args.first_seed], 0.7)
        rec["samples_per_s"] = 64 / rec["step_ms_median"] * 1000
        (args.out / "e2e.json").write_text(json.dumps({"runs": [rec]}))
        return 0, False

    monkeypatch.setattr(isolate, "_launch", fake_launch)
    out = tmp_path / "e2e"
    rc = main(["--dry-run", "--isolate", "--configs", "dcn", "--batches", "64", "--repeats", "2",
               "--variants", "bf16,loka_safe", "--out", str(out)])
    assert rc == 1  # one run failed, and the report says which
    # The rotated order, one process per (variant, round), each with its round's seed.
    assert [(c[c.index("--variants") + 1], c[c.index("--first-seed") + 1]) for c in calls] == [
        ("bf16", "0"), ("loka_safe", "0"), ("loka_safe", "1"), ("bf16", "1")]
    assert all("--isolate" not in c and c[1:3] == ["-m", "bench.e2e"] for c in calls)
    report = json.loads((out / "e2e.json").read_text())
    assert len(report["runs"]) == 4
    failed = [r for r in report["runs"] if r["status"] == "error"]
    assert len(failed) == 1 and "without a record" in failed[0]["error"] and "log.txt" in failed[0]["error"]
    safe = next(r for r in report["results"] if r["variant"] == "loka_safe")
    assert safe["status"] == "error"  # a failed round fails the variant (no partial median)
    bf16 = next(r for r in report["results"] if r["variant"] == "bf16")
    assert bf16["status"] == "ok" and bf16["step_ms_median"] == 11.0
    with pytest.raises(SystemExit, match="--isolate"):
        parse_args(["--dry-run", "--isolate", "--ne-from", "10", "--out", "x"])


def test_isolate_does_not_take_an_earlier_benchmarks_record_for_a_failed_run(tmp_path, monkeypatch) -> None:
    from bench.e2e import isolate

    out = tmp_path / "e2e"
    stale = out / "runs" / "dcn_b64_bf16_s0"
    stale.mkdir(parents=True)
    (stale / "e2e.json").write_text(json.dumps({"runs": [{**_run("bf16", 0, 1.0, 0.7), "samples_per_s": 1.0}]}))
    monkeypatch.setattr(isolate, "_launch", lambda cmd, log: (1, False))  # dies without a record
    assert main(["--dry-run", "--isolate", "--configs", "dcn", "--batches", "64", "--variants", "bf16",
                 "--out", str(out)]) == 1
    (rec,) = json.loads((out / "e2e.json").read_text())["runs"]
    assert rec["status"] == "error" and "exited with status 1" in rec["error"]
    with pytest.raises(SystemExit):  # no abbreviations: a child must not see --isolate as --iso
        parse_args(["--dry-run", "--iso", "--out", "x"])


def test_the_decision_run_s_model_is_freed_before_the_timed_run(tmp_path: Path, monkeypatch) -> None:
    """The decision job holds a model and optimizer (on a GPU: their memory); its clean-up must
    free them, or they stay allocated through the timed run and count in its memory peaks."""
    import weakref

    from bench.e2e import protocol

    models: list[weakref.ref] = []
    latest_alive_after_cleanup: list[bool] = []
    real_job, real_cleanup = protocol.Composer.job, protocol.cleanup

    def job(self, overrides):  # type: ignore[no-untyped-def]
        built = real_job(self, overrides)
        models.append(weakref.ref(built.model))
        return built

    def cleanup(device_type: str) -> None:
        real_cleanup(device_type)
        latest_alive_after_cleanup.append(models[-1]() is not None)

    monkeypatch.setattr(protocol.Composer, "job", job)
    monkeypatch.setattr(protocol, "cleanup", cleanup)
    args = ["--dry-run", "--configs", "dlrm", "--warmup", "1", "--steps", "2", "--eval-batches", "1",
            "--no-profile", "--variants", "loka_safe", "--out", str(tmp_path)]
    assert main(args) == 0
    # Clean-ups: after the decision run, then after the timed run; each frees the job it followed.
    assert len(latest_alive_after_cleanup) >= 2, latest_alive_after_cleanup
    assert not any(latest_alive_after_cleanup), latest_alive_after_cleanup


def test_the_ledger_section_states_the_step_time_the_ledger_does_not_see() -> None:
    from bench.e2e.report import _unattributed_line

    loka = {"config": "wukong", "batch": 32768, "variant": "loka_aggressive+compile+graphs", "status": "ok",
            "step_ms_median": 30.0}
    bf16 = {"config": "wukong", "batch": 32768, "variant": "bf16+compile+graphs", "status": "ok",
            "step_ms_median": 29.0}
    ledger = {"prediction": {"high_step_ms": 33.0}}
    (_, line) = _unattributed_line(loka, ledger, [bf16, loka])
    assert "+4.00 ms a step" in line and "0.97x" in line and "1.10x" in line
    assert "Of that" not in line  # no bf16 profile: nothing to reconcile the GEMM times with
    profiled = dict(bf16, profile={"categories": {"gemm": {"ms_per_step": 15.5}}})
    (_, line) = _unattributed_line(loka, dict(ledger, totals={"high_ms": 16.0}), [profiled, loka])
    assert "Of that, +0.50 ms is the ledger's high-precision GEMM times (16.00 ms a step)" in line
    assert _unattributed_line(loka, ledger, [loka]) == []  # no bf16 with the same settings
    other = dict(bf16, variant="bf16")  # eager bf16 is not the reference
    assert _unattributed_line(loka, ledger, [other, loka]) == []


def test_the_report_lists_the_largest_kernels_with_their_launches() -> None:
    from bench.e2e.report import _kernel_calls_section

    row = {"config": "wukong", "variant": "loka", "profile": {"top_kernels": [
        {"name": "_cast_both_kernel", "category": "other", "ms_per_step": 2.9, "calls_per_step": 10.0,
         "us_per_call": [460.5, 230.0, 122.25]},
        {"name": "aten::mm", "category": "gemm", "ms_per_step": 1.0},  # CPU: no launches recorded
    ]}}
    lines = _kernel_calls_section([row])
    assert lines[-1] == "| wukong | loka | _cast_both_kernel | 2.900 | 10 | 460.5, 230, 122.25 |"
    assert not any("aten::mm" in line for line in lines)
    assert _kernel_calls_section([{"config": "c", "variant": "v", "profile": {"top_kernels": []}}]) == []


def test_the_report_names_unaligned_gemm_kernels_per_variant() -> None:
    from bench.e2e.report import _unaligned_gemms_section

    kernels = [
        {"name": "void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_32x6_nn_align1>",
         "category": "gemm", "ms_per_step": 0.45, "calls_per_step": 5.0},
        {"name": "nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN", "category": "gemm", "ms_per_step": 3.4},
        {"name": "triton_poi_fused_align1_lookalike", "category": "other", "ms_per_step": 0.3},
    ]
    bf16 = {"config": "wukong", "variant": "bf16+compile+graphs", "profile": {"top_kernels": kernels}}
    loka = {"config": "wukong", "variant": "loka", "profile": {"top_kernels": kernels[1:]}}
    lines = _unaligned_gemms_section([bf16, loka])
    assert lines[-1] == "- wukong bf16+compile+graphs: 0.45 ms a step in 1 kernel(s), 5 launches"
    assert not any("loka" in line for line in lines)
    assert _unaligned_gemms_section([loka]) == []


def test_loka_tensorwise_casts_count_as_quantization() -> None:
    from bench.e2e.measure import kernel_category

    for name in ("_cast_both_kernel", "_cast_kernel", "_static_check_kernel", "_amax_partial_kernel"):
        assert kernel_category(name) == "quantize", name
    assert kernel_category("triton_poi_fused__to_copy_cat_native_layer_norm_backward") == "other"


def test_a_static_scales_run_names_its_recasts_in_the_row(tmp_path: Path) -> None:
    source = RESULTS / "static_scales_h100_2026-11-26" / "call4" / "e2e_static" / "e2e.json"
    data = json.loads(source.read_text())
    (row,) = [r for r in data["results"] if r["variant"] == "loka_aggressive+compile+graphs+static"]
    row["loka"]["static_scales"] = [
        {"site": "a", "operand": "x", "scale": 0.5, "recasts": 2, "tensorwise": True},
        {"site": "a", "operand": "dY", "scale": 0.0, "recasts": 0, "tensorwise": False},
        {"site": "b", "operand": "x", "scale": 2.0**-7, "recasts": 1, "tensorwise": True},
    ]
    (tmp_path / "e2e.json").write_text(json.dumps(data))
    assert main(["--render", str(tmp_path)]) == 0
    rows = [x for x in (tmp_path / "e2e.md").read_text().splitlines()
            if x.startswith("| wukong | loka_aggressive+compile+graphs+static | 26.85")]  # the step-time row
    assert len(rows) == 1 and "static scales: 3 recast(s), 2 tensor-wise operands" in rows[0]


def test_share_decisions_runs_one_decision_for_variants_that_differ_in_how_plans_run(tmp_path: Path) -> None:
    args = ["--dry-run", "--configs", "dlrm", "--warmup", "1", "--steps", "2", "--eval-batches", "1",
            "--no-profile", "--variants", "loka_aggressive,loka_aggressive+static,loka_safe",
            "--share-decisions", "--out", str(tmp_path)]
    assert main(args) == 0
    runs = {r["variant"]: r for r in json.loads((tmp_path / "e2e.json").read_text())["results"]}
    first, static, safe = runs["loka_aggressive"], runs["loka_aggressive+static"], runs["loka_safe"]
    assert "shared_from" not in first["decide"] and first["decide"]["s"] > 0
    assert static["decide"]["shared_from"] == "loka_aggressive" and static["decide"]["s"] == 0.0
    assert static["loka"]["plans"] == first["loka"]["plans"]  # the same plans, run with static scales
    assert "loka.mods.static_scales=true" in static["overrides"]
    assert "shared_from" not in safe["decide"]  # another preset decides for itself
    md = (tmp_path / "e2e.md").read_text()
    assert "plans of loka_aggressive's decision (--share-decisions)" in md
    with pytest.raises(SystemExit, match="share-decisions"):
        parse_args(["--isolate", "--share-decisions", "--out", str(tmp_path / "x")])


def test_dynamic_suffix_turns_static_scales_off_and_shares_the_decision() -> None:
    from bench.e2e.protocol import decision_key
    from bench.e2e.variants import resolve_variants

    aggr, dyn = resolve_variants(["loka_aggressive", "loka_aggressive+dynamic"], "emulated")
    assert "loka.mods.static_scales=false" in dyn.loka_overrides and dyn.name == "loka_aggressive+dynamic"
    assert decision_key("wukong", 64, 0, aggr) == decision_key("wukong", 64, 0, dyn)
    for bad in ("bf16+dynamic", "loka_aggressive+static+dynamic"):
        with pytest.raises(SystemExit, match="dynamic"):
            resolve_variants([bad], "emulated")


def test_nofold_suffix_turns_the_relu_fold_off_and_shares_the_decision() -> None:
    from bench.e2e.protocol import decision_key
    from bench.e2e.variants import resolve_variants

    aggr, nofold = resolve_variants(["loka_aggressive+graphs", "loka_aggressive+graphs+nofold"], "emulated")
    assert nofold.loka_overrides == ("loka.mods.fold_relu=false",) and "not folded" in nofold.description
    assert decision_key("wukong", 64, 0, aggr) == decision_key("wukong", 64, 0, nofold)
    with pytest.raises(SystemExit, match="nofold"):
        resolve_variants(["bf16+nofold"], "emulated")


def test_bits_suffixes_set_the_relu_masks_and_share_the_decision() -> None:
    from bench.e2e.protocol import decision_key
    from bench.e2e.variants import resolve_variants

    aggr, bits, nobits = resolve_variants(
        ["loka_aggressive+compile+graphs", "loka_aggressive+graphs+bits+compile", "loka_aggressive+nobits+compile+graphs"],
        "emulated")
    assert bits.name == "loka_aggressive+compile+graphs+bits"
    assert nobits.name == "loka_aggressive+compile+graphs+nobits"
    assert bits.loka_overrides == ("loka.mods.relu_mask_bits=true",) and "bits" in bits.description
    assert nobits.loka_overrides == ("loka.mods.relu_mask_bits=false",) and "pre-activations" in nobits.description
    assert decision_key("wukong", 64, 0, aggr) == decision_key("wukong", 64, 0, bits) \
        == decision_key("wukong", 64, 0, nobits)
    with pytest.raises(SystemExit, match="nobits"):
        resolve_variants(["bf16+nobits"], "emulated")
    with pytest.raises(SystemExit, match="exclude each other"):
        resolve_variants(["loka_aggressive+bits+nobits"], "emulated")
    for folded_none in ("loka_aggressive+nofold+bits", "loka_aggressive+nofold+nobits"):
        with pytest.raises(SystemExit, match="drop one"):
            resolve_variants([folded_none], "emulated")


def test_decide_once_shares_the_first_seeds_decision_with_every_seed(tmp_path: Path) -> None:
    args = ["--dry-run", "--configs", "dlrm", "--warmup", "1", "--steps", "2", "--eval-batches", "1",
            "--no-profile", "--variants", "loka_aggressive,loka_aggressive+static", "--repeats", "2",
            "--decide-once", "--out", str(tmp_path)]
    assert main(args) == 0
    raw = json.loads((tmp_path / "e2e.json").read_text())["runs"]
    decided = [r for r in raw if "shared_from" not in r["decide"]]
    assert [(r["variant"], r["seed"]) for r in decided] == [("loka_aggressive", 0)]  # one decision run
    later = [r for r in raw if r["seed"] == 1]
    assert len(later) == 2 and all(r["decide"]["shared_from"] == "loka_aggressive" for r in later)
    assert all(r["decide"]["seed"] == 0 and r["loka"]["plans"] == decided[0]["loka"]["plans"] for r in later)
    md = (tmp_path / "e2e.md").read_text()
    assert "the first seed's, for every seed (--decide-once)" in md


def _continued_loka_run(out: Path, decide_steps: int) -> dict:
    """A dry run of bf16 and LoKA aggressive continuing a 4-step checkpoint for 3 steps, deciding
    in `decide_steps` steps: the LoKA run's record."""
    args = ["--dry-run", "--configs", "dlrm", "--warmup", "1", "--steps", "2", "--eval-batches", "1",
            "--no-profile", "--ne-steps", "3", "--ne-from", "4", "--decide-steps", str(decide_steps),
            "--variants", "bf16,loka_aggressive", "--out", str(out)]
    assert main(args) == 0
    (loka,) = [r for r in json.loads((out / "e2e.json").read_text())["runs"] if r["variant"] == "loka_aggressive"]
    return loka


def test_a_continuations_decision_run_resumes_the_checkpoint_it_continues(tmp_path: Path) -> None:
    loka = _continued_loka_run(tmp_path, decide_steps=2)
    # Steps 4 and 5 of the seed's checkpoint, not two steps of fresh weights.
    assert loka["decide"]["from_step"] == 4 and "trainer.steps=6" in loka["decide_overrides"]
    assert loka["status"] == "ok" and loka["steps"] == 7
    assert "decided in 2 steps from step 4" in (tmp_path / "e2e.md").read_text()


def test_a_run_that_measures_ne_is_evaluated_again_with_its_fp8_forwards_high(tmp_path: Path) -> None:
    loka = _continued_loka_run(tmp_path, decide_steps=4)
    md = (tmp_path / "e2e.md").read_text()
    assert any(p["forward"].startswith("fp8") for p in loka["loka"]["plans"].values())
    assert loka["eval_ne_forwards_high"] > 0 and loka["eval_ne_forwards_high"] != loka["eval_ne"]
    (rec,) = [r for r in json.loads((tmp_path / "e2e.json").read_text())["results"] if r["variant"] == "loka_aggressive"]
    (bf16,) = [r for r in json.loads((tmp_path / "e2e.json").read_text())["results"] if r["variant"] == "bf16"]
    assert rec["ne_delta_rel_forwards_high_vs_bf16"] == pytest.approx(
        loka["eval_ne_forwards_high"] / bf16["eval_ne"] - 1)
    assert "FP8 forwards evaluated in high precision" in md and "loka_aggressive" in md


def test_a_failed_forwards_high_evaluation_keeps_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.e2e.protocol as protocol

    def fails(trainer: object, sites: object) -> float:
        raise RuntimeError("recompile limit")

    monkeypatch.setattr(protocol, "forwards_high_ne", fails)
    args = ["--dry-run", "--configs", "dlrm", "--warmup", "1", "--steps", "2", "--eval-batches", "1",
            "--no-profile", "--ne-steps", "3", "--decide-steps", "2", "--variants", "loka_aggressive",
            "--out", str(tmp_path)]
    assert main(args) == 0
    (run,) = json.loads((tmp_path / "e2e.json").read_text())["runs"]
    assert run["status"] == "ok" and run["eval_ne"] > 0 and len(run["step_ms"]) == 2
    assert run["eval_ne_forwards_high_error"] == "RuntimeError: recompile limit"
    assert "eval_ne_forwards_high" not in run


def test_the_forwards_high_evaluation_sees_every_forward_high_and_restores_the_plans() -> None:
    from bench.e2e.protocol import forwards_high_ne
    from loka_train.kernels.plan import LinearPlan
    from loka_train.mods.site import Fp8Linear

    fp8 = LinearPlan.fp8(backend="emulated")
    sites = {"a": Fp8Linear.from_linear(torch.nn.Linear(32, 16), plan=fp8),
             "b": Fp8Linear.from_linear(torch.nn.Linear(32, 16), plan=LinearPlan.high_precision())}
    seen: list[dict[str, LinearPlan]] = []

    class Trainer:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def evaluate(self) -> dict[str, float]:
            seen.append({n: s.plan for n, s in sites.items()})
            if self.fail:
                raise RuntimeError("eval failed")
            return {"eval/ne": 0.5}

    assert forwards_high_ne(Trainer(False), sites) == 0.5
    (during,) = seen
    assert not during["a"].forward.is_fp8 and during["a"].grad_input == fp8.grad_input
    assert during["a"].grad_weight == fp8.grad_weight and during["b"] == LinearPlan.high_precision()
    assert sites["a"].plan == fp8 and sites["a"].plan_fp8
    with pytest.raises(RuntimeError, match="eval failed"):
        forwards_high_ne(Trainer(True), sites)
    assert sites["a"].plan == fp8 and sites["b"].plan == LinearPlan.high_precision()


def test_decisions_saved_in_a_directory_are_taken_by_later_runs(tmp_path: Path) -> None:
    """--decisions DIR: the first run's decision is saved there; a later benchmark (another
    process, another call) with the same job takes it instead of deciding, and another seed
    (without --decide-once) decides for itself."""
    store = tmp_path / "decisions"
    common = ["--dry-run", "--configs", "dlrm", "--warmup", "1", "--steps", "2", "--eval-batches", "1",
              "--no-profile", "--variants", "loka_aggressive", "--decisions", str(store)]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    (saved,) = sorted(store.glob("*.pt"))
    assert saved.with_suffix(".json").exists()
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    assert main([*common, "--first-seed", "1", "--out", str(tmp_path / "c")]) == 0
    first, again, other = (json.loads((tmp_path / d / "e2e.json").read_text())["runs"][0] for d in "abc")
    assert "loaded_from" not in first["decide"] and first["decide"]["s"] > 0
    assert again["decide"]["loaded_from"] == saved.name and again["decide"]["s"] == 0.0
    assert again["loka"]["plans"] == first["loka"]["plans"] and again["decide"]["seed"] == 0
    # Each FP8 GEMM's SQNR verdict is recorded with its floor.
    fp8 = {f"{s}/{r}" for s, roles in first["loka"]["plans"].items() for r, p in roles.items() if p.startswith("fp8")}
    assert fp8 and set(first["loka"]["fp8_sqnr_db"]) == fp8
    assert all(v["sqnr_lo_db"] >= v["budget_db"] for v in first["loka"]["fp8_sqnr_db"].values())
    assert "loaded_from" not in other["decide"] and len(list(store.glob("*.pt"))) == 2
    assert f"plans of the decision saved in {saved.name} (--decisions)" in (tmp_path / "b" / "e2e.md").read_text()


def test_the_report_subtracts_bf16s_gpu_time_by_category(tmp_path: Path) -> None:
    source = RESULTS / "fma_casts_h100_2026-11-26" / "call5" / "e2e_bias" / "e2e.json"
    (tmp_path / "e2e.json").write_text(source.read_text())
    assert main(["--render", str(tmp_path)]) == 0
    rows = [x for x in (tmp_path / "e2e.md").read_text().splitlines()
            if x.startswith("| wukong | loka_aggressive+compile+graphs+static | bf16+compile+graphs |")]
    # call5's categories: GEMM 10.676 - 15.884, quantize 2.212 - 0, other 11.153 - 11.889 ms.
    assert rows == ["| wukong | loka_aggressive+compile+graphs+static | bf16+compile+graphs | -5.21 | +2.21 | "
                    "-0.01 | -0.01 | -0.74 | -3.75 | -3.86 | 0.42 |"]


def test_the_report_ledger_counts_a_relu_pass_a_cast_takes_over_and_lists_the_sites() -> None:
    from bench.e2e.report import _ledger_section
    from loka_train.dispatch.ledger import Fp8Times, Ledger, LedgerRow

    row = LedgerRow(site="over.1", role="forward", shape=(8, 8, 8), plan="tw", high_ms=1.0, relu_ms=0.2,
                    fp8=(Fp8Times(plan="tw", gemm_ms=0.5, quant_a_ms=0.25, quant_b_ms=0.01),))
    ledger = Ledger(rows=[row], device="cpu", timing="custom").to_dict(step_ms=10.0)
    run = {"config": "wukong", "batch": 8, "variant": "loka_aggressive+compile+graphs", "status": "ok",
           "step_ms_median": 10.0, "loka": {"ledger": ledger}}
    md = "\n".join(_ledger_section([run]))
    # quant: 0.26 of casts less the 0.2 ms pass; total 0.76 against 1.2 (GEMM and pass).
    assert "| over.1 | forward | 8x8x8 | tw | 1.000 (+0.200 ReLU) | 0.500 | 0.060 | 0.760 | 0.12 | 1.58x | - |" in md
    assert "| over.1 | forward | 0.500 | 0.060 | 0.12 |" in md


def test_the_report_renders_a_ledger_written_before_the_relu_pass_and_the_sites() -> None:
    from bench.e2e.report import _ledger_section
    from loka_train.dispatch.ledger import Fp8Times, Ledger, LedgerRow

    row = LedgerRow(site="over.0", role="forward", shape=(8, 8, 8), plan="tw", high_ms=1.0,
                    fp8=(Fp8Times(plan="tw", gemm_ms=0.5, quant_a_ms=0.2, quant_b_ms=0.05),))
    ledger = Ledger(rows=[row], device="cpu", timing="custom").to_dict(step_ms=10.0)
    del ledger["sites"], ledger["rows"][0]["relu_ms"], ledger["rows"][0]["fp8"][0]["relu_ms"]
    run = {"config": "wukong", "batch": 8, "variant": "loka_aggressive+compile+graphs", "status": "ok",
           "step_ms_median": 10.0, "loka": {"ledger": ledger}}
    md = "\n".join(_ledger_section([run]))
    assert "| over.0 | forward | 8x8x8 | tw | 1.000 | 0.500 | 0.250 | 0.750 | 0.50 | 1.33x | - |" in md
    assert "Per site" not in md


def test_a_variant_says_whether_its_sampled_steps_run_compiled_as_the_trainer_resolves_it() -> None:
    names = ["bf16+compile+graphs", "loka_aggressive", "loka_aggressive+compile+graphs",
             "loka_aggressive+compile+graphs+eagersampled", "loka_aggressive+compile+graphs+compilesampled",
             "loka_aggressive+compile+graphs+replaysampled"]
    resolved = {name: v.sampled_compiled for name, v in zip(names, resolve_variants(names, "emulated"))}
    assert resolved == {
        "bf16+compile+graphs": True,  # the trainer's default with compile_dense: nothing is requested there
        "loka_aggressive": False,
        "loka_aggressive+compile+graphs": True,
        "loka_aggressive+compile+graphs+eagersampled": False,
        "loka_aggressive+compile+graphs+compilesampled": True,
        "loka_aggressive+compile+graphs+replaysampled": False,
    }


def test_plan_suffixes_compose_their_dispatch_fields_and_decide_on_their_own() -> None:
    import contextlib

    from bench.e2e.protocol import decision_key
    from bench.e2e.variants import Composer

    args = parse_args(["--dry-run", "--out", "unused"])
    aggr, rowwise, highgw = resolve_variants(
        ["loka_aggressive+compile+graphs", "loka_aggressive+rowwise+compile+graphs",
         "loka_aggressive+compile+graphs+highgw"], "emulated")
    assert rowwise.name == "loka_aggressive+compile+graphs+rowwise"
    keys = {decision_key("wukong", 64, 0, v) for v in (aggr, rowwise, highgw)}
    assert len(keys) == 3, "a suffix that changes the plans must not share a decision"
    with contextlib.ExitStack() as stack:
        composer = Composer(stack)
        jobs = {v.name: composer.job(job_overrides(args, "dcn", 64, v, "o", steps=1, eval_batches=1))
                for v in (aggr, rowwise, highgw)}
    base, row, high = (jobs[v.name].loka.dispatch for v in (aggr, rowwise, highgw))
    assert base.scalings == ("tensorwise", "rowwise") and row.scalings == ("rowwise",)
    assert tuple(base.fp8_roles) == ("forward", "grad_input", "grad_weight")
    assert tuple(high.fp8_roles) == ("forward", "grad_input") and high.scalings == base.scalings
    for suffix in ("rowwise", "highgw"):
        with pytest.raises(SystemExit, match=suffix):
            resolve_variants([f"bf16+{suffix}"], "emulated")


def test_batches_generated_side_by_side_are_the_sequential_ones() -> None:
    from bench.e2e.protocol import _MemoSplit, generate_batches
    from loka_train.data.config import DataConfig
    from loka_train.data.synthetic import SyntheticDataset

    def fields(b: object) -> list[torch.Tensor]:
        kjt = b.sparse_features  # type: ignore[attr-defined]
        return [b.dense_features, b.labels, kjt.values(), kjt.lengths()]  # type: ignore[attr-defined]

    cfg = DataConfig(cache_batches=6)
    threads = torch.get_num_threads()
    for split in ("train", "eval"):
        sequential = SyntheticDataset(cfg, split=split, rank=0, world_size=1, batch_size=256)
        shared = SyntheticDataset(cfg, split=split, rank=0, world_size=1, batch_size=256)
        kept = shared if split == "train" else _MemoSplit(shared)
        generate_batches(kept, 6, workers=3)
        assert torch.get_num_threads() == threads
        held = kept._cache if split == "train" else kept._memo  # type: ignore[attr-defined]
        assert sorted(held) == list(range(6))  # every batch generated, and kept
        for step in range(6):
            for got, want in zip(fields(held[step]), fields(sequential._batch_uncached(step))):
                assert torch.equal(got, want), (split, step)


def test_the_evaluation_after_the_run_reproduces_the_runs_own_ne(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What forwards_high_ne evaluates after fit() (the train pipeline still attached) is the
    run's model: with no plan changed it gives the run's own eval NE, bit for bit."""
    import bench.e2e.protocol as protocol

    original = protocol.forwards_high_ne
    monkeypatch.setattr(protocol, "forwards_high_ne", lambda trainer, sites: original(trainer, {}))
    args = ["--dry-run", "--configs", "dlrm", "--warmup", "1", "--steps", "2", "--eval-batches", "1",
            "--no-profile", "--ne-steps", "3", "--ne-from", "4", "--decide-steps", "4",
            "--variants", "bf16,loka_aggressive", "--out", str(tmp_path)]
    assert main(args) == 0
    (loka,) = [r for r in json.loads((tmp_path / "e2e.json").read_text())["runs"] if r["variant"] == "loka_aggressive"]
    assert loka["eval_ne_forwards_high"] == loka["eval_ne"]


def test_tilegrid_suffix_runs_the_casts_on_one_program_a_tile_on_the_same_decision() -> None:
    import torch

    from bench.e2e.protocol import cast_grid, decision_key
    from bench.e2e.variants import resolve_variants
    from loka_train.kernels import triton_tensorwise as tt

    aggr, tile = resolve_variants(["loka_aggressive+graphs", "loka_aggressive+tilegrid+graphs"], "emulated")
    assert tile.tile_grid and not aggr.tile_grid and tile.name == "loka_aggressive+graphs+tilegrid"
    assert decision_key("wukong", 64, 0, aggr) == decision_key("wukong", 64, 0, tile)
    x = torch.empty(64, 1024, device="meta")  # 16 tiles of 32 x 128, 8 blocks of 8192 elements
    persistent = tt._num_programs(x, True)
    assert persistent < tt._num_tiles(x, True)
    with cast_grid(aggr):
        assert tt._num_programs(x, True) == persistent
    stages = tt._STAGES
    with cast_grid(tile):
        assert tt._num_programs(x, True) == tt._num_tiles(x, True)
        assert tt._num_programs(x, False) == tt._num_tiles(x, False)
        assert tt._STAGES == 1
    assert tt._num_programs(x, True) == persistent and tt._STAGES == stages  # restored
    with pytest.raises(SystemExit, match="tilegrid"):
        resolve_variants(["bf16+tilegrid"], "emulated")


def test_tail_suffixes_move_the_cross_layers_tail_and_share_the_decision() -> None:
    from bench.e2e.protocol import decision_key
    from bench.e2e.variants import resolve_variants

    aggr, tail, notail = resolve_variants(
        ["loka_aggressive+graphs", "loka_aggressive+graphs+tail", "loka_aggressive+graphs+notail"], "emulated")
    assert tail.loka_overrides == ("loka.mods.dcn_tail_in_gemm=true",) and "epilogue" in tail.description
    assert notail.loka_overrides == ("loka.mods.dcn_tail_in_gemm=false",) and "after the GEMM" in notail.description
    assert decision_key("dcn", 64, 0, aggr) == decision_key("dcn", 64, 0, tail) == decision_key("dcn", 64, 0, notail)
    for bad in ("bf16+notail", "bf16+tail"):
        with pytest.raises(SystemExit, match="tail"):
            resolve_variants([bad], "emulated")


def test_foldgrad_suffix_moves_the_relus_backward_and_shares_the_decision() -> None:
    from bench.e2e.protocol import decision_key
    from bench.e2e.variants import resolve_variants

    aggr, moved = resolve_variants(["loka_aggressive+graphs", "loka_aggressive+graphs+foldgrad"], "emulated")
    assert moved.loka_overrides == ("loka.mods.fold_relu_grad=true",) and "producer" in moved.description
    assert decision_key("wukong", 64, 0, aggr) == decision_key("wukong", 64, 0, moved)
    for bad in ("bf16+foldgrad", "loka_aggressive+nofold+foldgrad"):
        with pytest.raises(SystemExit, match="foldgrad"):
            resolve_variants([bad], "emulated")
