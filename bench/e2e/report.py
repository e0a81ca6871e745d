"""The benchmark's report: ``e2e.json`` (everything) and ``e2e.md`` (tables and verdicts).

:func:`report_data` assembles the report from the runs so far (the ratios and targets
recomputed), :func:`write_report` writes both files, and :func:`render` rewrites ``e2e.md``
from an ``e2e.json`` already written (``--render``). The Markdown has the command, GPU and
versions, per batch size a table of every variant (step time, samples/s, speed-up and NE delta
against bf16, FP8 coverage), where the GPU and host time goes in the profiled steps, the targets
of issues 26 and 9, the shared checkpoints of ``--ne-from``, the slow steps of ``--step-diag``, the runs
in the order they ran, and the errors.

Example:
    >>> _ne_delta_cell({"ne_delta_rel_vs_bf16": 0.000068, "ne_delta_rel_se_vs_bf16": 0.00001})
    '+0.007% ± 0.0010%'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.e2e.measure import memory_owners_md
from bench.e2e.protocol import Runs, decayed_steps
from bench.e2e.variants import CONFIGS, DATA, DRY_CONFIGS, DRY_DATA, Variant
from bench.e2e.verdicts import (
    FP8_GEMM_PEAK,
    add_ratios,
    all_targets,
    fmt_pct,
    fmt_x,
    fp8_ceiling,
    ne_measured,
    same_settings_reference,
)
from loka_train.dispatch.ledger import LedgerRow, site_table


def _version(module: str, dist_names: tuple[str, ...]) -> str | None:
    from importlib import metadata

    for name in dist_names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    with contextlib.suppress(Exception):
        mod = __import__(module)
        return str(getattr(mod, "__version__", "?"))
    return None


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchrec": _version("torchrec", ("torchrec",)),
        "fbgemm_gpu": _version("fbgemm_gpu", ("fbgemm-gpu", "fbgemm_gpu", "fbgemm-gpu-cpu", "fbgemm_gpu_cpu")),
        "fbgemm_gpu_genai": _version("fbgemm_gpu", ("fbgemm-gpu-genai", "fbgemm_gpu_genai")),
        "triton": _version("triton", ("triton",)),
        "torchao": _version("torchao", ("torchao",)),
        "hydra": _version("hydra", ("hydra-core",)),
        "host": platform.node(),
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability())
    else:
        env["gpu"] = f"none (CPU, {torch.get_num_threads()} threads)"
    return env


def _fp8_cell(r: dict[str, Any]) -> str:
    if "loka" in r:
        lk = r["loka"]
        cell = f"{lk['fp8_coverage']:.0%} ({lk['num_fp8_gemms']}/{lk['num_gemms']} GEMMs)"
        per_round = [x["fp8_coverage"] for x in r.get("repeats", []) if "fp8_coverage" in x]
        if len(set(per_round)) > 1:  # the plans above are round 1's
            cell += "; by round " + ", ".join(f"{c:.0%}" for c in per_round)
        return cell
    if "torchao" in r:
        t = r["torchao"]
        return f"{len(t['converted'])}/{len(t['converted']) + len(t['skipped'])} Linear"
    return "-"


def write_report(out: Path, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(data, indent=1, default=str))
    env, args = data["environment"], data["args"]
    lines = [
        "# End-to-end training step time and quality (issue 9)",
        "",
        f"- command: `{data['command']}`",
        f"- GPU: **{env['gpu']}**" + (f" ({env['capability']})" if "capability" in env else ""),
        f"- torch {env['torch']} (CUDA {env['cuda']}), torchrec {env['torchrec']}, fbgemm_gpu "
        f"{env['fbgemm_gpu']} (genai {env['fbgemm_gpu_genai']}), triton {env['triton']}, "
        f"torchao {env['torchao'] or 'not installed'}, python {env['python']}",
        f"- 1 rank, TorchRec DMP (table-wise, fused row-wise Adagrad), TrainPipelineSparseDist, bf16 "
        f"autocast; {args['warmup']} warm-up + {args['steps']} timed steps "
        f"({'wall clock, synchronize at each step end' if args['timing'] == 'sync' else 'CUDA events at step ends'})"
        + ("; train batches pinned (trainer.pin_memory), not in +pageable variants" if data.get("pinned_batches") else "")
        + f", then {args['profile_steps']} profile steps; eval NE on {args['eval_batches']} held-out "
        f"batches after {args.get('ne_from', 0) + args['train_steps']} steps; train data "
        f"cycles {args['cache_batches']} batches; same data and seeds for every variant"
        + (f"; **paired continuations**: per seed, {args['ne_base']} trained {args['ne_from']} steps and "
           f"saved a checkpoint, and every variant of that seed resumed it (fresh callbacks) for its "
           f"{args['train_steps']} steps" if args.get("ne_from") else "")
        + ("; first a discarded warm run of " + ", ".join(
               f"{w['variant']} ({w['config']} b{w['batch']}, {w['status']})" for w in data["warm_runs"])
           + " (--warm-run)" if data.get("warm_runs") else "")
        + (f"; both learning rates decay to 0 (power 2) over each variant's last "
           f"{decayed_steps(args['ne_decay'], args['train_steps'])} steps (--ne-decay {args['ne_decay']})"
           if args.get("ne_decay") else "")
        + (f"; {args['repeats']} interleaved runs per variant (trainer.seed 0..{args['repeats'] - 1}): "
           "median step time over runs, mean NE, NE deltas paired by seed (s.e. in the targets)" if args["repeats"] > 1 else ""),
        f"- LoKA variants: a {args['decide_steps']}-step decision run (preset, every site sampled "
        f"every step, probe interval {args['decide_interval']}"
        + (f", resuming the step-{args['ne_from']} checkpoint" if args.get("ne_from") else "")
        + "), then the timed run "
        + ("from that checkpoint" if args.get("ne_from") else "from fresh weights")
        + " with the decided plans and the preset's own sampling schedule"
        + ("; variants that differ only in how plans run (+static, +dynamic, +nofold, +bits, +nobits, +foldgrad, +tail, +notail, +rotate, +tilegrid) share one decision run "
           + ("per config and batch, the first seed's, for every seed (--decide-once)" if args.get("decide_once")
              else "(--share-decisions)") if args.get("share_decisions") else ""),
        f"- wall time of the whole benchmark: {data['wall_s']:.0f} s",
        "",
        "## Configs",
        "",
    ]
    for name, overrides in data["configs"].items():
        lines.append(f"- **{name}**: `{' '.join(overrides)}`")
    for batch in args["batch_sizes"]:
        rows = [r for r in data["results"] if r["batch"] == batch]
        lines += [
            "",
            f"## Batch {batch} per GPU",
            "",
            "| config | variant | step ms median [p10, p90] | samples/s | vs bf16 | vs bf16 same settings: median, mean "
            "| eval NE | NE vs bf16 | FP8 | notes |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["status"] != "ok":
                err = r.get("error", r["status"]).replace("|", "/").replace("\n", " ")
                lines.append(f"| {r['config']} | {r['variant']} | {r['status']} | | | | | | | {err[:200]} |")
                continue
            notes = []
            if "repeats" in r:
                notes.append(
                    f"{len(r['repeats'])} runs (seeds {', '.join(str(x['seed']) for x in r['repeats'])}); "
                    f"NE sd {r.get('eval_ne_std', math.nan):.5f}"
                )
            slow = [t for t in r.get("step_ms", []) if t > 3 * r["step_ms_median"]]
            if slow:
                # The median hides them; the mean (what a long run's wall time follows) does not.
                notes.append(f"mean {r['step_ms_mean']:.2f} ms: {len(slow)} steps > 3x the median "
                             f"(max {max(slow):.0f} ms)")
            if "decide" in r:
                d = r["decide"]
                if d.get("loaded_from"):
                    notes.append(f"plans of the decision saved in {d['loaded_from']} (--decisions)")
                elif d.get("shared_from"):
                    of_seed = f" of seed {d['seed']}" if d.get("seed", r.get("seed")) != r.get("seed") else ""
                    notes.append(f"plans of {d['shared_from']}'s decision{of_seed} (--share-decisions)")
                else:
                    start = f" from step {d['from_step']}" if d.get("from_step") else ""
                    notes.append(f"decided in {d['steps']} steps{start} ({d['plan_changes']} changes)")
            if r.get("cuda_graphs"):
                g = r["cuda_graphs"]
                eager = ", ".join(f"{k} {v}" for k, v in g["eager"].items())
                notes.append(f"graphs: {g['captures']} captures, {g['replays']} replays"
                             + (f" + {g['requested_replays']} of sampled steps" if g.get("requested_replays") else "")
                             + (f", eager calls: {eager}" if eager else ""))
            if r.get("loka", {}).get("guard_trips"):
                notes.append(f"guard trips {r['loka']['guard_trips']}")
            static = r.get("loka", {}).get("static_scales") or []
            if static:
                recasts = sum(s["recasts"] for s in static)
                used = sum(bool(s.get("tensorwise", True)) for s in static)
                notes.append(f"static scales: {recasts} recast(s), {used} tensor-wise operands")
            if r.get("fallbacks"):
                notes.append(f"{len(r['fallbacks'])} fallbacks")
            if r.get("compile_skipped_frames"):
                # A compiled frame run eagerly changes what the row measures: name it.
                frames = (re.sub(r"\(.*/", "(", f) for f in r["compile_skipped_frames"])
                notes.append("run eagerly by dynamo: " + ", ".join(frames).replace("|", "/"))
            if r.get("profile_error"):
                notes.append(f"profile failed: {r['profile_error'][:120]}".replace("|", "/"))
            lines.append(
                f"| {r['config']} | {r['variant']} | {r['step_ms_median']:.2f} [{r['step_ms_p10']:.2f}, "
                f"{r['step_ms_p90']:.2f}] | {r['samples_per_s']:,.0f} | {fmt_x(r.get('speedup_vs_bf16'))} | "
                f"{fmt_x(r.get('speedup_vs_same_settings'))}, {fmt_x(r.get('speedup_vs_same_settings_mean'))} | "
                f"{r['eval_ne']:.5f} | {_ne_delta_cell(r)} | {_fp8_cell(r)} | "
                f"{'; '.join(notes)} |"
            )
        noise = [r for r in rows if r["variant"].startswith("bf16+") and "ne_delta_rel_vs_bf16" in r
                 and r.get("status") == "ok"]
        if noise:
            lines += ["", "NE noise floor (bf16 variants vs bf16, same numerics up to kernel order): "
                      + ", ".join(f"{r['config']} {r['variant']} {_ne_delta_cell(r)}" for r in noise)]
        high = [r for r in rows if "ne_delta_rel_forwards_high_vs_bf16" in r]
        if high:
            lines += ["", "NE vs bf16 with each LoKA run's FP8 forwards evaluated in high precision (its "
                      "training unchanged: what is left is what FP8 changed in training, within the noise "
                      "floor above): "
                      + ", ".join(f"{r['config']} {r['variant']} {fmt_pct(r['ne_delta_rel_forwards_high_vs_bf16'], 3)} "
                                  f"(as run {_ne_delta_cell(r)})" for r in high)]
        profiled = [r for r in rows if "profile" in r]
        if profiled:
            lines += [
                "",
                "### Where the GPU time goes (profiled steps)",
                "",
                "| config | variant | kernel ms/step | busy | GEMM | FP8 quant | embedding | copies | other (elementwise, norm, ...) | FP8 ceiling | top kernels |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in profiled:
                p = r["profile"]
                cats = p["categories"]
                ceiling = fp8_ceiling(r)
                top = "; ".join(f"{k['name'][:48]} ({k['category']}, {k['ms_per_step']:.2f})" for k in p["top_kernels"][:3])
                lines.append(
                    f"| {r['config']} | {r['variant']} | {p['kernel_ms_per_step']:.2f} | {p['busy_fraction']:.0%} | "
                    + " | ".join(f"{cats[c]['share']:.0%}" for c in ("gemm", "quantize", "embedding", "memcpy", "other"))
                    + f" | {'-' if ceiling is None else fmt_x(ceiling)} | {top.replace('|', '/')} |"
                )
            for r in profiled:
                p = r["profile"]
                if p.get("sampled_steps"):
                    lines += ["", f"**{r['config']} {r['variant']}: {p['sampled_steps']} of the {p['steps']} profiled "
                              f"steps (from step {p.get('first_step', '?')}) are the Probe's sampled steps**: its "
                              "table adds their samples (and the requested modules' unreplayed code) to the "
                              "steady steps' kernels."]
            lines += ["", "busy = merged kernel time per step / median step time of the timed (unprofiled) "
                      "steps; shares are of the summed kernel time. FP8 ceiling (high-precision runs) = the "
                      f"speed-up if every GEMM ran {FP8_GEMM_PEAK:g}x faster (FP8 peak) with free quantization "
                      f"and nothing else changed: step / (step - GEMM ms x {1 - 1 / FP8_GEMM_PEAK:g}); a target above it needs more "
                      "than FP8 GEMMs."]
            lines += _gpu_time_delta_section(profiled)
            lines += _unaligned_gemms_section(profiled)
            lines += _kernel_calls_section(profiled)
            lines += ["", "### Where the host time goes (profiled steps)", "",
                      "| config | variant | aten calls/step | self CPU ms/step | GPU sync wait ms/step | top host ops (self CPU ms/step, calls/step) |",
                      "|---|---|---|---|---|---|"]
            for r in profiled:
                p = r["profile"]
                if "top_host_ops" not in p:
                    continue
                top = "; ".join(f"{o['name'][:40]} ({o['self_cpu_ms_per_step']:.2f}, {o['calls_per_step']:.0f})"
                                for o in p["top_host_ops"][:6])
                lines.append(f"| {r['config']} | {r['variant']} | {p['host_aten_calls_per_step']:.0f} | "
                             f"{p['host_self_cpu_ms_per_step']:.2f} | {p.get('host_sync_wait_ms_per_step', 0.0):.2f} | "
                             f"{top.replace('|', '/')} |")
        lines += _ledger_section(rows)
        lines += _memory_section(rows, isolated=bool(data["args"].get("isolate")))
        everywhere = [r for r in rows if r["variant"].startswith("fp8_everywhere") and "loka" in r]
        for r in everywhere:
            lk = r["loka"]
            lines += ["", f"FP8 everywhere, {r['config']}: {lk['num_fp8_gemms']}/{lk['num_gemms']} site GEMMs in FP8."]
            lines += [f"- not FP8: {h}" for h in lk["high_gemms"]]
            lines += [f"- at conversion: {f}" for f in lk["mods_fallbacks"]]
            lines += [f"- not a site: {k}: {v}" for k, v in lk["not_sites"].items()]
        for issue, title in ((26, "Targets of issue 26 (against bf16 with the same settings)"),
                             (9, "Targets of issue 9 (against eager bf16)")):
            targets = [t for t in data["targets"] if t["batch"] == batch and t.get("issue", 9) == issue]
            if targets:
                lines += ["", f"### {title}", ""]
                for t in targets:
                    lines.append(f"- **{t['status']}** [{t['variant']}] {t['target']}: {t['detail']}")
    if data.get("ne_bases"):
        lines += ["", "## Shared checkpoints (`--ne-from`)", "",
                  "| config | batch | seed | trained by | steps | eval NE there | s |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {b['config']} | {b['batch']} | {b['seed']} | {b['variant']} | {b['steps']} | "
                  f"{b['eval_ne']:.5f} | {b['wall_s']:.1f} |" for b in data["ne_bases"]]
    lines += _slow_steps_section(data)
    in_order = [r for r in (data.get("runs") or data["results"]) if "gc_ms_per_step" in r]
    if in_order:
        lines += ["", "## Runs in the order they ran (drift diagnostics)", "",
                  "| # | config | batch | variant | seed | step ms median [p10] | GC ms/step | GPU reserved GB | host RSS GB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(sorted(in_order, key=lambda r: r.get("started_unix", 0.0)), 1):
            lines.append(f"| {i} | {r['config']} | {r['batch']} | {r['variant']} | {r['seed']} | "
                         f"{r['step_ms_median']:.2f} [{r['step_ms_p10']:.2f}] | {r['gc_ms_per_step']:.3f} | "
                         f"{r['gpu_reserved_gb']:.1f} | {r['host_rss_gb']:.1f} |")
    errors = [r for r in data["results"] if r["status"] == "error"]
    if errors:
        lines += ["", "## Errors", ""]
        for r in errors:
            lines += [f"### {r['config']} b{r['batch']} {r['variant']}", "", "```", r.get("traceback", r["error"]).rstrip(), "```"]
    (out / "e2e.md").write_text("\n".join(lines) + "\n")


LEDGER_ROWS = 8
"""Largest GEMMs of each ledger shown in the report (all of them are in the JSON)."""

_DELTA_CATEGORIES = ("gemm", "quantize", "embedding", "memcpy", "other")


def _gpu_time_delta_section(profiled: list[dict[str, Any]]) -> list[str]:
    """Each profiled variant's kernel time a step by category minus that of its profiled bf16
    with the same settings (same config and batch): where its step gains and what takes it
    back. Empty when no such pair was profiled."""
    by_key = {(r["config"], r.get("batch"), r["variant"]): r for r in profiled}
    out = []
    for r in profiled:
        ref = same_settings_reference(r["variant"])
        b = by_key.get((r["config"], r.get("batch"), ref))
        if b is None or b is r:
            continue
        rc, bc = r["profile"]["categories"], b["profile"]["categories"]
        d = {c: rc[c]["ms_per_step"] - bc[c]["ms_per_step"] for c in _DELTA_CATEGORIES}
        saved = -d["gemm"]
        takes_back = f"{d['quantize'] / saved:.2f}" if saved > 0 else "-"
        out.append(
            f"| {r['config']} | {r['variant']} | {ref} | "
            + " | ".join(f"{d[c]:+.2f}" for c in _DELTA_CATEGORIES)
            + f" | {r['profile']['kernel_ms_per_step'] - b['profile']['kernel_ms_per_step']:+.2f}"
            + f" | {r['step_ms_median'] - b['step_ms_median']:+.2f} | {takes_back} |"
        )
    if not out:
        return []
    return ["", "Against bf16 with the same settings (kernel ms a step of the profiled steps, this variant "
            "minus bf16; quantize / GEMM saved: how much of what the GEMMs save the quantization kernels "
            "take back):", "",
            "| config | variant | against | GEMM | FP8 quant | embedding | copies | other | kernels | median step | quantize / GEMM saved |",
            "|---|---|---|---|---|---|---|---|---|---|---|", *out]


def _unattributed_line(r: dict[str, Any], ledger: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """What the ledger does not account for: the LoKA step with its FP8 savings added back
    (the ledger's all-high step) against the measured step of bf16 with the same settings."""
    high_step = (ledger.get("prediction") or {}).get("high_step_ms")
    base = next((b for b in rows if b["config"] == r["config"] and b.get("batch") == r.get("batch")
                 and b["variant"] == same_settings_reference(r["variant"]) and b.get("status") == "ok"), None)
    if not high_step or base is None or not math.isfinite(base.get("step_ms_median", math.nan)):
        return []
    gap = high_step - base["step_ms_median"]
    reconcile = ""
    profile = base.get("profile") or {}
    high_gemms = (ledger.get("totals") or {}).get("high_ms")
    if high_gemms and "gemm" in (profile.get("categories") or {}):
        bf16_gemms = profile["categories"]["gemm"]["ms_per_step"]
        reconcile = (f" Of that, {high_gemms - bf16_gemms:+.2f} ms is the ledger's high-precision GEMM times "
                     f"({high_gemms:.2f} ms a step) against the GEMM kernels of {base['variant']}'s profiled "
                     f"steps ({bf16_gemms:.2f} ms).")
    return ["", f"Against {base['variant']} ({base['step_ms_median']:.2f} ms, same run): LoKA's step with the "
            f"ledger's FP8 savings added back is {high_step:.2f} ms, so **{gap:+.2f} ms a step** is spent "
            "outside what the ledger times (work LoKA adds around its GEMMs, or GEMMs the compiled bf16 "
            "step runs faster than the ledger's high-precision times): LoKA runs at "
            f"{fmt_x(base['step_ms_median'] / r['step_ms_median'])} of bf16's speed where the ledger "
            f"predicts {fmt_x(high_step / r['step_ms_median'])}.{reconcile}"]


def _ledger_section(rows: list[dict[str, Any]]) -> list[str]:
    """The per-GEMM ledger of each LoKA run that measured one (``--ledger``): its largest GEMMs
    and the step speed-ups it predicts against the same run's measured step."""
    out: list[str] = []
    for r in rows:
        ledger = (r.get("loka") or {}).get("ledger")
        if not ledger:
            continue
        t = ledger["totals"]
        p = ledger.get("prediction") or {}
        out += [
            "", f"### Per-GEMM ledger: {r['config']} {r['variant']} ({ledger['timing']} on {ledger['device']})", "",
            f"High-precision GEMMs {t['high_ms']:.3f} ms a step; FP8 saves {t['saved_as_planned_ms']:.3f} ms "
            f"as planned, {t['saved_best_ms']:.3f} ms at best with quantization paid, "
            f"{t['saved_ceiling_ms']:.3f} ms with quantization free."
            + (f" Predicted over an all-high step of {p['high_step_ms']:.2f} ms: as planned "
               f"{fmt_x(p['as_planned'])}, best as paid {fmt_x(p['best_as_paid'])}, quantization free "
               f"{fmt_x(p['quant_free'])}." if p else ""),
            *_unattributed_line(r, ledger, rows),
            "",
            "| site | GEMM | M x K x N | plan | high ms | FP8 GEMM ms | quant ms | FP8 total ms | quant / saved "
            "| speed-up as paid | Dispatch's speed-up |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for d in sorted(ledger["rows"], key=lambda x: -x["high_ms"])[:LEDGER_ROWS]:
            row = LedgerRow.from_dict(d)
            f = row.shown
            if f is not None:
                cells = (f"{f.gemm_ms:.3f} | {row.quant_paid_ms(f):.3f} | {f.total_ms:.3f} | "
                         f"{row.quant_over_saved:.2f} | "
                         f"{fmt_x(row.speedup_as_paid(f))}")
            else:
                cells = "- | - | - | - | -"
            cells += f" | {'-' if row.planned_speedup is None else fmt_x(row.planned_speedup)}"
            relu = f" (+{row.relu_ms:.3f} ReLU)" if row.relu_ms else ""
            out.append(f"| {row.site} | {row.role} | {'x'.join(map(str, row.shape))} | {row.plan} | "
                       f"{row.high_ms:.3f}{relu} | {cells} |")
        out += ["", "high ms: the GEMM (and the ReLU pass high precision runs before it, where the site folds "
                "one); quant ms: what quantizing costs the step under the plan shown, its casts and "
                "transposed writes and a ReLU pass it runs, less the one high precision runs (below 0 where "
                "a cast that applies the ReLU costs less than that pass); quant / saved: of the candidate "
                "with the fastest GEMM alone, which may not be the plan shown."]
        if ledger.get("sites"):
            out += ["", *site_table(ledger["sites"])]
    return out


def _memory_section(rows: list[dict[str, Any]], *, isolated: bool) -> list[str]:
    """Peak GPU memory of each run (reset before it), against bf16 with the same settings."""
    with_peaks = [r for r in rows if r["status"] == "ok" and math.isfinite(r.get("gpu_peak_reserved_gb", math.nan))]
    if not with_peaks:
        return []
    base = {(r["config"], r["variant"]): r for r in with_peaks if r["variant"].startswith("bf16")}
    where = "each run in its own process" if isolated else "variants share one process"
    out = ["", f"### Peak GPU memory (per run, reset before it; {where})", "",
           "| config | variant | allocated before the run GB | peak allocated GB | peak reserved GB "
           "| reserved vs bf16 same settings "
           "| unsampled steps: median ms, peak allocated GB | sampled steps: median ms, peak allocated GB |",
           "|---|---|---|---|---|---|---|---|"]
    for r in with_peaks:
        b = base.get((r["config"], same_settings_reference(r["variant"])))
        ratio = fmt_x(r["gpu_peak_reserved_gb"] / b["gpu_peak_reserved_gb"]) if b else "-"
        before = r.get("gpu_allocated_before_gb")
        before_cell = "-" if before is None else f"{before:.2f}"
        out.append(f"| {r['config']} | {r['variant']} | {before_cell} | {r['gpu_peak_allocated_gb']:.2f} | "
                   f"{r['gpu_peak_reserved_gb']:.2f} | {ratio} | {_by_sampling_cell(r, 'unsampled')} | "
                   f"{_by_sampling_cell(r, 'sampled')} |")
    out += ["", "Sampled steps are those on which a callback requested dense modules outside the graphs (the "
            "LoKA Probe's samples); the peaks per kind of step are within the step (the allocator's peak is reset at "
            "every step end). Every peak includes what was allocated before the run: what earlier runs "
            "of the process (other variants, a LoKA variant's decision run) left, with the data; "
            "`--isolate` runs each variant in a fresh process."]
    traced = [r for r in with_peaks if r.get("memory_peak")]
    if traced:
        out += ["", "#### What is allocated at the peak (`--memory-trace`; its runs' times are not speed figures)", ""]
        for r in traced:
            out += memory_owners_md(f"{r['config']} b{r['batch']} {r['variant']}", r["memory_peak"])
    return out


def _by_sampling_cell(r: dict[str, Any], kind: str) -> str:
    """``n`` steps: median ms, peak allocated GB over the steps of ``kind`` (see ``StepClock``)."""
    split = r.get("by_sampling") or {}
    n = split.get(f"steps_{kind}", 0)
    if not n:
        return "-"
    return (f"{n} steps: {split[f'step_ms_median_{kind}']:.2f} ms, "
            f"{split[f'peak_allocated_gb_{kind}']:.2f} GB")


def _ne_delta_cell(r: dict[str, Any]) -> str:
    """NE vs bf16: the relative delta, with its seed-paired standard error when there is one."""
    se = r.get("ne_delta_rel_se_vs_bf16")
    return fmt_pct(r.get("ne_delta_rel_vs_bf16"), 3) + (f" ± {100 * se:.4f}%" if se is not None else "")


SLOW_STEP = 1.5
"""``--step-diag``'s report lists the timed steps slower than this many times their run's median."""


def _slow_steps_section(data: dict[str, Any]) -> list[str]:
    """``--step-diag``: each run's slow steps with their host time and allocator calls."""
    rows = []
    for r in data.get("runs") or data["results"]:
        if not r.get("step_diag"):
            continue
        med = r["step_ms_median"]
        host_med = statistics.median(d["host_ms"] for d in r["step_diag"])
        slow = [(i, t, d) for i, (t, d) in enumerate(zip(r["step_ms"], r["step_diag"])) if t > SLOW_STEP * med]
        excess = sum(t - med for _, t, _ in slow)
        cells = "; ".join(
            f"{r['first_timed_step'] + i}: {t:.0f} ms (host {d['host_ms']:.0f}"
            + (f", {d['cuda_malloc']} cudaMalloc" if d["cuda_malloc"] else "")
            + (f", {d['cuda_free']} cudaFree" if d["cuda_free"] else "")
            + (f", {d['alloc_retries']} retries" if d["alloc_retries"] else "") + ")"
            for i, t, d in slow[:24]
        ) + (f"; ... {len(slow) - 24} more" if len(slow) > 24 else "")
        mallocs = sum(d["cuda_malloc"] + d["cuda_free"] for d in r["step_diag"])
        rows.append(f"| {r['config']} | {r['batch']} | {r['variant']} | {r['seed']} | {med:.2f} | {host_med:.2f} | "
                    f"{len(slow)} | {excess / len(r['step_ms']):.2f} | {mallocs} | {cells or '-'} |")
    if not rows:
        return []
    return ["", f"## Slow steps (`--step-diag`: timed steps > {SLOW_STEP}x their run's median)", "",
            "| config | batch | variant | seed | median ms | host median ms | slow steps | their excess ms/step "
            "| cudaMalloc+cudaFree in the timed steps | step: GPU time (host time, allocator calls) |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows]


def render(directory: Path) -> None:
    """Rewrite `directory`/e2e.md from its e2e.json (ratios and targets recomputed), e.g. after
    the report gained a column."""
    path = directory / "e2e.json"
    if not path.is_file():
        raise SystemExit(f"--render: no {path}; point it at a directory an e2e run wrote")
    data = json.loads(path.read_text())
    add_ratios(data["results"])
    args = data["args"]
    data["targets"] = all_targets(data["results"], args["config_names"], args["batch_sizes"],
                                  ne_measured=ne_measured(args), isolated=bool(args.get("isolate")))
    write_report(directory, data)



def report_data(
    args: argparse.Namespace, *, command: str, env: dict[str, Any], variants: list[Variant], runs: Runs,
    t0: float,
) -> dict[str, Any]:
    """The report (what ``e2e.json`` holds) from the runs so far, ratios and targets recomputed.

    Args:
        args: the parsed command line (``bench.e2e.cli.parse_args``).
        command: the command line that ran the benchmark.
        env: the machine and versions (:func:`environment`).
        variants: the variants of the benchmark.
        runs: the runs so far (their aggregated records get their ratios here).
        t0: the benchmark's start (``time.perf_counter()``), for its wall time.
    """
    add_ratios(runs.results)
    configs, data = (DRY_CONFIGS, DRY_DATA) if args.dry_run else (CONFIGS, DATA)
    return {
        "command": command,
        "environment": env,
        "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items() if k != "out"},
        "configs": {c: list(configs[c]) + list(data) for c in args.config_names},
        "variants": {v.name: {"description": v.description, "loka": v.loka,
                              "loka_overrides": list(v.loka_overrides), "compile": v.compile,
                              "graphs": v.graphs, "torchao": v.torchao, "decide": v.decide,
                              "pageable": v.pageable, "replay_sampled": v.replay_sampled,
                              "compile_sampled": v.sampled_compiled}
                    for v in variants},
        "results": runs.results,
        "runs": runs.raw,
        "ne_bases": runs.bases,
        "warm_runs": runs.warm_runs,
        "targets": all_targets(runs.results, args.config_names, args.batch_sizes,
                               ne_measured=ne_measured(vars(args)), isolated=bool(args.isolate)),
        "wall_s": time.perf_counter() - t0,
        "pinned_batches": args.device == "cuda",
    }


def _unaligned_gemms_section(profiled: list[dict[str, Any]]) -> list[str]:
    """The GEMM kernels of each profiled variant that cuBLAS picks where an operand's dimension
    or address is not 16-byte aligned (``align1`` / ``align2`` in their names), among its largest
    kernels: they run several times slower than the aligned ones, and a compiled bf16 step takes
    them on some machines and not on others, which moves the reference of every ratio."""
    lines = []
    for r in profiled:
        slow = [k for k in r["profile"]["top_kernels"]
                if k.get("category") == "gemm" and ("align1" in k["name"] or "align2" in k["name"])]
        if slow:
            ms = sum(k["ms_per_step"] for k in slow)
            calls = sum(k.get("calls_per_step", 0) for k in slow)
            lines.append(f"- {r['config']} {r['variant']}: {ms:.2f} ms a step in {len(slow)} kernel(s), "
                         f"{calls:g} launches")
    if not lines:
        return []
    return ["", "Unaligned GEMM kernels (cuBLAS `align1` / `align2`, among the largest kernels):", "", *lines]


def _kernel_calls_section(profiled: list[dict[str, Any]]) -> list[str]:
    """The profiled variants' largest kernels with their launches: how many a step and how long
    the longest took (the shapes a kernel's time comes from)."""
    rows = [(r, k) for r in profiled for k in r["profile"]["top_kernels"] if "calls_per_step" in k]
    if not rows:
        return []
    lines = ["", "Largest kernels and their launches (profiled steps; the longest launches first, us):", "",
             "| config | variant | kernel | ms/step | launches/step | longest launches us |", "|---|---|---|---|---|---|"]
    for r, k in rows:
        longest = ", ".join(f"{d:g}" for d in k["us_per_call"][:12])
        lines.append(f"| {r['config']} | {r['variant']} | {k['name'][:60].replace('|', '/')} | "
                     f"{k['ms_per_step']:.3f} | {k['calls_per_step']:g} | {longest} |")
    return lines
