"""Log records that are tables for the terminal (the LoKA plan, the per-GEMM ledger).

Library code logs such a table as one INFO record with ``extra=TABLE``, on the rank that shows
it, so that it lands in the run's log like any record. The launcher (``launch/train.py``) prints
these records to stdout as they are, without a level or logger prefix, as ``print`` would; a
user's own logging set-up shows them as ordinary INFO records.

Example:
    >>> logger.info("\\nLoKA plan\\n%s", table, extra=TABLE)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["TABLE", "is_table"]

_TABLE_ATTR = "loka_console_table"

TABLE: Mapping[str, object] = MappingProxyType({_TABLE_ATTR: True})
"""``extra`` of a log record that is a table for the terminal."""


def is_table(record: logging.LogRecord) -> bool:
    """Whether `record` was logged with ``extra=TABLE`` (a logging filter)."""
    return bool(getattr(record, _TABLE_ATTR, False))
