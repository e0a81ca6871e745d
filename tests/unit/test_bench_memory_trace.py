"""``bench.e2e --memory-trace``'s analysis: the live allocations at the traced peak, by owner,
from an allocator snapshot's event trace (the recording itself needs CUDA)."""

from __future__ import annotations

from typing import Any

from bench.e2e import measure


def _frames(*where: tuple[str, int, str]) -> list[dict[str, Any]]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


SITE = _frames(("/usr/lib/python3/site-packages/torch/nn/functional.py", 5, "linear"),
               ("/repo/loka_train/kernels/linear.py", 310, "forward"),
               ("/repo/loka_train/mods/site.py", 88, "forward"),
               ("/repo/loka_train/runtime/trainer.py", 500, "_step"),
               ("/repo/loka_train/runtime/train_model.py", 40, "forward"))
PROBE = _frames(("/repo/loka_train/probe/measurement.py", 120, "measure"))


def test_the_peak_is_the_live_set_when_the_total_was_largest() -> None:
    gb = 2**30
    events = [
        {"action": "alloc", "addr": 1, "size": 2 * gb, "frames": SITE},
        {"action": "alloc", "addr": 2, "size": gb, "frames": PROBE},
        {"action": "free_requested", "addr": 2, "size": gb, "frames": []},  # not yet free
        {"action": "alloc", "addr": 3, "size": gb, "frames": PROBE},  # the peak: 4 GB traced
        {"action": "free_completed", "addr": 2, "size": gb, "frames": []},
        {"action": "free_completed", "addr": 3, "size": gb, "frames": []},
        {"action": "free_completed", "addr": 99, "size": 5 * gb, "frames": []},  # allocated before the trace
        {"action": "alloc", "addr": 4, "size": gb, "frames": []},
    ]
    snap = {"device_traces": [[], events]}
    m = measure.memory_peak_owners(snap, device=1, baseline_bytes=gb // 2)
    assert m["peak_gb"] == 4.5 and m["baseline_gb"] == 0.5 and not m["partial"]
    owners = {o["owner"]: (o["gb"], o["blocks"]) for o in m["owners"]}
    # Our code's innermost three frames name the owner; torch's own frame is skipped.
    site = "loka_train/kernels/linear.py:310 forward < loka_train/mods/site.py:88 forward < loka_train/runtime/trainer.py:500 _step"
    assert owners == {site: (2.0, 1), "loka_train/probe/measurement.py:120 measure": (2.0, 2)}
    # At the end: the site's block and the stackless one.
    assert m["end_gb"] == 3.0 and {o["owner"] for o in m["end_owners"]} == {site, "(no stack)"}
    # The other device's trace is empty.
    assert measure.memory_peak_owners(snap, device=0, baseline_bytes=0)["peak_gb"] == 0.0


def test_a_wrapped_ring_is_partial_and_the_report_says_so(monkeypatch: Any) -> None:
    monkeypatch.setattr(measure, "MEMORY_TRACE_ENTRIES", 2)
    events = [{"action": "alloc", "addr": i, "size": 2**20, "frames": PROBE} for i in range(2)]
    m = measure.memory_peak_owners({"device_traces": [events]}, device=0, baseline_bytes=0)
    assert m["partial"]
    md = "\n".join(measure.memory_owners_md("wukong b32768 loka_safe", m))
    assert "PARTIAL" in md and "| `loka_train/probe/measurement.py:120 measure` | 0.002 | 2 |" in md


MARKER = _frames(("/repo/bench/e2e/measure.py", 210, "_memory_trace_step_marker"),
                 ("/repo/bench/e2e/measure.py", 110, "on_step_end"))


def _step_end(addr: int) -> list[dict[str, Any]]:
    return [{"action": "alloc", "addr": addr, "size": 512, "frames": MARKER},
            {"action": "free_completed", "addr": addr, "size": 512, "frames": []}]


def test_the_steady_peak_is_the_largest_within_the_steps_asked_for() -> None:
    """Steps told apart by the step-end markers: step 0 captures (the run's peak), step 1 is a
    sampled step, steps 2 and 3 are steady; the steady peak is step 3's live set."""
    gb = 2**30
    events = [
        {"action": "alloc", "addr": 1, "size": 6 * gb, "frames": PROBE},  # step 0: set-up, 6 GB
        {"action": "free_completed", "addr": 1, "size": 6 * gb, "frames": []},
        *_step_end(100),
        {"action": "alloc", "addr": 2, "size": 4 * gb, "frames": PROBE},  # step 1 (sampled): 4 GB
        {"action": "free_completed", "addr": 2, "size": 4 * gb, "frames": []},
        *_step_end(101),
        {"action": "alloc", "addr": 3, "size": gb, "frames": SITE},  # step 2: 1 GB
        {"action": "free_completed", "addr": 3, "size": gb, "frames": []},
        *_step_end(102),
        {"action": "alloc", "addr": 4, "size": 2 * gb, "frames": SITE},  # step 3: 2 GB
        {"action": "free_completed", "addr": 4, "size": 2 * gb, "frames": []},
        *_step_end(103),
    ]
    m = measure.memory_peak_owners({"device_traces": [events]}, device=0, baseline_bytes=gb, steady_steps=[2, 3])
    assert m["peak_gb"] == 7.0  # the run's: set-up on the baseline
    steady = m["steady"]
    assert steady["peak_gb"] == 3.0 and steady["step"] == 3
    assert [o["gb"] for o in steady["owners"]] == [2.0]
    md = "\n".join(measure.memory_owners_md("wukong", m))
    assert "Peak of the unsampled timed steps: 3.00 GB (step 3 of the trace)" in md
    # No steady steps asked for (or none traced): no steady peak.
    assert measure.memory_peak_owners({"device_traces": [events]}, device=0, baseline_bytes=0)["steady"] is None


def test_a_wrapped_ring_numbers_the_steps_from_its_end() -> None:
    """The ring lost the first step's events and its end marker: with the steps recorded
    given, the steps left are still numbered as the run numbers them."""
    gb = 2**30
    events = [
        {"action": "alloc", "addr": 2, "size": 4 * gb, "frames": PROBE},  # step 1 (its start was lost)
        {"action": "free_completed", "addr": 2, "size": 4 * gb, "frames": []},
        *_step_end(101),
        {"action": "alloc", "addr": 3, "size": gb, "frames": SITE},  # step 2
        {"action": "free_completed", "addr": 3, "size": gb, "frames": []},
        *_step_end(102),
    ]
    m = measure.memory_peak_owners({"device_traces": [events]}, device=0, baseline_bytes=0, steady_steps=[2],
                                   steps_total=3)
    assert m["steady"]["step"] == 2 and m["steady"]["peak_gb"] == 1.0


START = _frames(("/repo/bench/e2e/measure.py", 420, "_memory_trace_start_marker"),
                ("/repo/bench/e2e/measure.py", 95, "on_train_start"))
DECISION = _frames(("/repo/loka_train/probe/measurement.py", 495, "views"))


def test_a_recording_begun_before_the_run_is_replayed_from_training_s_start() -> None:
    """A decision run's events precede the timed run's start marker: what it freed is gone, what
    it left allocated is in the baseline and, at the run's peak, named among the owners."""
    gb = 2**30
    events = [
        {"action": "alloc", "addr": 1, "size": 5 * gb, "frames": DECISION},  # the decision run's peak
        {"action": "free_completed", "addr": 1, "size": 5 * gb, "frames": []},
        {"action": "alloc", "addr": 2, "size": gb, "frames": DECISION},  # left allocated: in the baseline
        {"action": "alloc", "addr": 90, "size": 512, "frames": START},
        {"action": "free_completed", "addr": 90, "size": 512, "frames": []},
        {"action": "alloc", "addr": 3, "size": 2 * gb, "frames": SITE},  # step 0
        {"action": "free_completed", "addr": 3, "size": 2 * gb, "frames": []},
        *_step_end(100),
    ]
    m = measure.memory_peak_owners({"device_traces": [events]}, device=0, baseline_bytes=gb, steady_steps=[0],
                                   steps_total=1)
    assert m["peak_gb"] == 3.0 and m["start_marker"] and not m["partial"]
    assert [(o["owner"], o["gb"]) for o in m["owners"]] == [
        ("loka_train/kernels/linear.py:310 forward < loka_train/mods/site.py:88 forward < "
         "loka_train/runtime/trainer.py:500 _step", 2.0),
        ("loka_train/probe/measurement.py:495 views", 1.0)]
    assert m["steady"]["step"] == 0 and m["steady"]["peak_gb"] == 3.0


def test_a_block_left_before_the_run_and_freed_in_it_leaves_the_peak() -> None:
    """The decision run's leftover (in the baseline) is freed in the run's first step, before
    its 2 GB block: the peak is 2 GB, not the baseline plus 2 GB."""
    gb = 2**30
    events = [
        {"action": "alloc", "addr": 2, "size": gb, "frames": DECISION},
        {"action": "alloc", "addr": 90, "size": 512, "frames": START},
        {"action": "free_completed", "addr": 90, "size": 512, "frames": []},
        {"action": "free_completed", "addr": 2, "size": gb, "frames": []},
        {"action": "alloc", "addr": 3, "size": 2 * gb, "frames": SITE},
        *_step_end(100),
    ]
    # Half a GB was allocated before the recording began (weights): untraced, kept.
    m = measure.memory_peak_owners({"device_traces": [events]}, device=0, baseline_bytes=gb + gb // 2)
    assert m["peak_gb"] == 2.5 and [o["gb"] for o in m["owners"]] == [2.0]
    assert m["end_gb"] == 2.0


def test_what_is_allocated_as_training_starts_is_listed_by_owner() -> None:
    gb = 2**30
    seg = {"device": 0, "blocks": [
        {"size": gb, "state": "active_allocated", "frames": DECISION},
        {"size": gb, "state": "active_allocated", "frames": DECISION},
        {"size": 4 * gb, "state": "inactive", "frames": DECISION},  # cached, free
        {"size": gb // 4, "state": "active_allocated", "frames": []},
    ]}
    other_gpu = {"device": 1, "blocks": [{"size": 8 * gb, "state": "active_allocated", "frames": SITE}]}
    before = measure.live_blocks_by_owner({"segments": [seg, other_gpu]}, device=0)
    assert before == [{"owner": "loka_train/probe/measurement.py:495 views", "gb": 2.0, "blocks": 2},
                      {"owner": "(no stack)", "gb": 0.25, "blocks": 1}]
    m = {**measure.memory_peak_owners({"device_traces": [[]]}, device=0, baseline_bytes=0), "before_owners": before}
    md = "\n".join(measure.memory_owners_md("wukong", m))
    assert "Allocated as training started (2.25 GB" in md
    assert "| `loka_train/probe/measurement.py:495 views` | 2.000 | 2 |" in md
    assert "marker is not in the trace" not in md
    # Recorded from before the run, but the trace lacks its start marker: said.
    md = "\n".join(measure.memory_owners_md("wukong", {**m, "recorded_before_run": True}))
    assert "The training-start marker is not in the trace" in md


CAPTURE = _frames(("/repo/loka_train/runtime/graph_capture.py", 270, "__init__"))


def test_the_reserved_peak_replays_the_segments_and_names_who_asked_for_them() -> None:
    """cudaMalloc / cudaFree of the caching allocator (``segment_alloc`` / ``segment_free``,
    expandable segments' ``segment_map`` / ``segment_unmap``) replayed on what was reserved when
    the recording started: the peak falls in step 1, where a capture's segment comes on top of
    the Probe's, after a segment from before the trace was released."""
    gb = 2**30
    events = [
        {"action": "segment_alloc", "addr": 10, "size": 2 * gb, "frames": PROBE},  # step 0: 3 + 2
        {"action": "alloc", "addr": 1, "size": gb, "frames": PROBE},
        {"action": "free_completed", "addr": 1, "size": gb, "frames": []},
        *_step_end(100),
        {"action": "segment_free", "addr": 99, "size": gb, "frames": []},  # reserved before the trace
        {"action": "segment_alloc", "addr": 20, "size": 3 * gb, "frames": CAPTURE},  # step 1: 2 + 2 + 3
        {"action": "alloc", "addr": 2, "size": 2 * gb, "frames": CAPTURE},
        {"action": "segment_map", "addr": 30, "size": gb // 2, "frames": SITE},  # 7.5: the peak
        {"action": "segment_unmap", "addr": 30, "size": gb // 2, "frames": []},
        {"action": "segment_free", "addr": 10, "size": 2 * gb, "frames": []},
        *_step_end(101),
        {"action": "segment_alloc", "addr": 40, "size": gb, "frames": SITE},  # step 2: 6 GB, below
    ]
    # As the trace stopped: the capture's segment in a graph's private pool, step 2's in the
    # allocator's own (2 GB of 4 in use there: one reserved before the trace too).
    at_end = [{"address": 20, "total_size": 3 * gb, "allocated_size": 2 * gb, "segment_pool_id": (1, 3)},
              {"address": 40, "total_size": gb, "allocated_size": 0, "segment_pool_id": (0, 0)},
              {"address": 50, "total_size": 3 * gb, "allocated_size": 2 * gb, "segment_pool_id": (0, 0)}]
    m = measure.memory_peak_owners({"device_traces": [events], "segments": at_end}, device=0, baseline_bytes=gb,
                                   reserved_bytes=3 * gb)
    res = m["reserved"]
    assert res["peak_pools"] == {"CUDA graphs' pools": 3.0, "released before the trace stopped": 2.5}
    assert res["end_pools"] == {"CUDA graphs' pools": {"reserved_gb": 3.0, "allocated_gb": 2.0},
                                "the allocator's own pool": {"reserved_gb": 4.0, "allocated_gb": 2.0}}
    assert res["peak_gb"] == 7.5 and res["step"] == 1 and res["before_gb"] == 3.0
    assert res["allocated_gb"] == 3.0  # the baseline and the capture's block
    owners = {o["owner"]: o["gb"] for o in res["segments"]}
    capture = "loka_train/runtime/graph_capture.py:270 __init__"
    site = "loka_train/kernels/linear.py:310 forward < loka_train/mods/site.py:88 forward < loka_train/runtime/trainer.py:500 _step"
    assert owners == {"loka_train/probe/measurement.py:120 measure": 2.0, capture: 3.0, site: 0.5}
    md = "\n".join(measure.memory_owners_md("wukong", m))
    assert "Peak reserved 7.50 GB in step 1 of the trace, 3.00 GB allocated then (3.00 GB reserved as training" in md
    assert f"| `{capture}` | 3.000 | 1 |" in md
    assert "Those segments by pool: CUDA graphs' pools 3.00 GB; released before the trace stopped 2.50 GB." in md
    assert "by pool: CUDA graphs' pools 3.00 GB (2.00 GB); the allocator's own pool 4.00 GB (2.00 GB)." in md
    # Not asked for (no reserved figure at the start): none given.
    assert measure.memory_peak_owners({"device_traces": [events]}, device=0, baseline_bytes=0)["reserved"] is None


def test_the_reserved_peak_after_a_start_marker_counts_what_the_decision_run_reserved_once() -> None:
    """A recording begun before the run: the decision run's segments still reserved at the start
    marker are in ``reserved_bytes`` (not counted twice, nor listed among the segments reserved
    since); one it releases during the run lowers the reserved total."""
    gb = 2**30
    events = [
        {"action": "segment_alloc", "addr": 10, "size": 4 * gb, "frames": DECISION},  # decision run
        {"action": "alloc", "addr": 1, "size": 512, "frames": START},
        {"action": "free_completed", "addr": 1, "size": 512, "frames": []},
        {"action": "segment_alloc", "addr": 20, "size": 2 * gb, "frames": CAPTURE},  # 5 + 2
        {"action": "segment_free", "addr": 10, "size": 4 * gb, "frames": []},  # 3
        {"action": "segment_alloc", "addr": 30, "size": 3 * gb, "frames": SITE},  # 6: below the peak
    ]
    m = measure.memory_peak_owners({"device_traces": [events]}, device=0, baseline_bytes=0, reserved_bytes=5 * gb)
    assert m["start_marker"] and m["reserved"]["peak_gb"] == 7.0
    assert [o["owner"] for o in m["reserved"]["segments"]] == ["loka_train/runtime/graph_capture.py:270 __init__"]
