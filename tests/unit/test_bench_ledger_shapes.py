"""``bench.ledger_shapes`` times the casts as the presets run them (static scales) unless told."""

from __future__ import annotations

import json

import pytest

from bench import ledger_shapes


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_named_shapes_ledger_times_static_scales_unless_told(tmp_path, dynamic):
    out = tmp_path / "ls"
    argv = ["--out", str(out), "--batch", "16", "--shapes", "dcn_top.1", "--backends", "emulated",
            "--scalings", "tensorwise", *(["--dynamic-scales"] if dynamic else [])]
    ledger_shapes.main(argv)
    result = json.loads((out / "ledger.json").read_text())
    static_noted = [any("static scales" in n for n in d["notes"]) for d in (result, result["sites"])]
    assert static_noted == [not dynamic, not dynamic]
    assert len(result["rows"]) == 3 and all(r["fp8"] for r in result["rows"])
    assert "--batch 16" in (out / "ledger.md").read_text()
