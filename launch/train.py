"""Main job entry point: `torchrun ... launch/train.py [hydra overrides]`.

The only module that imports hydra. The YAML under conf/ is validated against the
dataclass schemas (a misspelled key fails composition, naming the nearest valid keys) and
turned into real dataclasses with `OmegaConf.to_object` before anything runs.

A failure prints one message, on rank 0 (``error: ...``, naming the setting or file and the
fix), and exits non-zero: 2 for a config, data or checkpoint error, 1 for anything else. The
traceback goes to the run's log, ``<run directory>/train.log`` (rank k > 0:
``train.rank<k>.log``), or to ``<trainer.out_dir>/error.log`` when the run failed before its
directory was made. ``launch/torchrun.py`` (what scripts/train.sh runs) starts the processes
as torchrun does, without torchrun's own failure report.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from loka_train.job import JobConfig, run_job
from loka_train.runtime.callbacks import Callback
from loka_train.runtime.checkpoint import CheckpointError
from loka_train.utils.config_keys import unknown_key_message
from loka_train.utils.console import is_table

ConfigStore.instance().store(name="job_schema", node=JobConfig)

logger = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
USER_ERRORS = (ValueError, FileNotFoundError, CheckpointError)
"""Errors of the config, the data or a checkpoint: their message names the fix (exit code 2)."""
WAIT_FOR_RANK_0_S = 5.0
"""How long a rank other than 0 holds its report of an error that rank 0 reports too (torchrun
stops it once rank 0 has exited); a rank that is still running after it prints its own."""


# ------------------------------------------------------------------------------ config errors
def config_error(overrides: list[str]) -> str | None:
    """None when the config composes with `overrides`, else one message that names the key (and
    the nearest valid ones) or the preset (and the valid ones)."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name="config", overrides=overrides)
        return None
    except Exception as exc:  # every composition error is the user's to fix
        return _explain(exc, overrides)


def _explain(exc: Exception, overrides: list[str]) -> str:
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        parsed = []
    groups = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in CONF_DIR.iterdir() if d.is_dir()}
    for override in parsed:
        key = override.key_or_group
        if override.is_add() or override.is_delete() or override.is_force_add() or key.startswith("hydra"):
            continue
        value = override.value()
        if key in groups and isinstance(value, str):
            if value not in groups[key]:
                close = difflib.get_close_matches(value, groups[key], n=1)
                hint = f"did you mean {key}={close[0]}? " if close else ""
                return f"{key}={value} is not a preset: {hint}the presets of {key} are {', '.join(groups[key])}"
            continue
        message = unknown_key_message(JobConfig, key)
        if message is not None:
            return message
    lines = [line for line in str(exc).splitlines() if line.strip()]
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        lines[0] = f"{lines[0]}: {str(cause).strip().splitlines()[0]}"
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ logging
class LogFile(logging.Handler):
    """This process's log file: records are held until the run's directory exists, then written
    to a file there (:meth:`open`), or to ``error.log`` beside the runs if the job fails first."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.path: Path | None = None
        self._held: list[logging.LogRecord] = []
        self._file: logging.FileHandler | None = None
        self.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"))

    def open(self, directory: Path, stem: str, *, append: bool) -> Path:
        """Write to ``<directory>/<stem>.log`` (rank k > 0: ``<stem>.rank<k>.log``, made only
        when it logs something), after an earlier attempt's lines with `append`; returns the path."""
        self.path = directory / (f"{stem}.log" if self.rank == 0 else f"{stem}.rank{self.rank}.log")
        self._file = logging.FileHandler(self.path, mode="a" if append else "w", encoding="utf-8", delay=True)
        self._file.setFormatter(self.formatter)
        for record in self._held:
            self._file.handle(record)
        self._held.clear()
        return self.path

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is None:
            self._held.append(record)
        else:
            self._file.handle(record)

    def write_failure(self, exc: BaseException, out_dir: str | None) -> Path | None:
        """Log `exc` with its traceback to the file only (never the console); returns the file."""
        if self._file is None:
            if out_dir is None:
                return None
            try:
                Path(out_dir).mkdir(parents=True, exist_ok=True)
                self.open(Path(out_dir), "error", append=False)
            except OSError:
                return None
        record = logging.LogRecord(__name__, logging.ERROR, __file__, 0, "the job failed", None,
                                   (type(exc), exc, exc.__traceback__))
        self.emit(record)
        self.close()
        return self.path

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


