"""loka_train.dispatch: the per-GEMM plan of every site, chosen from Probe verdicts and speed.

Modules:
    config: ``DispatchConfig`` (what may be chosen and how), ``PlanChange`` (one change, why).
    planning: candidates, targets, hysteresis and restore checks as pure functions of the
        config, the verdicts and the GEMM times.
    timing: ``GemmTimer`` (on-device micro-benchmarks, graphed or not) and ``GpuCostModel``.
    agreement: the collective agreement on GEMM times (the only module here that talks to
        other ranks).
    dispatcher: ``Dispatcher``, the front: sites, plans, re-planning, state, reports.

Example:
    >>> from loka_train.dispatch import DispatchConfig, Dispatcher
    >>> d = Dispatcher(DispatchConfig(objective="coverage"), device="cpu")
    >>> d.register("over_arch.0", plan=LinearPlan.high_precision(),
    ...            shapes={"forward": (256, 64, 32)})
    >>> changes = d.replan(step=99, verdicts=probe.verdicts())
"""

from loka_train.dispatch.config import DispatchConfig, PlanChange
from loka_train.dispatch.dispatcher import Dispatcher
from loka_train.dispatch.timing import GemmTimer, GpuCostModel

__all__ = ["DispatchConfig", "Dispatcher", "GemmTimer", "GpuCostModel", "PlanChange"]
