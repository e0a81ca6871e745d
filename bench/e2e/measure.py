"""What one run measures: its step times, and the profile of a window of its steps.

:class:`StepClock` is a training callback that times every step after the warm-up (CUDA events
at step ends, or the wall clock with a sync), records the garbage collector's pauses and, with
``step_diag``, each step's host time and CUDA allocator calls; then profiles a window of steps
with torch.profiler (and cProfile). :func:`summarize_profile` splits that window's GPU kernel
time into GEMM / FP8 quantization / embedding / copies / other and sums the host side.

Example:
    >>> kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32")
    'gemm'
    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5)
    2.5
"""

from __future__ import annotations

import gc
import io
import math
import os
import re
import statistics
import time
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import torch

from loka_train.runtime.callbacks import Callback


# ------------------------------------------------------------------------ the clock
class StepClock(Callback):
    """Times every step after the warm-up; profiles a window of steps after the timed ones.

    Add it last, so the other callbacks' step work falls inside the step it measures.
    """

    def __init__(
        self, *, warmup: int, timed: int, profile_steps: int, device: torch.device, timing: str,
        pyprofile: bool = False, step_diag: bool = False, memory_trace: bool = False,
        memory_trace_running: bool = False, sampled_every: int | None = None,
    ) -> None:
        self.warmup = warmup
        self.timed = timed
        self.profile_steps = profile_steps
        self.sampled_every = sampled_every
        """The Probe samples every this many steps (None: no Probe): the profiled window is
        shifted off those steps (:func:`profile_offset`)."""
        self.profile_offset = 0
        """Steps between the last timed step and the profiled window, set at the last timed step."""
        self.profile_first = -1
        """The profiled window's first step, counted from the run's first step (-1: none yet)."""
        self.cuda = device.type == "cuda"
        self.timing = timing if self.cuda else "sync"
        self.ends: list[float] = []
        self.events: list[Any] = []
        self.profiler: Any = None
        self.profile: Any = None
        self.profile_wall_s = math.nan
        self._profile_t0 = 0.0
        self.pyprofile = pyprofile
        self._cprofile: Any = None
        self.pystats = ""
        """cProfile's report of the profiled window (``pyprofile``)."""
        self.gc_pauses_ms: list[float] = []
        """Python garbage-collector pauses in the timed window (host time a step may wait for)."""
        self.gpu_reserved_gb = math.nan
        """GPU memory the caching allocator holds at the end of the timed window."""
        self._gc_t0 = 0.0
        self.first_step = 0
        """The run's first step (a resumed run, ``--ne-from``, starts past 0)."""
        self.step_diag = step_diag
        self.diag: list[tuple[float, int, int, int]] = []
        """``step_diag``: per step end, (host perf_counter, and the CUDA caching allocator's
        cumulative cudaMalloc calls, cudaFree calls and allocation retries)."""
        self.sampled: list[bool] = []
        """Per step: whether a callback requested dense modules on it (the LoKA Probe's
        sampled steps), from the run's first step on."""
        self.step_peak_gb: list[tuple[float, float]] = []
        """CUDA, per step: (peak allocated, peak reserved) GB within the step (the allocator's
        peak is reset at every step end; :meth:`peak_gb` keeps the run's)."""
        self._peak_before = (0.0, 0.0)
        self.memory_trace = memory_trace and self.cuda
        """CUDA: record the allocator's events from the start of training (with Python stacks)
        and keep what was live at the peak, by owner (:func:`memory_peak_owners`)."""
        self.memory_trace_running = memory_trace_running
        """The caller started the recording before this run (`start_memory_trace`, before a
        decision run): what earlier runs left allocated then has its allocation stacks."""
        self.memory_peak: dict[str, Any] | None = None
        self._memory_baseline = 0
        self._reserved_baseline = 0
        self._memory_before: list[dict[str, Any]] = []

    def on_train_start(self, trainer: Any) -> None:
        self.first_step = trainer.step
        if self.memory_trace:
            self._memory_baseline = torch.cuda.memory_allocated()
            self._reserved_baseline = torch.cuda.memory_reserved()
            if self.memory_trace_running:
                # What is allocated as training starts, by the stacks that allocated it.
                self._memory_before = live_blocks_by_owner(
                    torch.cuda.memory._snapshot(), device=torch.cuda.current_device())
                _memory_trace_start_marker()
            else:
                start_memory_trace()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_pauses_ms.append(1000.0 * (time.perf_counter() - self._gc_t0))

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_step_start(self, trainer: Any, step: int) -> None:
        if self.cuda and step == self.first_step:
            # Set-up and graph captures happen before the first step ends: kept in the run's peak.
            self._peak_before = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.sampled.append(bool(trainer.callbacks.eager_modules(trainer, step)))
        if self.memory_trace:
            _memory_trace_step_marker()
        if self.cuda:
            # Host-side allocator counters: no device sync.
            self.step_peak_gb.append(
                (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30)
            )
            torch.cuda.reset_peak_memory_stats()
        if self.step_diag:
            stats = torch.cuda.memory_stats() if self.cuda else {}
            self.diag.append((time.perf_counter(), stats.get("num_device_alloc", 0),
                              stats.get("num_device_free", 0), stats.get("num_alloc_retries", 0)))
        if self.timing == "events":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self._sync()
            self.ends.append(time.perf_counter())
        step -= self.first_step
        last_timed = self.warmup + self.timed - 1
        if step == self.warmup - 1:
            gc.callbacks.append(self._on_gc)
        elif step == last_timed:
            self._stop_gc_timing()
            if self.cuda:
                self.gpu_reserved_gb = torch.cuda.memory_reserved() / 2**30
        if step == last_timed:
            self.profile_offset = profile_offset(
                self.first_step + last_timed + 1, self.profile_steps, self.sampled_every
            )
        if self.profile_steps and step == last_timed + self.profile_offset:
            self.profile_first = step + 1
            self._start_profiler()
        elif self.profiler is not None and step == last_timed + self.profile_offset + self.profile_steps:
            self.close()

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._sync()
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()
        if self.pyprofile:
            import cProfile

            self._cprofile = cProfile.Profile()
            self._cprofile.enable()
        self._profile_t0 = time.perf_counter()

    def _stop_gc_timing(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def close(self) -> None:
        """Stop the profiler if it runs, the GC timing and the memory trace (also after a
        failed run)."""
        self._stop_gc_timing()
        if self.memory_trace and self.memory_peak is None:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            # The timed steps that no callback sampled: what LoKA holds on every step.
            steady = [i for i, sampled in enumerate(self.sampled)
                      if self.warmup <= i < self.warmup + self.timed and not sampled]
            self.memory_peak = memory_peak_owners(
                snapshot, device=torch.cuda.current_device(), baseline_bytes=self._memory_baseline,
                reserved_bytes=self._reserved_baseline,
                steady_steps=steady, steps_total=len(self.sampled),
            )
            self.memory_peak["before_owners"] = self._memory_before
            self.memory_peak["recorded_before_run"] = self.memory_trace_running
        if self.profiler is None:
            return
        self._sync()
        self.profile_wall_s = time.perf_counter() - self._profile_t0
        prof, self.profiler = self.profiler, None
        if self._cprofile is not None:
            self._cprofile.disable()
            self.pystats = _pstats_text(self._cprofile, self.profile_steps)
            self._cprofile = None
        prof.__exit__(None, None, None)
        self.profile = prof

    def step_diagnostics(self) -> list[dict[str, float]]:
        """``step_diag``: per timed step, its host wall time (ms, previous step end to its own)
        and the cudaMalloc / cudaFree calls and allocator retries inside it. With ``--timing
        events`` (the CUDA default) nothing syncs at step ends, so a step's host time is its
        own; with ``sync`` it includes waiting for the previous step's GPU work."""
        d = self.diag
        return [
            {"host_ms": 1000.0 * (d[i][0] - d[i - 1][0]), "cuda_malloc": d[i][1] - d[i - 1][1],
             "cuda_free": d[i][2] - d[i - 1][2], "alloc_retries": d[i][3] - d[i - 1][3]}
            for i in range(self.warmup, min(self.warmup + self.timed, len(d)))
        ]

    def peak_gb(self) -> tuple[float, float]:
        """The run's peak (allocated, reserved) GB: set-up, every step and what came after."""
        if not self.cuda:
            return math.nan, math.nan
        after = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30)
        peaks = [self._peak_before, after, *self.step_peak_gb]
        return max(p[0] for p in peaks), max(p[1] for p in peaks)

    def split_by_sampling(self) -> dict[str, Any]:
        """The timed steps and the steps' memory, split by whether a callback sampled the step
        (requested dense modules): median step ms and count of each, and the peak allocated /
        reserved GB over each kind of step (CUDA). Sampled steps are what the Probe costs; the
        others are what LoKA costs on every step."""
        times = self.step_ms()
        flags = self.sampled[self.warmup : self.warmup + len(times)]
        out: dict[str, Any] = {}
        for kind, want in (("sampled", True), ("unsampled", False)):
            ts = [t for t, f in zip(times, flags) if f is want]
            out[f"steps_{kind}"] = len(ts)
            out[f"step_ms_median_{kind}"] = statistics.median(ts) if ts else math.nan
            # From the warm-up's end: the warm-up steps hold the captures and compilations.
            peaks = [p for p, f in zip(self.step_peak_gb[self.warmup :], self.sampled[self.warmup :]) if f is want]
            out[f"peak_allocated_gb_{kind}"] = max((p[0] for p in peaks), default=math.nan)
            out[f"peak_reserved_gb_{kind}"] = max((p[1] for p in peaks), default=math.nan)
        return out

    def step_ms(self) -> list[float]:
        """Milliseconds of each timed step (from the previous step's end to its own)."""
        if self.timing == "events":
            self._sync()
            marks = self.events
            return [
                marks[i - 1].elapsed_time(marks[i])
                for i in range(self.warmup, min(self.warmup + self.timed, len(marks)))
            ]
        ends = self.ends
        return [
            1000.0 * (ends[i] - ends[i - 1])
            for i in range(self.warmup, min(self.warmup + self.timed, len(ends)))
        ]


