"""Compiled dense modules with FP8 sites compile whole, and a frame that torch.compile gives up
on is a reported fallback, not silent.

The known issue this guards against (bench/results/e2e_rotated_batches_h100_2026-11-24b/NOTES.md, "Found: compiled FP8 sites in a
layer loop"): a graph break inside DCN's loop over cross layers (the sites' Probe check, and on
torch 2.11 one inside the traced FP8 backward) made dynamo run the whole cross network eagerly
for the rest of the run (on an H100 it cost DCN at batch 32768 8.6 ms per step). Now the FP8
Functions are opaque custom ops (``kernels.opaque``) and a sampled site reports through opaque ops
too (``mods.probe_tap``), whether the Probe's steps take the compiled forward
(``trainer.compile_sampled``, by default with ``compile_dense``) or the uncompiled one, so no
frame is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loka_train.mods import sites
from loka_train.runtime.compile import dynamo_frame_skips
from loka_train.plugin.callback import LokaCallback
from loka_train.runtime.trainer import Trainer
from tests.dist._loka import preset
from tests.dist._multiprocess import run_multiprocess
from tests.dist._tiny import tiny_data, tiny_model, tiny_trainer


def _train(rank: int, world_size: int, out: str, model: str, break_in_sites: bool,
           compile_sampled: bool | None = None) -> dict[str, Any]:
    import torch

    from loka_train.mods import site as site_mod

    if break_in_sites:
        # A graph break in every linear site: inside DCN's cross-layer loop, as the bug was.
        linear = site_mod.GemmSite.linear

        def breaking(self: Any, *args: Any, **kwargs: Any) -> Any:
            torch._dynamo.graph_break()
            return linear(self, *args, **kwargs)

        site_mod.GemmSite.linear = breaking  # type: ignore[method-assign]
    # The Probe on (it samples steps 0-3), so that sampled steps run through the router too.
    loka = preset("aggressive", "loka.dispatch.enabled=false", "loka.guard.enabled=false",
                  "loka.comm_enabled=false", "loka.mods.initial_plan=fp8_rowwise",
                  "loka.mods.backend=emulated")
    from loka_train.mods import probe_tap

    taps = [0]  # reports that came through the compiled code's taps
    site_of = probe_tap._site

    def counted(tap_id: int) -> Any:
        taps[0] += 1
        return site_of(tap_id)

    probe_tap._site = counted  # type: ignore[assignment]
    before = dynamo_frame_skips()
    trainer = Trainer(model=tiny_model(model), data=tiny_data(),
                      trainer=tiny_trainer(Path(out), compile_dense=True, compile_backend="eager", steps=4,
                                           compile_sampled=compile_sampled),
                      callbacks=[callback := LokaCallback(loka)])
    summary = trainer.fit()
    assert callback.probe is not None
    after = dynamo_frame_skips()
    skipped = sorted(f for f, n in after.items() if n > before.get(f, 0))
    return {"skipped": skipped, "fallbacks": summary["fallbacks"], "frames": summary["compile_skipped_frames"],
            "fp8_sites": sum(s.has_fp8() for s in sites(trainer.model).values()),
            "num_obs": callback.probe.state_dict()["num_obs"], "taps": taps[0]}


@pytest.mark.parametrize("model", ["dcn", "wukong", "dlrm"])
def test_compiled_fp8_models_skip_no_frame(tmp_path: Path, model: str) -> None:
    result = run_multiprocess(_train, 1, str(tmp_path), model, False)[0]
    assert result["fp8_sites"] > 0, result
    assert result["skipped"] == [] and result["frames"] == [], result
    assert not [f for f in result["fallbacks"] if f.startswith("compile_dense:")], result


@pytest.mark.parametrize("model", ["dcn", "wukong"])
def test_compiled_sampled_steps_skip_no_frame_and_observe_what_uncompiled_ones_do(tmp_path: Path, model: str) -> None:
    """``trainer.compile_sampled``: the Probe's sampled steps run the compiled modules, whose
    sites report through opaque ops (no frame skipped, DCN's and Wukong's layer loops
    included), and the Probe takes as many samples of every site and role as with the
    uncompiled sampled steps."""
    compiled = run_multiprocess(_train, 1, str(tmp_path / "on"), model, False, True)[0]
    uncompiled = run_multiprocess(_train, 1, str(tmp_path / "off"), model, False, False)[0]
    assert compiled["skipped"] == [] and compiled["frames"] == [], compiled
    assert not [f for f in compiled["fallbacks"] if f.startswith("compile_dense:")], compiled
    assert compiled["taps"] > 0 and uncompiled["taps"] == 0, (compiled["taps"], uncompiled["taps"])
    assert compiled["num_obs"] == uncompiled["num_obs"], (compiled["num_obs"], uncompiled["num_obs"])
    assert any(n > 0 for per_site in compiled["num_obs"] for n in per_site), compiled


def test_frames_dynamo_skips_are_listed_fallbacks(tmp_path: Path) -> None:
    result = run_multiprocess(_train, 1, str(tmp_path), "dcn", True)[0]
    # The injected break skips the cross network's forward, as the bug did.
    assert any("mods/interaction.py" in f for f in result["skipped"]), result
    listed = [f for f in result["fallbacks"] if f.startswith("compile_dense: torch.compile runs ")]
    assert len(listed) == len(result["skipped"]), (listed, result["skipped"])
    for frame in result["skipped"]:
        assert any(frame in line for line in listed), (frame, listed)
    assert sorted(result["frames"]) == result["skipped"], result
