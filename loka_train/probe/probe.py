"""The Probe: per-site FP8 statistics on a rolling window, reduced across ranks, with verdicts.

:class:`Probe` is the front of the package; each of its jobs lives in its own module:

* :mod:`~loka_train.probe.sampling`: which steps, sites and rows are measured (identical on
  every rank, so window slots line up across ranks);
* :mod:`~loka_train.probe.measurement`: the shadow FP8 measurement of one GEMM on the
  operands' device (no host sync), graphed on CUDA;
* :mod:`~loka_train.probe.window`: the ring buffers, their cross-rank all-reduce (two
  collectives per interval) and the events counted at each reduction;
* :mod:`~loka_train.probe.verdicts`: the pure function from the reduced window to verdicts.

The Probe registers sites, observes GEMMs (directly or through module hooks), runs the
reduction and the verdicts every ``interval`` steps, and reports and checkpoints all of it.
Backend timing is left to Dispatch (the backend registry owns the kernels); the Probe only
measures numerics.

Example:
    >>> import torch
    >>> from loka_train.probe import Probe, ProbeConfig
    >>> probe = Probe(ProbeConfig(every_k_steps=1, interval=4, min_samples=2, window=4))
    >>> probe.register_site("mlp.0", weight_shape=(8, 16))
    >>> w_NK = torch.randn(8, 16)
    >>> for step in range(4):
    ...     probe.begin_step(step)
    ...     probe.observe("mlp.0", "forward", torch.randn(32, 16), w_NK)
    >>> verdicts = probe.reduce()
    >>> sorted({k[1] for k in verdicts})
    ['forward', 'grad_input', 'grad_weight']
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from loka_train.kernels.formats import Fp8Format, Scaling
from loka_train.kernels.roles import ROLES
from loka_train.probe.candidates import ROLE_INDEX, Candidate, candidates_of
from loka_train.probe.config import ProbeConfig
from loka_train.probe.measurement import Measurement, operands_2d
from loka_train.probe.sampling import FullPasses, Sampler, select
from loka_train.probe.verdicts import KeyState, Verdict, VerdictKey, jsonable, judge, unjudged
from loka_train.probe.window import Window
from loka_train.utils import capture

logger = logging.getLogger(__name__)

__all__ = ["Probe"]

_STATE_VERSION = 1
_RESUME_FIX = "resume with the same loka config, or set trainer.resume=never"
"""How to fix a checkpointed Probe state that does not fit this run (load_state_dict errors)."""


class Probe:
    """Online FP8 statistics per site and GEMM, with cross-rank reduction and verdicts.

    Args:
        config: what to measure and how to judge it.
        device: where the statistics buffers live; must be the device of the observed
            tensors (the trainer's device).

    Example:
        >>> probe = Probe(ProbeConfig(every_k_steps=10))
        >>> probe.register_site("top.0", weight_shape=(64, 128))
        >>> probe.should_sample(20, "top.0"), probe.should_sample(21, "top.0")
        (True, False)
    """

    def __init__(self, config: ProbeConfig, *, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Tensors report their index; compare against the concrete device.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.candidates: tuple[Candidate, ...] = candidates_of(config)
        self._sites: list[str] = []
        self._site_index: dict[str, int] = {}
        self._weight_shapes: dict[str, tuple[int, int] | None] = {}
        self._budgets: dict[str, dict[str, float]] = {}
        self._sampler = Sampler(config)
        self._passes = FullPasses()
        """The step's full-operand reads, shared by the roles of a site (:class:`FullPasses`)."""
        self._window = Window(size=config.window, num_candidates=len(self.candidates), device=self.device)
        self._measurement = Measurement(config, self.candidates, self._window.layout, device=self.device)
        # Block and MX tiles span the output features: those candidates see every one.
        tiled = any(s in (Scaling.BLOCK, Scaling.MX) for s in config.scalings)
        self._max_cols = None if tiled else config.max_cols
        self._key_state: dict[VerdictKey, KeyState] = {}
        self._verdicts: dict[VerdictKey, Verdict] = {}
        self.history: list[dict[str, Any]] = []
        """Verdict changes: step, site, role, fmt, scaling, safe, reason."""
        self.series: dict[str, list[tuple[int, float]]] = {}
        """Per ``site/role/candidate``: (step, SQNR low quantile) at every reduction."""
        self.num_reduces = 0
        self.num_verdict_changes = 0
        self.budget_changes: list[tuple[str, str, float, float]] = []
        """``(site, role, saved floor, this run's floor)`` where :meth:`load_state_dict` found the
        checkpoint's SQNR floor differ from the registered one (the registered one holds)."""

    # ------------------------------------------------------------------ registration

    @property
    def sites(self) -> tuple[str, ...]:
        """Registered site names, in registration order."""
        return tuple(self._sites)

    def register_site(
        self,
        name: str,
        *,
        weight_shape: tuple[int, int] | None = None,
        sqnr_budget_db: Mapping[str, float] | None = None,
    ) -> None:
        """Add a site and allocate its window buffers (never on the hot path).

        Args:
            name: unique site name (usually the module's fully qualified name).
            weight_shape: ``(N, K)`` of the weight, checked on every observation when given.
            sqnr_budget_db: per-role overrides of ``config.sqnr_budget_db``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"site name must be a non-empty string, got {name!r}")
        if name in self._site_index:
            raise ValueError(f"site {name!r} is already registered")
        if weight_shape is not None:
            weight_shape = tuple(int(d) for d in weight_shape)  # type: ignore[assignment]
            if len(weight_shape) != 2 or min(weight_shape) <= 0:
                raise ValueError(f"weight_shape must be (N, K) with N, K > 0, got {weight_shape}")
        budgets = dict(self.config.sqnr_budget_db)
        if sqnr_budget_db is not None:
            unknown = set(sqnr_budget_db) - set(ROLES)
            if unknown:
                raise ValueError(f"sqnr_budget_db has unknown roles {sorted(unknown)}; use {ROLES}")
            budgets.update({k: float(v) for k, v in sqnr_budget_db.items()})
        self._site_index[name] = len(self._sites)
        self._sites.append(name)
        self._weight_shapes[name] = weight_shape  # type: ignore[assignment]
        self._budgets[name] = budgets
        self._window.add_site()

    def _index(self, site: str) -> int:
        try:
            return self._site_index[site]
        except KeyError:
            raise ValueError(
                f"unknown site {site!r}; call register_site first (known: {self._sites})"
            ) from None

    # ------------------------------------------------------------------ sampling

    def begin_step(self, step: int) -> None:
        """Set the current training step (call at the start of every step)."""
        self._sampler.begin_step(step)
        self._passes.clear()

    @property
    def step(self) -> int:
        """The current step (see :meth:`begin_step`)."""
        return self._sampler.step

    def should_sample(self, step: int, site: str) -> bool:
        """Whether ``site`` is measured on ``step`` (host-only, identical on every rank)."""
        i = self._index(site)
        return self._sampler.should_sample(step, i, num_sites=len(self._sites))

    def should_reduce(self, step: int) -> bool:
        """Whether the window is reduced (and verdicts updated) after ``step``."""
        return self._sampler.should_reduce(step)

    # ------------------------------------------------------------------ hot path

    def observe(self, site: str, role: str, a: Tensor, b: Tensor, out_ref: Tensor | None = None) -> None:
        """Record the statistics of one GEMM if ``site`` is sampled at the current step.

        Never syncs with the host and never raises on non-finite data (it is counted).

        Args:
            site: a registered site.
            role: ``forward`` (a=x, b=W), ``grad_input`` (a=dY, b=W) or ``grad_weight``
                (a=dY, b=X); see :mod:`~loka_train.probe.measurement` for the contraction axes.
            a: first operand; leading dims are flattened into rows.
            b: second operand.
            out_ref: optional bias-free high-precision GEMM result (saves one fp32 GEMM).
        """
        if not self.should_sample(self.step, site):
            return
        self._record(site, role, a, b, out_ref, self.step)

    def observe_forward(self, site: str, x: Tensor, weight: Tensor, out_ref: Tensor | None = None) -> None:
        """Forward GEMM ``y = x @ weight.T`` (call from a site's forward)."""
        self.observe(site, "forward", x, weight, out_ref)

    def observe_backward(self, site: str, grad_out: Tensor, x: Tensor, weight: Tensor) -> None:
        """Both backward GEMMs from ``dY``, the saved input and the weight (call from a backward hook)."""
        if not self.should_sample(self.step, site):
            return
        self._record(site, "grad_input", grad_out, weight, None, self.step)
        self._record(site, "grad_weight", grad_out, x, None, self.step)

    def attach(self, module: nn.Module, site: str) -> RemovableHandle:
        """Observe a ``y = x @ module.weight.T (+ bias)`` module with hooks.

        Registers the site if needed. On sampled steps the forward hook records the forward
        GEMM and puts a hook on the output's gradient that records both backward GEMMs (at the
        step of the forward). On other steps, and for forwards that do not train (module in
        eval mode or autograd off, as in evaluation), the hook costs one host-side check.

        Returns:
            The forward hook's handle (``.remove()`` detaches the probe).

        Example:
            >>> probe = Probe(ProbeConfig(every_k_steps=1))
            >>> handle = probe.attach(torch.nn.Linear(16, 8), "mlp.0")
        """
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError(f"attach needs a module with a 2-D .weight, got {type(module).__name__}")
        if site not in self._site_index:
            self.register_site(site, weight_shape=tuple(weight.shape))  # type: ignore[arg-type]

        def forward_hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            step = self.step
            # Evaluation forwards (eval mode or no autograd) run between steps with the
            # Probe's step unchanged; they must not take the slots of a sampled step.
            if (
                not args
                or not mod.training
                or not torch.is_grad_enabled()
                or not self.should_sample(step, site)
            ):
                return
            x = args[0]
            w = mod.weight
            assert isinstance(w, Tensor)
            self._record(site, "forward", x, w, None, step)
            if isinstance(output, Tensor) and output.requires_grad:
                x_saved = x.detach()

                def grad_hook(grad_out: Tensor) -> None:
                    self._record(site, "grad_input", grad_out, w, None, step)
                    self._record(site, "grad_weight", grad_out, x_saved, None, step)

                output.register_hook(grad_hook)

        return module.register_forward_hook(forward_hook)

    def _record(
        self, site: str, role: str, a: Tensor, b: Tensor, out_ref: Tensor | None, step: int
    ) -> None:
        idx = self._index(site)
        for t in (a, b):
            if t.device != self.device:
                raise ValueError(
                    f"{site}/{role}: operand on {t.device} but the probe's buffers are on "
                    f"{self.device}; construct Probe(device=...) with the training device"
                )
        a2, b2 = operands_2d(site, role, a, b, weight_shape=self._weight_shapes[site])
        if a2.numel() == 0 or b2.numel() == 0:
            logger.debug("probe: %s/%s step %d has an empty operand; nothing recorded", site, role, step)
            return
        with torch.no_grad(), record_function("loka/probe/observe"):
            # Inside a capture of the sampled module (``trainer.cuda_graphs``): no nested graph,
            # and the sample is written into its window slot after every replay, at the step
            # current then (the measured vectors live at fixed addresses in the capture).
            deferred = capture.deferring()
            # The full operands are read here (counts, peak rows), each once a step outside a
            # capture; the measurement gets the rows.
            selection = select(role, a2, b2, out_ref, self.config.max_rows, max_cols=self._max_cols,
                               passes=None if deferred else self._passes, site=site)
            vec_sum, vec_max = self._measurement.measure(
                role, *selection, graphable=out_ref is None and not deferred
            )
            if deferred:
                r = ROLE_INDEX[role]
                capture.after_replay(lambda: self._window.record(idx, r, vec_sum, vec_max, self.step))
            else:
                self._window.record(idx, ROLE_INDEX[role], vec_sum, vec_max, step)

    # ------------------------------------------------------------------ reduction

    def reduce(self, process_group: dist.ProcessGroup | None = None) -> dict[VerdictKey, Verdict]:
        """Reduce the windows across ranks and update the verdicts (one interval).

        Two collectives (one SUM, one MAX) for all sites together, then two small
        device-to-host copies; call it every ``interval`` steps (see :meth:`should_reduce`) on
        every rank, with the same sites registered in the same order everywhere (the packed
        tensors must have the same layout on all ranks).

        Args:
            process_group: the group to reduce over; None = the default group when
                ``torch.distributed`` is initialized, else this process alone.

        Returns:
            The verdicts (as :meth:`verdicts`).
        """
        with torch.no_grad(), record_function("loka/probe/reduce"):
            obs_max, obs_min = self._window.reduce(process_group)
        self.num_reduces += 1
        self._window.check_alignment(obs_max, obs_min, self._sites, self.step)
        self._window.count_nonfinite_events(self._sites, self.step)
        new_data = self._window.new_data([[int(n) for n in row] for row in obs_max.tolist()])
        update = judge(
            self._window.reduced_stats(),
            config=self.config,
            sites=self._sites,
            budgets=self._budgets,
            candidates=self.candidates,
            new_data=new_data,
            key_states=self._key_state,
            step=self.step,
        )
        self._key_state.update(update.key_states)
        self._verdicts.update(update.verdicts)
        for name, lo in update.series:
            self.series.setdefault(name, []).append((self.step, lo))
        for verdict in update.changes:
            self._record_change(verdict)
        return self.verdicts()

    def _record_change(self, verdict: Verdict) -> None:
        self.num_verdict_changes += 1
        self.history.append(
            {
                "step": verdict.step,
                "site": verdict.site,
                "role": verdict.role,
                "fmt": verdict.fmt.value,
                "scaling": verdict.scaling.value,
                "safe": verdict.safe,
                "reason": verdict.reason,
            }
        )
        # Every flip is in `history` and the report; Dispatch logs the plan changes it causes.
        logger.debug(
            "probe: %s/%s %s/%s -> %s at step %d: %s",
            verdict.site, verdict.role, verdict.fmt.value, verdict.scaling.value,
            "safe" if verdict.safe else "unsafe", verdict.step, verdict.reason,
        )

    # ------------------------------------------------------------------ statistics and verdicts

    @property
    def events(self) -> list[dict[str, Any]]:
        """Logged, counted events (non-finite values, misaligned windows)."""
        return self._window.events

    @property
    def num_nonfinite_events(self) -> int:
        """(site, role) reductions that found new non-finite values."""
        return self._window.num_nonfinite_events

    @property
    def num_misaligned_events(self) -> int:
        """(site, role) reductions whose ranks had recorded different numbers of samples."""
        return self._window.num_misaligned_events

    @property
    def has_reduced_window(self) -> bool:
        """Whether a reduced window exists (after a :meth:`reduce`, or restored with the state)."""
        window = self._window
        return window.global_sum is not None and window.global_max is not None

    def window_stats(self, site: str, role: str) -> dict[str, Tensor]:
        """Per-slot statistics of the reduced window of one GEMM (host tensors, slot order).

        Keys: ``valid`` [W] bool, ``step`` [W], ``count`` [W] (ranks that contributed),
        ``sqnr_db`` [W, C] (C candidates, order of :attr:`candidates`), and per operand
        ``o`` in (a, b): ``saturation_o`` / ``underflow_o`` [W, C], ``amax_o``,
        ``outlier_ratio_o``, ``row_spread_o``, ``nonfinite_o`` [W].

        Raises:
            ValueError: before the first :meth:`reduce` since the site was registered.
        """
        window = self._window
        if window.global_sum is None or window.global_max is None:
            raise ValueError("no reduced window yet: call reduce() first")
        s, r = self._index(site), ROLE_INDEX[role]
        out = window.layout.derive(window.global_sum[s, r], window.global_max[s, r])
        out["step"] = torch.tensor(window.slot_steps[s][r], dtype=torch.int64)
        return out

    def verdicts(self) -> dict[VerdictKey, Verdict]:
        """Current verdict per (site, role, fmt, scaling); unsafe until first judged."""
        out: dict[VerdictKey, Verdict] = {}
        for site in self._sites:
            for role in ROLES:
                for cand in self.candidates:
                    key = (site, role, cand.fmt, cand.scaling)
                    out[key] = self._verdicts.get(key) or self._unjudged(key)
        return out

    def verdict(self, site: str, role: str, fmt: Fp8Format | str, scaling: Scaling | str) -> Verdict:
        """One verdict; ``fmt`` and ``scaling`` may be given as strings ("e4m3", "rowwise")."""
        key = (site, role, Fp8Format(fmt), Scaling(scaling))
        if key[0] not in self._site_index or role not in ROLE_INDEX:
            raise ValueError(f"unknown site/role {site!r}/{role!r}")
        if Candidate(key[2], key[3]) not in self.candidates:
            raise ValueError(f"{key[2].value}/{key[3].value} is not a configured candidate")
        return self._verdicts.get(key) or self._unjudged(key)

    def _unjudged(self, key: VerdictKey) -> Verdict:
        return unjudged(key, budget_db=self._budgets[key[0]][key[1]], backward_fmt_b=self.config.backward_fmt_b)

    # ------------------------------------------------------------------ reporting

    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics logger, keys ``probe/<site>/<role>/<stat>[/<candidate>]``."""
        out: dict[str, float] = {
            "probe/nonfinite_events": float(self.num_nonfinite_events),
            "probe/misaligned_events": float(self.num_misaligned_events),
            "probe/verdict_changes": float(self.num_verdict_changes),
        }
        for (site, role, fmt, scaling), v in self._verdicts.items():
            name = Candidate(fmt, scaling).name
            prefix = f"probe/{site}/{role}"
            out[f"{prefix}/sqnr_db/{name}"] = v.sqnr_lo_db
            out[f"{prefix}/safe/{name}"] = float(v.safe)
            out[f"{prefix}/underflow/{name}"] = v.underflow
            out[f"{prefix}/saturation/{name}"] = v.saturation
            out[f"{prefix}/outlier_ratio"] = v.outlier_ratio
            out[f"{prefix}/row_spread"] = v.row_spread
            out[f"{prefix}/amax"] = v.amax
            out[f"{prefix}/nonfinite"] = float(v.num_nonfinite)
        return out

    def report(self) -> dict[str, Any]:
        """Everything a run report needs, JSON-able (``json.dumps`` works on it)."""
        cfg = self.config
        graphs = self._measurement.graphs
        return {
            "step": self.step,
            "num_reduces": self.num_reduces,
            "config": {
                "enabled": cfg.enabled,
                "every_k_steps": cfg.every_k_steps,
                "sites_per_step": cfg.sites_per_step,
                "window": cfg.window,
                "interval": cfg.interval,
                "quantile": cfg.quantile,
                "margin_db": cfg.margin_db,
                "hysteresis_intervals": cfg.hysteresis_intervals,
                "min_samples": cfg.min_samples,
                "max_saturation_fraction": cfg.max_saturation_fraction,
                "max_underflow_fraction": cfg.max_underflow_fraction,
                "candidates": [c.name for c in self.candidates],
                "backward_fmt_b": None if cfg.backward_fmt_b is None else cfg.backward_fmt_b.value,
            },
            "sites": {
                site: {
                    "weight_shape": None if self._weight_shapes[site] is None else list(self._weight_shapes[site]),  # type: ignore[arg-type]
                    "sqnr_budget_db": dict(self._budgets[site]),
                    "num_observations": dict(zip(ROLES, self._window.num_obs[i], strict=True)),
                }
                for i, site in enumerate(self._sites)
            },
            "verdicts": [v.to_dict() for v in self.verdicts().values()],
            "events": {
                "nonfinite": self.num_nonfinite_events,
                "misaligned": self.num_misaligned_events,
                "verdict_changes": self.num_verdict_changes,
                "log": [{k: jsonable(v) for k, v in e.items()} for e in self.events],
            },
            "cuda_graphs": None
            if graphs is None
            else {
                "captures": graphs.num_captures,
                "eager_measurements": graphs.num_eager,
                "disabled_reason": graphs.disabled_reason,
            },
            # Why the shadow GEMMs fell back from bf16 GEMMs with an fp32 result to fp32 ones.
            "shadow_gemm_fallback": self._measurement.exact_gemm_fallback,
            "history": list(self.history),
            "series": {k: [[s, jsonable(v)] for s, v in pts] for k, pts in self.series.items()},
        }

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Window contents, counters and verdict state (plain types and CPU tensors)."""
        w = self._window
        return {
            "version": _STATE_VERSION,
            "window": self.config.window,
            "candidates": [(c.fmt.value, c.scaling.value) for c in self.candidates],
            "sites": [
                {
                    "name": s,
                    "weight_shape": self._weight_shapes[s],
                    "sqnr_budget_db": dict(self._budgets[s]),
                }
                for s in self._sites
            ],
            "step": self.step,
            "local_sum": w.local_sum.cpu().clone(),
            "local_max": w.local_max.cpu().clone(),
            "local_nonfinite_total": w.local_nonfinite_total.cpu().clone(),
            "num_obs": [list(x) for x in w.num_obs],
            "slot_steps": [[list(r) for r in s] for s in w.slot_steps],
            "global_sum": None if w.global_sum is None else w.global_sum.clone(),
            "global_max": None if w.global_max is None else w.global_max.clone(),
            "global_nonfinite_total": (
                None if w.global_nonfinite_total is None else w.global_nonfinite_total.clone()
            ),
            "num_obs_at_last_reduce": [list(x) for x in w.num_obs_at_last_reduce],
            "nonfinite_seen": [list(x) for x in w.nonfinite_seen],
            "key_state": {
                (k[0], k[1], k[2].value, k[3].value): (st.safe, st.streak)
                for k, st in self._key_state.items()
            },
            "verdicts": [v.to_dict() for v in self._verdicts.values()],
            "history": [dict(h) for h in self.history],
            "events": [dict(e) for e in w.events],
            "series": {k: list(v) for k, v in self.series.items()},
            "counters": {
                "num_nonfinite_events": w.num_nonfinite_events,
                "num_misaligned_events": w.num_misaligned_events,
                "num_reduces": self.num_reduces,
                "num_verdict_changes": self.num_verdict_changes,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. A probe with no sites registers the saved ones;
        otherwise the registered sites (names and order), window and candidates must match."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"probe state version {state.get('version')} != {_STATE_VERSION}: the checkpoint "
                f"comes from another loka_train version; {_RESUME_FIX}"
            )
        if state["window"] != self.config.window:
            raise ValueError(
                f"probe state has window {state['window']} but loka.probe.window="
                f"{self.config.window}; {_RESUME_FIX}"
            )
        mine = [(c.fmt.value, c.scaling.value) for c in self.candidates]
        if [tuple(c) for c in state["candidates"]] != mine:
            raise ValueError(
                f"probe state candidates {state['candidates']} != configured {mine} "
                f"(loka.probe.formats / loka.probe.scalings); {_RESUME_FIX}"
            )
        names = [s["name"] for s in state["sites"]]
        self.budget_changes = []
        if not self._sites:
            for s in state["sites"]:
                self.register_site(s["name"], weight_shape=s["weight_shape"], sqnr_budget_db=s["sqnr_budget_db"])
        elif names != self._sites:
            raise ValueError(
                f"probe state sites {names} != registered sites {self._sites} (the model or "
                f"loka.mods changed); {_RESUME_FIX}"
            )
        else:
            # Registered floors (this run's config) win; the verdicts the saved floors gave are
            # dropped below, so no GEMM stays judged against a floor this run does not have.
            for s in state["sites"]:
                for role, saved in s["sqnr_budget_db"].items():
                    now = self._budgets[s["name"]][role]
                    if float(saved) != now:
                        self.budget_changes.append((s["name"], role, float(saved), now))
                        logger.warning(
                            "probe: %s/%s: the checkpoint judged it against an SQNR floor of %.1f dB, this "
                            "run's config sets %.1f dB: its saved verdicts are dropped, it is judged again "
                            "at the next interval", s["name"], role, float(saved), now,
                        )
        self._sampler.step = int(state["step"])
        self._window.load(state)
        changed = {(site, role) for site, role, _, _ in self.budget_changes}
        self._key_state = {
            (k[0], k[1], Fp8Format(k[2]), Scaling(k[3])): KeyState(bool(v[0]), int(v[1]))
            for k, v in state["key_state"].items()
            if (k[0], k[1]) not in changed
        }
        self._verdicts = {}
        for d in state["verdicts"]:
            v = Verdict.from_dict(d)
            if (v.site, v.role) not in changed:
                self._verdicts[(v.site, v.role, v.fmt, v.scaling)] = v
        self.history = [dict(h) for h in state["history"]]
        self.series = {k: [tuple(p) for p in v] for k, v in state["series"].items()}  # type: ignore[misc]
        counters = state["counters"]
        self.num_reduces = int(counters["num_reduces"])
        self.num_verdict_changes = int(counters["num_verdict_changes"])