def profile_offset(first_profiled: int, profile_steps: int, every_k_steps: int | None) -> int:
    """Steps to shift a profiled window that would start at step ``first_profiled`` (the run's
    step index) so that none of its ``profile_steps`` steps is one the Probe samples (every
    ``every_k_steps``-th step; None: nothing is sampled): the profile then shows the steady
    steps, not the Probe's samples. At most ``profile_steps``; 0 when no shift can avoid
    a sampled step (``every_k_steps <= profile_steps``)."""
    if not profile_steps or not every_k_steps or every_k_steps <= profile_steps:
        return 0
    for offset in range(profile_steps + 1):
        start = first_profiled + offset
        if all((start + i) % every_k_steps for i in range(profile_steps)):
            return offset
    return 0


def _pstats_text(cprofile: Any, steps: int, top: int = 45) -> str:
    """cProfile's functions by own time, then by cumulative time (totals over `steps` steps)."""
    import pstats

    text = io.StringIO()
    text.write(f"cProfile over {steps} profiled steps (times are totals; divide by {steps} per step)\n")
    stats = pstats.Stats(cprofile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def rss_gb() -> float:
    """This process's resident host memory (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return math.nan


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ----------------------------------------------------------------------- the profile
_CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("memcpy", re.compile(r"memcpy|memset", re.I)),
    ("gemm", re.compile(
        # (?<!fb): FBGEMM's embedding, jagged and permute kernels live in namespace fbgemm_gpu::
        r"(?<!fb)gemm|sm90|cutlass|matmul|scaled_mm|f8f8|wgmma|xmma|nvjet|cublas|(^|[_:])b?mm([_:]|$)|addmm|"
        r"aten::(mm|bmm|addmm|_scaled_mm|baddbmm)$", re.I)),
    # LoKA's tensor-wise casts (_cast_kernel, _cast_both_kernel) and static-scale check.
    ("quantize", re.compile(r"quant|amax|fp8|float8|e4m3|e5m2|scale|^_cast(_both)?_kernel$|static_check", re.I)),
    ("embedding", re.compile(r"embedding|tbe|bounds_check|jagged|permute_|segment|index_select|fbgemm", re.I)),
)
TOP_KERNELS = 40
"""Kernels a profile lists by their time a step (enough to name every quantization kernel of a
step and the high-precision GEMMs of the small sites)."""
CATEGORY_NAMES = ("gemm", "quantize", "embedding", "memcpy", "other")


_SYNC_WAIT = re.compile(r"^cuda(Device|Stream|Event)Synchronize$")


def kernel_category(name: str) -> str:
    for category, pattern in _CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def _merged_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def export_trace(prof: Any, directory: Path, config: str, batch: int, variant: str) -> str:
    """Write `prof` as a gzipped Chrome trace (torch.profiler gzips a ``.gz`` path); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (re.sub(r"[^A-Za-z0-9._-]", "_", f"{config}_b{batch}_{variant}") + ".json.gz")
    prof.export_chrome_trace(str(path))
    return str(path)


def summarize_profile(clock: StepClock, median_ms: float) -> dict[str, Any]:
    """GPU kernel time per step by category, top kernels, and the busy fraction."""
    prof, steps = clock.profile, clock.profile_steps
    per_name: dict[str, float] = {}
    calls: dict[str, list[float]] = {}
    """Kernel -> the duration of each of its launches (us): which shapes a kernel's time is."""
    intervals: list[tuple[float, float]] = []
    if clock.cuda:
        from torch.autograd import DeviceType

        for evt in prof.events():
            # GPU-side user annotations (record_function ranges such as TorchRec's
            # "## forward ##" or "loka/interval", mirrored on the GPU timeline) are CUDA events
            # too, spanning idle gaps: not kernels (torch's own tables skip them likewise).
            if evt.device_type != DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
                continue
            start, end = float(evt.time_range.start), float(evt.time_range.end)
            per_name[evt.name] = per_name.get(evt.name, 0.0) + (end - start)
            calls.setdefault(evt.name, []).append(end - start)
            intervals.append((start, end))
        if not intervals:
            raise RuntimeError("the profiler recorded no CUDA kernel (CUPTI unavailable?)")
        source = "CUDA kernels (time on the GPU)"
    else:
        # CPU: self time of each operator, no device.
        for avg in prof.key_averages():
            if avg.key.startswith("aten::") and avg.self_cpu_time_total > 0:
                per_name[avg.key] = per_name.get(avg.key, 0.0) + float(avg.self_cpu_time_total)
        source = "CPU operators' self time"
    # Host side: which operators the CPU spends its time on, and how many it launches per step
    # (a launch-bound step is paid in host time, not GPU time).
    host: dict[str, tuple[float, int]] = {}
    sync_us = 0.0
    for avg in prof.key_averages():
        if _SYNC_WAIT.search(avg.key):
            # Waiting for the GPU (the step clock's own synchronize): not host work.
            sync_us += float(avg.self_cpu_time_total)
        elif avg.self_cpu_time_total > 0:
            us, n = host.get(avg.key, (0.0, 0))
            host[avg.key] = (us + float(avg.self_cpu_time_total), n + int(avg.count))
    host_aten_calls = sum(n for k, (_, n) in host.items() if k.startswith("aten::"))
    host_top = sorted(host.items(), key=lambda kv: -kv[1][0])[:15]
    total_us = sum(per_name.values())
    categories = {c: 0.0 for c in CATEGORY_NAMES}
    for name, us in per_name.items():
        categories[kernel_category(name)] += us
    busy_us = _merged_us(intervals) if intervals else total_us
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    first = clock.profile_first
    window = clock.sampled[first : first + steps]
    return {
        "source": source,
        "steps": steps,
        "first_step": clock.first_step + first,
        "sampled_steps": sum(window),
        "wall_ms_per_step_profiled": 1000.0 * clock.profile_wall_s / steps,
        "kernel_ms_per_step": total_us / 1000.0 / steps,
        "kernels_per_step": len(intervals) / steps,
        "busy_ms_per_step": busy_us / 1000.0 / steps,
        "busy_fraction": (busy_us / 1000.0 / steps) / median_ms if median_ms > 0 else math.nan,
        "categories": {
            c: {"ms_per_step": us / 1000.0 / steps, "share": us / total_us if total_us else math.nan}
            for c, us in categories.items()
        },
        "host_aten_calls_per_step": host_aten_calls / steps,
        "host_self_cpu_ms_per_step": sum(us for us, _ in host.values()) / 1000.0 / steps,
        "host_sync_wait_ms_per_step": sync_us / 1000.0 / steps,
        "top_host_ops": [
            {"name": k[:120], "self_cpu_ms_per_step": us / 1000.0 / steps, "calls_per_step": n / steps}
            for k, (us, n) in host_top
        ],
        "top_kernels": [
            {
                "name": name[:120], "category": kernel_category(name), "ms_per_step": us / 1000.0 / steps,
                **({
                    "calls_per_step": len(calls[name]) / steps,
                    # The longest launches first (at most 32), to tell a kernel's shapes apart.
                    "us_per_call": [round(d, 1) for d in sorted(calls[name], reverse=True)[:32]],
                } if name in calls else {}),
            }
            for name, us in top
        ],
    }



# ------------------------------------------------------------------ memory at the peak
MEMORY_TRACE_ENTRIES = 500_000
"""Allocator events ``--memory-trace`` keeps, each with its Python stack in host memory (a ring:
a run with more loses its first ones, and its peak is then marked partial)."""

_OWNER_DIRS = ("/loka_train/", "/bench/", "/torchrec/", "/fbgemm_gpu/")
"""Where the frames that name an allocation's owner live (the first one found, innermost first)."""


def _owner(frames: list[dict[str, Any]]) -> str:
    """Who allocated a block: up to three frames of our code or TorchRec / FBGEMM, innermost
    first (``file:line function``), else the innermost frame."""
    ours = [f for f in frames if any(d in f.get("filename", "") for d in _OWNER_DIRS)]
    picked = ours[:3] or frames[:1]
    if not picked:
        return "(no stack)"
    return " < ".join(f"{_short_path(f['filename'])}:{f.get('line', '?')} {f.get('name', '?')}" for f in picked)


def _short_path(filename: str) -> str:
    """`filename` from its package's directory on (``loka_train/kernels/linear.py``)."""
    for d in _OWNER_DIRS:
        i = filename.rfind(d)
        if i >= 0:
            return filename[i + 1 :]
    return filename.rsplit("/site-packages/", 1)[-1]


_STEP_MARKER = "_memory_trace_step_marker"
_START_MARKER = "_memory_trace_start_marker"


def start_memory_trace() -> None:
    """Record the CUDA allocator's events, each with its Python stack (``--memory-trace``)."""
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_TRACE_ENTRIES, stacks="python")


