"""bench.saved_bytes on the CPU: what a Linear + ReLU stack saves for its backward, plain and with
LoKA's FP8 sites (the Triton casts interpreted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.saved_bytes import main, parse_args


def test_the_saved_tensors_are_counted_once_per_storage_by_layer(tmp_path: Path) -> None:
    m = 96
    assert main(["--out", str(tmp_path), "--m", str(m), "--layers", "32x64,64x48", "--device", "cpu"]) == 0
    result = json.loads((tmp_path / "saved_bytes.json").read_text())
    for which in ("plain", "loka", "loka_bits"):
        rows = result[which]
        assert rows and all(r["bytes"] > 0 for r in rows)
        assert result[f"{which}_bytes"] == sum(r["bytes"] for r in rows)
    # The ReLU's output, which the next Linear saves too, once: for the ReLU's layer.
    relu_out = [r for r in result["plain"] if r["shape"] == [m, 64] and r["dtype"] == "bfloat16"]
    assert [r["layer"] for r in relu_out] == ["1"] and relu_out[0]["bytes"] == m * 64 * 2
    # LoKA: the ReLU folded into the next site's cast; each site keeps its input's FP8 transpose
    # for grad-weight (K x M), and the folded site its input before the ReLU for the mask.
    assert result["folded"] and len(result["folded"]) == 1
    loka = result["loka"]
    assert {r["layer"] for r in loka if r["dtype"] == "float8_e4m3fn" and r["shape"] == [32, m]} == {"0"}
    assert {r["layer"] for r in loka if r["dtype"] == "float8_e4m3fn" and r["shape"] == [64, m]} == {"2"}
    assert any(r["layer"] == "2" and r["shape"] == [m, 64] and r["dtype"] == "bfloat16" for r in loka)
    assert not any(r["layer"] == "0" and r["shape"] == [m, 32] for r in loka), "x kept in FP8 only"
    # With the masks as bits (mods.relu_mask_bits): the pre-activation gives way to its bits.
    bits = result["loka_bits"]
    assert not any(r["layer"] == "2" and r["shape"] == [m, 64] and r["dtype"] == "bfloat16" for r in bits)
    assert [r["shape"] for r in bits if r["dtype"] == "uint8"] == [[m, 8]]
    assert result["loka_bits_bytes"] < result["loka_bytes"]
    md = (tmp_path / "saved_bytes.md").read_text()
    assert "- total: plain" in md and "| 2 | float8_e4m3fn | 64 x 96 |" in md


def test_bad_layers_name_the_fix() -> None:
    for bad in ("32x64,48x16", "32", "ax4"):
        with pytest.raises(SystemExit, match="--layers"):
            parse_args(["--out", "x", "--layers", bad])
    with pytest.raises(SystemExit, match="--m"):
        parse_args(["--out", "x", "--m", "0"])