class RunLog(Callback):
    """Opens the log file in the run's directory once it exists and writes the composed config
    there (rank 0: ``config.yaml``).

    A continued run (``trainer.resume=auto`` into the same directory) keeps the run's first
    ``config.yaml``; when its own config differs (more ``trainer.steps``, say), it is written
    next to it as ``config.resumed_<step>.yaml`` and the changed settings are logged.
    """

    def __init__(self, log: LogFile, config_yaml: str) -> None:
        self.log = log
        self.config_yaml = config_yaml
        self._first_yaml: str | None = None
        """The run's config.yaml as an earlier attempt wrote it (a continued run), else None."""

    def on_before_shard(self, trainer: Any) -> None:
        self.log.open(trainer.out_dir, "train", append=True)  # a continued run: after its earlier lines
        if trainer.rank == 0:
            first = trainer.out_dir / "config.yaml"
            if first.exists():
                self._first_yaml = first.read_text()
            else:
                first.write_text(self.config_yaml)

    def on_train_start(self, trainer: Any) -> None:
        # Here, not in on_before_shard: the step the run continues from is known once resumed.
        if trainer.rank != 0 or self._first_yaml is None or self._first_yaml == self.config_yaml:
            return
        path = trainer.out_dir / f"config.resumed_{trainer.step:08d}.yaml"
        path.write_text(self.config_yaml)
        changed = changed_settings(self._first_yaml, self.config_yaml)
        logger.warning(
            "continuing the run at step %d with changed settings: %s; the run's first config stays in "
            "config.yaml, this one is %s", trainer.step, ", ".join(changed) or "(formatting only)", path,
        )


def changed_settings(before_yaml: str, after_yaml: str) -> list[str]:
    """The settings that differ between two composed configs, as ``key: before -> after``."""

    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(node, dict):
            return {prefix: node}
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out

    before = flat(OmegaConf.to_container(OmegaConf.create(before_yaml)))
    after = flat(OmegaConf.to_container(OmegaConf.create(after_yaml)))

    def shown(values: dict[str, Any], key: str) -> str:
        return repr(values[key]) if key in values else "(unset)"

    return [
        f"{key}: {shown(before, key)} -> {shown(after, key)}"
        for key in sorted(set(before) | set(after))
        if key not in before or key not in after or before[key] != after[key]
    ]


class ConsoleTables(logging.Handler):
    """Prints the tables that library code logs (``extra=loka_train.utils.console.TABLE``: the
    LoKA plan, the ledger) to stdout as they are, as ``print`` would. Not a StreamHandler, so
    tqdm's console redirect (`logging_redirect_tqdm`) leaves it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(is_table)
        self.setFormatter(logging.Formatter("%(message)s"))  # basicConfig would prefix the level

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stdout, flush=True)
        except Exception:
            self.handleError(record)


def configure_logging(rank: int) -> LogFile:
    """Console: our messages at INFO on rank 0, warnings and up otherwise (third-party
    libraries: warnings and up), tables on stdout without a prefix (:class:`ConsoleTables`);
    the same records go to the run's log file."""
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(f"[rank{rank}] %(levelname)s %(name)s: %(message)s"))
    console.addFilter(lambda record: not is_table(record))
    log = LogFile(rank)
    logging.basicConfig(level=logging.WARNING, handlers=[console, ConsoleTables(), log], force=True)
    logging.getLogger("loka_train").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # The planner warns about how a Topology is constructed, torch.fx about what is_fx_tracing
    # means (TorchRec's train pipeline calls it): neither is actionable for users.
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    # Import-time deprecation notices of fbgemm/torchrec say nothing the user can act on.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    return log


# ------------------------------------------------------------------------------------ failure
def fail(exc: Exception, *, rank: int, log: LogFile | None = None, out_dir: str | None = None) -> NoReturn:
    """Report `exc` once and exit: rank 0 prints it; another rank (and a rank whose peer went
    away) waits for rank 0 to report it, printing only if it is still running after
    :data:`WAIT_FOR_RANK_0_S`. The traceback goes to the log file, not the console."""
    user = isinstance(exc, USER_ERRORS)
    if user:
        message = str(exc)
    else:
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        origin = f"at {frame.filename}:{frame.lineno}" if frame else ""
        message = f"{type(exc).__name__}: {exc} ({origin})"
    waits = (user and rank != 0) or isinstance(exc, dist.DistError)
    header = "error" if rank == 0 and not waits else f"error (rank {rank})"
    if not waits:  # before anything else: torchrun stops the other processes once this one exits
        print(f"{header}: {message}", file=sys.stderr, flush=True)
    where = log.write_failure(exc, out_dir) if log is not None else None
    if waits:
        time.sleep(WAIT_FOR_RANK_0_S)
        print(f"{header}: {message}", file=sys.stderr, flush=True)
    if not user and where is not None:
        print(f"  traceback: {where}", file=sys.stderr, flush=True)
    sys.exit(2 if user else 1)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    rank = int(os.environ.get("RANK", "0"))
    log = configure_logging(rank)
    try:
        job = OmegaConf.to_object(cfg)
    except Exception as exc:  # a value the schema's checks refuse
        fail(exc, rank=rank)
    assert isinstance(job, JobConfig)
    try:
        with logging_redirect_tqdm():
            run_job(job, callbacks=[RunLog(log, OmegaConf.to_yaml(cfg))])
    except Exception as exc:
        fail(exc, rank=rank, log=log, out_dir=job.trainer.out_dir)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(arg.startswith("-") for arg in args):  # hydra's own flags (--cfg, --help): its parser
        problem = config_error(args)
        if problem is not None:
            fail(ValueError(problem), rank=int(os.environ.get("RANK", "0")))
    main()