def _memory_trace_start_marker() -> None:
    """Training starts, written into a trace that an earlier run's events precede: one small
    block allocated and freed here; `memory_peak_owners` replays the events after the last one."""
    torch.empty(1, device="cuda")


def live_blocks_by_owner(snapshot: dict[str, Any], *, device: int, top: int = 25) -> list[dict[str, Any]]:
    """The blocks allocated on `device` in an allocator snapshot, summed by owner (the stack that
    allocated them; ``(no stack)`` for blocks allocated while nothing was recorded).

    >>> f = [{"filename": "/x/loka_train/probe/measurement.py", "line": 7, "name": "views"}]
    >>> seg = {"device": 0, "blocks": [{"size": 2**30, "state": "active_allocated", "frames": f},
    ...                                {"size": 2**29, "state": "inactive"},
    ...                                {"size": 2**28, "state": "active_allocated"}]}
    >>> [(o["owner"], o["gb"]) for o in live_blocks_by_owner({"segments": [seg]}, device=0)]
    [('loka_train/probe/measurement.py:7 views', 1.0), ('(no stack)', 0.25)]
    """
    blocks = [(int(b["size"]), _owner(b.get("frames") or []))
              for seg in snapshot.get("segments", []) if seg.get("device", device) == device
              for b in seg.get("blocks", []) if b.get("state") == "active_allocated"]
    return _by_owner(blocks, top)


