"""bench.quant_tiles --best: the fastest tile of the sweep, whatever else the result holds."""

import pytest

from bench.quant_tiles import best_config


def test_best_config_reads_only_the_sweep_rows():
    rows = [
        {"m": 8, "k": 4096, "kernel": "both layouts 32x128, 8 warps", "us": 330.0},
        {"m": 8, "k": 4096, "kernel": "both layouts 64x64, 4 warps", "us": 320.0},
        {"m": 8, "k": 4096, "kernel": "both layouts, static, randn, e4m3", "us": 250.0},  # --contexts
        {"m": 8, "k": 4096, "kernel": "two layouts, static, relu, e5m2", "us": 240.0},
        {"m": 8, "k": 4096, "kernel": "both layouts 128x128, 8 warps", "error": "out of resources"},
        {"m": 8, "k": 2048, "kernel": "both layouts 16x16, 4 warps", "us": 1.0},  # a smaller K
    ]
    assert best_config(rows) == (64, 64, 4)
    with pytest.raises(SystemExit, match="K=4096"):
        best_config([rows[2], rows[3]])  # context rows only: no configuration to pick
