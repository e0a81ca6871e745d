"""launch/train.py's logging: a table that library code logs (``extra=TABLE``: the LoKA plan,
the ledger) is printed to stdout as it is, with no level or logger prefix, also under tqdm's
console redirect, and lands in the run's log like any record."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from tqdm.contrib.logging import logging_redirect_tqdm

import launch.train as train
from loka_train.utils.console import TABLE


@pytest.fixture
def root_logging() -> Iterator[None]:
    """configure_logging replaces the root logger's handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    library_level = logging.getLogger("loka_train").level
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.getLogger("loka_train").setLevel(library_level)


@pytest.mark.parametrize("redirect", [False, True])
def test_a_logged_table_prints_bare_to_stdout_and_lands_in_the_run_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], root_logging: None, redirect: bool
) -> None:
    log = train.configure_logging(rank=0)
    log.open(tmp_path, "train", append=False)
    logger = logging.getLogger("loka_train.plugin.callback")
    if redirect:  # as run_job runs under launch/train.py
        with logging_redirect_tqdm():
            logger.info("\nLoKA plan\n%s", "| site | plan |", extra=TABLE)
    else:
        logger.info("\nLoKA plan\n%s", "| site | plan |", extra=TABLE)
    logger.info("an ordinary message")
    log.close()
    out, err = capsys.readouterr()
    assert out == "\nLoKA plan\n| site | plan |\n"  # the message alone, as print() writes it
    assert "LoKA plan" not in err and "[rank0] INFO loka_train.plugin.callback: an ordinary message" in err
    written = (tmp_path / "train.log").read_text()
    assert "LoKA plan\n| site | plan |" in written and "an ordinary message" in written