def _by_owner(blocks: Iterable[tuple[int, str]], top: int) -> list[dict[str, Any]]:
    """``(bytes, owner)`` blocks summed by owner: the `top` largest, with their block counts."""
    sums: dict[str, list[int]] = {}
    for size, owner in blocks:
        acc = sums.setdefault(owner, [0, 0])
        acc[0] += size
        acc[1] += 1
    ranked = sorted(sums.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"owner": o, "gb": n / 2**30, "blocks": c} for o, (n, c) in ranked]


def _is_marker(e: dict[str, Any], name: str) -> bool:
    """Whether trace event `e` allocates the block of the marker function `name`."""
    return e.get("action") == "alloc" and any(f.get("name") == name for f in (e.get("frames") or [])[:2])


def _memory_trace_step_marker() -> None:
    """A step end, written into the allocator's trace: one small block allocated and freed by
    this function (its name in the block's stack), so `memory_peak_owners` can tell the steps
    apart."""
    torch.empty(1, device="cuda")


def memory_peak_owners(
    snapshot: dict[str, Any], *, device: int, baseline_bytes: int, top: int = 25,
    steady_steps: Collection[int] = (), steps_total: int | None = None, reserved_bytes: int | None = None,
) -> dict[str, Any]:
    """The live allocations at the traced peak, by owner, from a CUDA allocator snapshot taken
    with its history recorded (``torch.cuda.memory._record_memory_history(stacks="python")``).

    The trace's ``alloc`` / ``free_completed`` events of `device` are replayed in order; the
    peak is ``baseline_bytes`` (allocated when the run's recording started, or at its start
    marker: weights, buffers, whatever came before) plus the largest growth of the blocks
    allocated since and not yet freed. Returns
    the peak, its owners (the top `top` by bytes, with counts) and the owners of what is still
    allocated when the trace stopped (captured graphs' pools, caches; the clock stops it at the
    end of its profiled window, else when the run closes), and ``partial`` when the ring of
    events wrapped (the first events lost: the peak may be understated). Blocks allocated
    before the trace and freed during it stay in the baseline: the peak may be overstated by
    them. A recording started before the run (a decision run first) has a
    `_memory_trace_start_marker` where the run's training starts (``start_marker``): the events
    before it are replayed only to know which of their blocks are still live there, so that
    their frees during the run count and, at a peak, they are named among its owners; the
    run's peaks are taken from the marker on.

    With `steady_steps` (step indices from the start of the recording, told apart by the
    step-end markers of `_memory_trace_step_marker`), also the peak within those steps and its
    owners (``steady``: what the unsampled steps hold, apart from set-up, captures and sampled
    steps). `steps_total` (the steps that ended while recording) numbers the steps from the end
    of the trace, so that a ring that wrapped (its first markers lost) still names them right.

    With `reserved_bytes` (what the allocator reserved as training started: when the run's
    recording started, or at its start marker), also the peak of reserved memory
    (``reserved``): the trace's ``segment_alloc`` / ``segment_free`` events replayed
    (cudaMalloc and cudaFree of the caching allocator, graph pools included), the step it fell
    in, what was allocated then, and the segments reserved since training started by the stack
    whose allocation asked for them (those from before are in ``before_gb``).

    >>> f = [{"filename": "/x/loka_train/kernels/linear.py", "line": 9, "name": "forward"}]
    >>> snap = {"device_traces": [[{"action": "alloc", "addr": 1, "size": 2**30, "frames": f},
    ...                            {"action": "alloc", "addr": 2, "size": 2**29, "frames": []},
    ...                            {"action": "free_completed", "addr": 1, "size": 2**30, "frames": []}]]}
    >>> m = memory_peak_owners(snap, device=0, baseline_bytes=0)
    >>> m["peak_gb"], m["owners"][0]["owner"], m["end_gb"]
    (1.5, 'loka_train/kernels/linear.py:9 forward', 0.5)
    """
    traces = snapshot.get("device_traces", [])
    recorded = traces[device] if device < len(traces) else []
    events = recorded
    live: dict[int, tuple[int, str]] = {}
    total = 0
    segments: dict[int, tuple[int, str]] = {}
    reserved = 0

    def replay(e: dict[str, Any]) -> None:
        nonlocal total, reserved
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (int(e["size"]), _owner(e.get("frames") or []))
            total += int(e["size"])
        elif action == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        elif action in ("segment_alloc", "segment_map"):
            old = segments.get(e["addr"], (0, ""))[0]
            segments[e["addr"]] = (old + int(e["size"]), _owner(e.get("frames") or []))
            reserved += int(e["size"])
        elif action in ("segment_free", "segment_unmap"):
            # (Of a segment not replayed, reserved before the recording or the start marker, the
            # release lowers the reserved total only.)
            size = int(e["size"])
            reserved -= size
            if e["addr"] in segments:
                left = segments[e["addr"]][0] - size
                if left > 0:
                    segments[e["addr"]] = (left, segments[e["addr"]][1])
                else:
                    segments.pop(e["addr"])

    # A recording begun before this run (`_memory_trace_start_marker`): the blocks allocated
    # before the marker and still live there are in `baseline_bytes`; replayed, their frees
    # during the run are seen, and at a peak they are named with the stacks that allocated them.
    starts = [i for i, e in enumerate(events) if _is_marker(e, _START_MARKER)]
    if starts:
        for e in events[: starts[-1]]:
            replay(e)
        events = events[starts[-1] + 1:]  # (the marker's own free finds nothing live)
        segments.clear()  # reserved before training started: in `reserved_bytes`, not listed
    # What `baseline_bytes` holds beyond the replayed blocks (allocated before the recording).
    untraced = max(baseline_bytes - total, 0)
    peak, peak_live = total, dict(live)
    # Likewise for reserved memory: its replayed segments are counted from here.
    untraced_reserved = (reserved_bytes or 0) - reserved
    reserved_peak, reserved_step, reserved_alloc, reserved_segments = reserved, None, total, dict(segments)
    steady = set(steady_steps)

    # The first traced event's step: the steps recorded minus the step ends still in the trace.
    step = 0 if steps_total is None else steps_total - sum(1 for e in events if _is_marker(e, _STEP_MARKER))
    steady_peak, steady_step, steady_live = -1, None, {}
    for e in events:
        if _is_marker(e, _STEP_MARKER):
            step += 1  # the marker itself is freed at once: not counted
            continue
        replay(e)
        if e.get("action") == "alloc":
            if total > peak:
                peak, peak_live = total, dict(live)
            if step in steady and total > steady_peak:
                steady_peak, steady_step, steady_live = total, step, dict(live)
        elif e.get("action") in ("segment_alloc", "segment_map") and reserved > reserved_peak:
            reserved_peak, reserved_step, reserved_alloc, reserved_segments = reserved, step, total, dict(segments)

    return {
        "peak_gb": (untraced + peak) / 2**30,
        "baseline_gb": baseline_bytes / 2**30,
        "start_marker": bool(starts),
        "events": len(events),
        "partial": len(recorded) >= MEMORY_TRACE_ENTRIES and not starts,
        "owners": _by_owner(peak_live.values(), top),
        "end_gb": total / 2**30,
        "end_owners": _by_owner(live.values(), top),
        "steady": None if steady_step is None else {
            "peak_gb": (untraced + steady_peak) / 2**30, "step": steady_step,
            "owners": _by_owner(steady_live.values(), top),
        },
        "reserved": None if reserved_bytes is None else {
            "peak_gb": (untraced_reserved + reserved_peak) / 2**30,
            "step": reserved_step,
            "allocated_gb": (untraced + reserved_alloc) / 2**30,
            "before_gb": reserved_bytes / 2**30,
            "segments": _by_owner(reserved_segments.values(), top),
            "peak_pools": _segments_by_pool(reserved_segments, snapshot, device),
            "end_pools": _pools_at_end(snapshot, device),
        },
    }


