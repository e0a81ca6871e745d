"""loka_train.probe: online per-site FP8 statistics, cross-rank reduction and verdicts.

Example:
    >>> from loka_train.probe import Probe, ProbeConfig
    >>> probe = Probe(ProbeConfig(every_k_steps=50))
"""

from loka_train.probe.candidates import Candidate
from loka_train.probe.config import ProbeConfig, default_sqnr_budget_db
from loka_train.probe.probe import Probe
from loka_train.probe.verdicts import Verdict, VerdictKey

__all__ = [
    "Candidate",
    "Probe",
    "ProbeConfig",
    "Verdict",
    "VerdictKey",
    "default_sqnr_budget_db",
]
