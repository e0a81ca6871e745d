"""bench.comm_codec: its per-MB arithmetic, its verdicts, and its CPU dry run end to end."""

from __future__ import annotations

import json

import pytest

from bench import comm_codec


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    return comm_codec


def test_per_mb_arithmetic(bench) -> None:  # type: ignore[no-untyped-def]
    # 8000 rows of 128 values (4.096 MB of fp32) as an FP8 row-wise payload (132 B per row).
    numel = 8000 * 128
    r = bench.per_mb(numel, 8000 * 132, encode_us=2.048, decode_us=2.048)
    ratio = 132 / 512
    assert r["mb"] == 4.096 and r["bytes_ratio"] == pytest.approx(ratio)
    assert r["cost_us_per_mb"] == pytest.approx(1.0)
    # FP32 takes 1e6 B / 450e9 B/s = 2.222 us per MB over NVLink, 20 us over 50 GB/s IB.
    assert r["saved_us_per_mb"]["nvlink"] == pytest.approx((1 - ratio) * 1e3 / 450)
    assert r["saved_us_per_mb"]["infiniband"] == pytest.approx((1 - ratio) * 20.0)
    assert r["net_us_per_mb"]["nvlink"] == pytest.approx((1 - ratio) * 1e3 / 450 - 1.0)
    # Break-even: the bandwidth at which saved == cost (1 us per MB -> (1 - ratio) * 1000 GB/s).
    assert r["breakeven_gbps"] == pytest.approx((1 - ratio) * 1e3)
    assert bench.per_mb(numel, 4 * numel, 0.0, 0.0)["breakeven_gbps"] == float("inf")


def test_verdicts_compare_the_cheapest_of_each_precision(bench) -> None:  # type: ignore[no-untyped-def]
    def row(precision: str, impl: str, cost: float) -> dict:
        return {"size": "s", "direction": "forward", "precision": precision, "impl": impl,
                "cost_us_per_mb": cost, "net_us_per_mb": {"nvlink": -cost, "infiniband": 10 - cost}}

    rows = [row("bf16", "reference", 3.0), row("bf16", "triton", 1.0), row("fp8", "reference", 9.0),
            row("fp8", "triton", 0.9), {"size": "s", "direction": "forward", "precision": "fp8",
                                        "impl": "fbgemm", "skipped": "needs CUDA"}]
    (v,) = bench.verdicts(rows)
    assert (v["fp8"], v["bf16"], v["target_met"]) == ("fp8/triton", "bf16/triton", True)
    assert v["fp8_net_minus_bf16_net_us_per_mb"]["nvlink"] == pytest.approx(0.1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_dry_run_writes_json_and_markdown(bench, tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "comm_codec.json").read_text())
    rows = report["results"]
    expected = len(bench.DRY_SIZES) * len(bench.DIRECTIONS) * len(bench.VARIANTS)
    assert len(rows) == expected
    assert not [r for r in rows if r["error"]]
    fbgemm = [r for r in rows if r["impl"] == "fbgemm"]
    assert fbgemm and all("needs a CUDA device" in r["skipped"] for r in fbgemm)
    measured = [r for r in rows if not r["skipped"]]
    assert all(r["cost_us_per_mb"] > 0 and r["timed"] == "eager" for r in measured)
    # The Triton codec's payloads are the reference's, byte for byte, in the bench too.
    assert all(r["identical_to_reference"] for r in measured if r["impl"] == "triton")
    fp8 = [r for r in measured if r["precision"] == "fp8"]
    assert {r["fp8_format"] for r in fp8} == {"e4m3", "e5m2"}
    assert len(report["verdicts"]) == len(bench.DRY_SIZES) * len(bench.DIRECTIONS)
    md = (tmp_path / "comm_codec.md").read_text()
    assert "| size (B x T x D) |" in md and "## FP8 against BF16" in md
    assert md.count("fp8/triton") >= len(bench.DRY_SIZES) * len(bench.DIRECTIONS)