_OWN_POOL = "the allocator's own pool"
_GRAPH_POOLS = "CUDA graphs' pools"


def _pool_name(pool_id: Any) -> str:
    """A snapshot segment's ``segment_pool_id``: (0, 0) is the allocator's own pool, any other a
    private pool (CUDA graph captures)."""
    return _OWN_POOL if tuple(pool_id or (0, 0)) == (0, 0) else _GRAPH_POOLS


def _segments_by_pool(segments: dict[int, tuple[int, str]], snapshot: dict[str, Any], device: int) -> dict[str, float]:
    """GB of `segments` (address -> (bytes, owner)) by the pool that owns them in the snapshot
    taken as the trace stopped; a segment no longer reserved then is counted as such."""
    pools = {int(seg["address"]): _pool_name(seg.get("segment_pool_id"))
             for seg in snapshot.get("segments", []) if seg.get("device", device) == device}
    out: dict[str, float] = {}
    for addr, (size, _) in segments.items():
        name = pools.get(addr, "released before the trace stopped")
        out[name] = out.get(name, 0.0) + size / 2**30
    return out


def _pools_at_end(snapshot: dict[str, Any], device: int) -> dict[str, dict[str, float]]:
    """Reserved and allocated GB by pool in the snapshot taken as the trace stopped."""
    out: dict[str, dict[str, float]] = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        acc = out.setdefault(_pool_name(seg.get("segment_pool_id")), {"reserved_gb": 0.0, "allocated_gb": 0.0})
        acc["reserved_gb"] += int(seg["total_size"]) / 2**30
        acc["allocated_gb"] += int(seg.get("allocated_size", 0)) / 2**30
    return out


