"""Export a trained run for inference: `python launch/export.py run=<run directory> [overrides]`.

Composes conf/export.yaml (``loka_train.export.ExportConfig``) and the run's own config
(``<run directory>/config.yaml``, checked against ``JobConfig``), then runs
``loka_train.export.export_run``: the run's model and plans from its checkpoint, served, evaluated
next to the same weights in high precision, its numerics per site, written to
``<run directory>/export/step_<N>/`` (or ``out=``). A failure prints one ``error: ...`` line
naming the fix and exits 2 (a config or checkpoint error) or 1.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loka_train.export.config import ExportConfig
from loka_train.export.run import export_run
from loka_train.job import JobConfig
from loka_train.runtime.checkpoint import CheckpointError
from loka_train.runtime.rundirs import find_checkpoint

ConfigStore.instance().store(name="export_schema", node=ExportConfig)

USER_ERRORS = (ValueError, FileNotFoundError, CheckpointError)


def run_config(run: str) -> JobConfig:
    """The JobConfig of the run whose checkpoint `run` means (its ``config.yaml``, or the
    ``config.resumed_<step>.yaml`` it resumed with before that checkpoint)."""
    checkpoint = find_checkpoint(Path(run))
    if checkpoint is None:
        raise CheckpointError(
            f"run={run}: no checkpoint there; give a run directory (runs/<run>) whose training saved "
            "one (trainer.checkpoint_at_end or trainer.checkpoint_every), or its checkpoints/step_* directory"
        )
    path = _config_of(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the export rebuilds the model from the run's own config")
    try:
        job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.load(path)))
    except OmegaConfBaseException as exc:
        raise ValueError(
            f"{path} does not fit this loka_train's JobConfig ({str(exc).splitlines()[0]}): the run was "
            "trained by another version; export it with that version, or edit that key in a copy of the run"
        ) from exc
    assert isinstance(job, JobConfig)
    return job


def _config_of(checkpoint: Path) -> Path:
    """The config the run had when it wrote `checkpoint`: the newest ``config.resumed_<step>.yaml``
    (launch/train.py writes one when a resumed run changed settings) at or before its step,
    else ``config.yaml``."""
    run = checkpoint.parent.parent
    step = int(checkpoint.name.rsplit("_", 1)[-1])
    resumed = sorted(
        (int(p.stem.rsplit("_", 1)[-1]), p) for p in run.glob("config.resumed_*.yaml")
        if p.stem.rsplit("_", 1)[-1].isdigit()
    )
    earlier = [p for s, p in resumed if s <= step]
    return earlier[-1] if earlier else run / "config.yaml"


def _tables(summary: dict) -> str:
    tables = summary["serve"].get("embeddings", "trained")
    return "" if tables == "trained" else f", {tables} tables in TorchRec's inference modules"


def report(summary: dict) -> str:
    """The export's summary as lines for the console."""
    m = summary["metrics"]
    lines = [
        f"export of {summary['checkpoint']} (step {summary['step']}) -> {summary['out']}",
        f"  served ({summary['serve']['dtype']}{_tables(summary)}): NE {m['served']['ne']:.5f}, AUC {m['served']['auc']:.4f}; "
        f"same weights in high precision: NE {m['high']['ne']:.5f}, AUC {m['high']['auc']:.4f} "
        f"({summary['ne_delta_rel_vs_high']:+.4%} NE) on {summary['eval_samples']} held-out samples",
    ]
    fp8 = [name for name, how in summary["sites"].items() if how.startswith("fp8")]
    lines.append(f"  {len(fp8)} of {len(summary['sites'])} sites serve an FP8 forward; per site: numerics.md")
    if summary.get("decide_batch") is not None:
        decisions = summary.get("decisions", [])
        changed = sum(d["chosen"] != d["trained"] for d in decisions)
        lines.append(f"  plans re-decided for batch {summary['decide_batch']}: {changed} of {len(decisions)} timed "
                     "forwards changed from the trained plan; table: decisions.md")
    gate = summary["ne_gate"]
    if gate:
        moved = [f"{st['moved']} to {st.get('to', 'high')}" for st in gate[1:] if st["moved"]]
        failed = sum(len(st.get("failed", {})) for st in gate)
        held = (f"{len(moved)} FP8 forward(s) moved to hold it ({', '.join(moved)})" if moved
                else "within it as served" if gate[0]["ne_delta"] <= summary["ne_budget"] else "no FP8 forward moved")
        over = "" if gate[-1]["ne_delta"] <= summary["ne_budget"] else (
            " (over the budget: " + ("no FP8 forward left" if gate[-1]["fp8_forwards"] == 0 else
                                     "no move of the FP8 forwards left lowers it") + ")")
        lines.append(f"  NE budget {summary['ne_budget']:.4%}: {held}, NE {gate[-1]['ne_delta']:+.4%} of high "
                     f"precision's on the gate's own held-out batches{over}"
                     + (f"; {failed} row-wise move(s) failed and were left out" if failed else "") + "; table: gate.md")
    if summary.get("programs"):
        lines.append(f"  torch.export programs of the dense towers (any batch size): {len(summary['programs'])} in dense/")
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        export = OmegaConf.to_object(cfg)
        assert isinstance(export, ExportConfig)
        summary = export_run(run_config(export.run), export)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(report(summary), flush=True)


if __name__ == "__main__":
    main()
