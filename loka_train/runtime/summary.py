"""The run summary as a short table for the terminal."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["format_summary"]


def format_summary(summary: Mapping[str, Any], extra_rows: Iterable[tuple[str, str]] = ()) -> str:
    """A short human-readable table of a run summary (``Trainer.fit``'s), with `extra_rows`
    (label, value) from plug-ins at the end.

    Example:
        >>> print(format_summary(trainer.fit()))
    """
    rows = [
        ("steps", f"{summary['steps']}"),
        ("ranks x batch", f"{summary['world_size']} x {summary['global_batch'] // summary['world_size']}"),
        ("steps/s", f"{summary['train/steps_per_s']:.2f}"),
        ("train loss", f"{summary['train/loss']:.4f}"),
    ]
    if "eval/ne" in summary:
        rows += [("eval NE", f"{summary['eval/ne']:.4f}"), ("eval AUC", f"{summary['eval/auc']:.4f}"),
                 ("eval calibration", f"{summary['eval/calibration']:.4f}")]
    rows.append(("fallbacks", str(len(summary["fallbacks"]))))
    if summary.get("compiled"):
        rows.append(("compiled", ", ".join(summary["compiled"])))
    if "cuda_graphs" in summary:
        graphs = summary["cuda_graphs"]
        eager = ", ".join(f"{reason} {n}" for reason, n in graphs["eager"].items()) or "none"
        sampled = graphs["requested_replays"]
        rows.append(("CUDA graphs", f"{graphs['replays']} replays"
                                    + (f" (+{sampled} of requested steps)" if sampled else "")
                                    + f", {graphs['captures']} captures; eager calls: {eager}"))
    rows += list(extra_rows)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