def memory_owners_md(name: str, m: dict[str, Any], top: int = 12) -> list[str]:
    """Markdown lines: one run's peak and its largest owners (:func:`memory_peak_owners`)."""
    lines = [f"**{name}**: traced peak {m['peak_gb']:.2f} GB ({m['baseline_gb']:.2f} GB allocated before the "
             f"trace{', PARTIAL: the event ring wrapped' if m['partial'] else ''}); still allocated when the "
             f"trace stopped {m['end_gb']:.2f} GB.", "", "| at the peak: owner (innermost first) | GB | blocks |",
             "|---|---|---|"]
    lines += [f"| `{o['owner']}` | {o['gb']:.3f} | {o['blocks']} |" for o in m["owners"][:top]]
    if m.get("recorded_before_run") and not m.get("start_marker"):
        lines += ["", "**The training-start marker is not in the trace: the events before training were "
                  "replayed too, so these peaks may count what the decision run allocated.**"]
    before = m.get("before_owners") or []
    if before:
        gb = sum(o["gb"] for o in before)
        lines += ["", f"Allocated as training started ({gb:.2f} GB in the largest owners; recorded from the start "
                  "of the variant's decision run, so `(no stack)` is what earlier runs of the process left):",
                  "", "| owner (innermost first) | GB | blocks |", "|---|---|---|"]
        lines += [f"| `{o['owner']}` | {o['gb']:.3f} | {o['blocks']} |" for o in before[:top]]
    res = m.get("reserved")
    if res is not None:
        when = "when the trace started" if res["step"] is None else f"in step {res['step']} of the trace"
        lines += ["", f"Peak reserved {res['peak_gb']:.2f} GB {when}, {res['allocated_gb']:.2f} GB allocated then "
                  f"({res['before_gb']:.2f} GB reserved as training started); the segments reserved since, by "
                  "the allocation that asked for them:", "", "| segment: owner (innermost first) | GB | segments |",
                  "|---|---|---|"]
        lines += [f"| `{o['owner']}` | {o['gb']:.3f} | {o['blocks']} |" for o in res["segments"][:top]]
        pools = res.get("peak_pools") or {}
        if pools:
            lines += ["", "Those segments by pool: " + "; ".join(f"{k} {v:.2f} GB" for k, v in sorted(pools.items())) + "."]
        end = res.get("end_pools") or {}
        if end:
            lines += ["", "Reserved (allocated) as the trace stopped, by pool: " + "; ".join(
                f"{k} {v['reserved_gb']:.2f} GB ({v['allocated_gb']:.2f} GB)" for k, v in sorted(end.items())) + "."]
    steady = m.get("steady")
    if steady is not None:
        lines += ["", f"Peak of the unsampled timed steps: {steady['peak_gb']:.2f} GB (step {steady['step']} of the "
                  "trace).", "", "| at that peak: owner (innermost first) | GB | blocks |", "|---|---|---|"]
        lines += [f"| `{o['owner']}` | {o['gb']:.3f} | {o['blocks']} |" for o in steady["owners"][:top]]
    return [*lines, ""]
