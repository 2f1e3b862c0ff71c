"""Savings accounting: a model's onboarding cost with cross-model reuse vs each model alone, one computation for all.

Onboarding is tracing, operator profiling and calibration forwards (the real forwards the framework-overhead fit
needs), all three counted on both sides: alone, a model on an empty DB pays its tracing, all its operator points
and a full calibration (no shared overhead fit exists yet); with reuse it pays its tracing, the points no earlier
model profiled, and the calibration its policy took (``dooly profile --calibrate``: the full set, a check, or
none). Tracing time is recorded from this version on (:data:`~dooly.profile.traces.TRACE_SECONDS`); an older
DB counts it as 0 and the figure says so.

``dooly plan`` and ``dooly profile`` price their plan's models; ``dooly report`` prices the models the DB
records as profiled (each model once, in the order first profiled: calibration rounds and held-out
measurements are not models). Both dedup repeated layers within a model (as Vidur) and price a signature
by its measured cost, or, where nothing is measured yet, by what profiling its planned points would cost:
the shape model's predicted latency at each point (:mod:`dooly.db.shape_model`) through :class:`PointCost`
(the calls ``time_calls`` makes at that latency, plus a per-point overhead fitted on the DB). A large
model's operators are slower, so its points cost more than the small models' mean; only a signature whose
kind no shape model covers (or one the report cannot lay out on a grid) falls back to the DB's mean cost per
point.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dooly.db.store import ProfileContext, ProfileStore, canonical_point
from dooly.profile.plan import Plan
from dooly.profile.timing import TimerConfig
from dooly.profile.traces import trace_seconds
from dooly.trace.signature import Signature

# the record of profiled models lives in the traces table, under this engine key, one row per context
_RECORD = ("profiled", "models")


@dataclass(frozen=True)
class ModelSignatures:
    """A model as the savings see it: its unique signatures (both phases) and the points planned for each."""

    name: str
    points: dict[str, int]


@dataclass
class ModelCost:
    name: str
    signatures: int  # unique signatures of the model (both phases; repeated layers count once)
    new: int  # profiled for this model (first in the list to need them, not already in the DB)
    reused_models: int  # already needed by an earlier model in the list
    reused_db: int  # already complete in the DB before this run
    profile_alone_s: float  # operator profiling of this model on its own (within-model reuse only)
    profile_s: float  # operator profiling this model adds when profiled after the earlier ones, with reuse
    trace_s: float = 0.0  # tracing the model (and its calibration variants): the same alone and with reuse
    calib_alone_s: float = 0.0  # its full calibration: what it needs on an empty DB, with no shared fit
    calib_s: float = 0.0  # the calibration forwards it pays with reuse (a check, the full set, or none)

    @property
    def alone_s(self) -> float:
        """Onboarding this model on an empty DB: tracing, all its operator points, its full calibration."""
        return self.trace_s + self.profile_alone_s + self.calib_alone_s

    @property
    def marginal_s(self) -> float:
        """Onboarding this model after the earlier ones, with reuse."""
        return self.trace_s + self.profile_s + self.calib_s


@dataclass
class Savings:
    """Onboarding cost of a list of models, with cross-model reuse and each alone: tracing + operator profiling +
    calibration forwards (``with_reuse_s``/``without_reuse_s``; the parts are summed from ``models``)."""

    models: list[ModelCost]
    measured_share: float  # share of the new signatures whose cost is measured (the rest estimated)
    in_db_s: float = 0.0  # of with_reuse_s: profiles and calibration already in the DB, which this run does not take
    shape_predicted: int = 0  # signatures left to the shape model (``--budget``): not measured, priced at zero
    mean_priced_share: float = 0.0  # of the new signatures: priced at the DB's mean cost per point (no shape model)
    untimed_traces: int = 0  # models whose tracing time the DB does not hold (older DBs): counted as 0
    calib_estimated: int = 0  # models whose full calibration (alone) is estimated, not measured
    calib_unpriced: int = 0  # models whose calibration nothing in the DB prices (no model calibrated yet): 0

    def _sum(self, attr: str) -> float:
        return float(sum(getattr(r, attr) for r in self.models))

    @property
    def with_reuse_s(self) -> float:
        return self._sum("marginal_s")

    @property
    def without_reuse_s(self) -> float:
        return self._sum("alone_s")

    @property
    def saved_pct(self) -> float:
        """Share of the whole onboarding cost (calibration included) that reuse saves."""
        return _pct(self.with_reuse_s, self.without_reuse_s)

    @property
    def saved_pct_uncalibrated(self) -> float:
        """The same with calibration left out of both sides (tracing and operator profiling only)."""
        t = self._sum("trace_s")
        return _pct(t + self._sum("profile_s"), t + self._sum("profile_alone_s"))

    def split(self) -> str:
        """Where the device time goes: tracing, operator profiling, calibration forwards, with reuse and alone."""
        t, p, c = (self._sum(a) for a in ("trace_s", "profile_s", "calib_s"))
        pa, ca = self._sum("profile_alone_s"), self._sum("calib_alone_s")
        with_reuse = f"trace {t:.1f} + profile {p:.1f} + calibrate {c:.1f} device-s with reuse"
        alone = f"{t:.1f} + {pa:.1f} + {ca:.1f} alone"
        uncal = f"without calibration {t + p:.1f} vs {t + pa:.1f}: {self.saved_pct_uncalibrated:.1f}% saved"
        return f"{with_reuse}, {alone}; {uncal}"

    def describe(self) -> str:
        """The one-line figure every command prints (so the CLI and the report cannot disagree in digits)."""
        est = ""
        if self.measured_share < 0.999:
            est = f" ({100 * (1 - self.measured_share):.0f}% of signatures estimated"
            if self.mean_priced_share > 0:
                est += f", {100 * self.mean_priced_share:.0f}% of them at the mean cost per point"
            est += ")"
        if self.shape_predicted:
            est += f" ({self.shape_predicted} signatures predicted from shape, not measured)"
        if self.calib_estimated:
            est += f" (full calibration of {self.calib_estimated} model(s) estimated, not run)"
        if self.calib_unpriced:
            est += f" (calibration of {self.calib_unpriced} model(s) not priced: no calibrated model to price it by)"
        if self.untimed_traces:
            est += f" (tracing of {self.untimed_traces} model(s) not recorded in this DB: counted as 0)"
        in_db = ""
        if self.in_db_s > 0:
            run = self.with_reuse_s - self.in_db_s - self._sum("trace_s")
            in_db = f"; {self.in_db_s:.1f} device-s of it already in the DB, so this run measures {run:.1f}"
        return (
            f"{len(self.models)} model{'' if len(self.models) == 1 else 's'}: "
            f"{self.with_reuse_s:.1f} device-s with cross-model reuse vs "
            f"{self.without_reuse_s:.1f} device-s each model alone: {self.saved_pct:.1f}% saved "
            f"({self.split()}){est}{in_db}"
        )


def _pct(with_reuse: float, alone: float) -> float:
    return 100.0 * (1.0 - with_reuse / alone) if alone else 0.0


def savings_of(
    models: Sequence[ModelSignatures],
    store: ProfileStore,
    ctx: ProfileContext,
    known: Collection[str] = (),
    predicted: Collection[str] = (),
    estimated: Mapping[str, float] | None = None,
    calibration: str | None = None,
    missed: Collection[str] = (),
) -> Savings:
    """Onboarding cost of ``models`` in this order with cross-model reuse vs each alone (``known``: signatures
    complete in the DB before the run: priced like the rest, so the figure does not depend on what an earlier
    run measured, and reported per model and as ``in_db_s``, what this run does not measure again;
    ``predicted``: signatures left to the shape model, which cost nothing with reuse but their full price
    alone; ``estimated``: the predicted cost of signatures nothing is measured of, see :func:`estimate_costs`;
    one missing there is priced at the DB's mean cost per point). Tracing and calibration forwards are priced by
    :class:`_Onboarding` (``calibration``: the policy a model not calibrated yet will get; None: as recorded;
    ``missed``: see :meth:`_Onboarding.price`)."""
    predicted = set(predicted)
    estimated = estimated or {}
    measured = store.signature_costs(ctx)
    n_pts = sum(len(store.done_points(ctx, k)) for k in measured)
    point_cost = sum(measured.values()) / n_pts if n_pts else 0.05

    def cost(key: str, points: int) -> float:
        if key in measured:
            return measured[key]
        return estimated[key] if key in estimated else points * point_cost

    seen: set[str] = set()
    rows = []
    n_meas = n_mean = n_all = 0
    for m in models:
        keys = set(m.points)
        fresh = keys - seen
        rows.append(
            ModelCost(
                m.name,
                len(keys),
                len(fresh - set(known)),
                len(keys & seen),
                len(fresh & set(known)),
                sum(cost(k, n) for k, n in m.points.items()),
                sum(cost(k, n) for k, n in m.points.items() if k in fresh and k not in predicted),
            )
        )
        n_meas += sum(1 for k in fresh if k in measured)
        n_mean += sum(1 for k in fresh if k not in measured and k not in estimated)
        n_all += len(fresh)
        seen |= keys
    points = {k: n for m in models for k, n in m.points.items()}
    in_db = sum(cost(k, points[k]) for k in seen & set(known))
    on = _Onboarding(store, ctx, lambda m: sum(cost(k, n) for k, n in m.points.items()))
    in_db += on.price(rows, calibration, missed)
    share = (n_meas / n_all, n_mean / n_all) if n_all else (1.0, 0.0)
    untimed = sum(1 for r in rows if on.untimed(r.name))
    return Savings(rows, share[0], in_db, len(predicted & seen), share[1], untimed, on.estimated, on.unpriced)


class _Onboarding:
    """Tracing and calibration forwards per model, from the DB.

    A model calibrated in full is priced at its forwards' cost (its check, if one missed, included), and so is
    one whose missed check took the calibration at its own depth (:data:`~dooly.profile.calibrate.LIGHT_ROUNDS`).
    On its own a model needs the full set (an empty DB has no shared overhead fit), so one that lacks it is
    priced alone by an estimate: its check's cost times what the full set cost over the check's shapes on the
    DB's fully calibrated models; without a check, its operator profiling cost times their ratio of calibration
    to profiling."""

    def __init__(self, store: ProfileStore, ctx: ProfileContext, profile_alone: Callable[[ModelSignatures], float]):
        from dooly.profile.calibrate import CALIBRATION_SHAPES, CHECK_SHAPES, CHECK_SUFFIX, REPLICA_MARK, phase_points

        self.store, self.ctx, self.estimated, self.unpriced = store, ctx, 0, 0
        self.forwards: dict[str, dict[tuple[str, str, str], float]] = {}
        for key, ph, v, m in store.forwards(ctx):
            # validation's held-out forwards are not onboarding; a replica's calibration is not a one-device model's
            if "#holdout" not in key and not key.startswith("#") and REPLICA_MARK not in key.split("#")[0]:
                self.forwards.setdefault(key.split("#")[0], {})[(key, ph, canonical_point(v))] = m.cost_s
        self.check_key = CHECK_SUFFIX
        self.checks, every = phase_points(CHECK_SHAPES), phase_points(CALIBRATION_SHAPES)
        full = {name: self.full_s(name) for name in self.forwards if self.full_s(name)}
        # per fully calibrated model: its full set's cost, and its first round at its own depth (what a missed
        # check takes), over what the check's shapes cost in that round
        at_check = {n: self._cost_at(n, self.checks) for n in full}
        self.per_check = [full[n] / at_check[n] for n in full if at_check[n] > 0]
        self.per_check_light = [self._cost_at(n, every) / at_check[n] for n in full if at_check[n] > 0]
        alone = {m.name: profile_alone(m) for m in profiled_models(store, ctx)}
        self.per_profile = [full[n] / alone[n] for n in full if alone.get(n)]

    def _cost_at(self, name: str, shapes: Collection[tuple[str, str]]) -> float:
        """Cost of the model's first round at its own depth at ``shapes`` ((phase, canonical point))."""
        return sum(c for (k, ph, p), c in self.forwards[name].items() if k == name and (ph, p) in shapes)

    def calibrated(self, name: str) -> bool:
        """Whether the model has a calibration of its own in the DB (the full set, or its own depth's)."""
        return any(k == name for k, *_ in self.forwards.get(name, {}))

    def full_s(self, name: str) -> float:
        """Cost of the model's full calibration in the DB (0 when it has none: its second round is missing)."""
        fw = self.forwards.get(name, {})
        if not any("#round" in k for k, *_ in fw):
            return 0.0
        return sum(c for (k, *_), c in fw.items() if k != name + self.check_key)

    def check_s(self, name: str) -> float:
        """What the model's check cost: its forwards at the check's shapes (as a check, or in its first round)."""
        if name not in self.forwards:
            return 0.0
        own = sum(c for (k, *_), c in self.forwards[name].items() if k == name + self.check_key)
        return own or self._cost_at(name, self.checks)

    def trace_s(self, name: str) -> float:
        variants = {name} | {re.sub(r"#round\d+$", "", k) for k, *_ in self.forwards.get(name, {})}
        return sum(trace_seconds(self.store, self.ctx.engine, self.ctx.dtype, v) or 0.0 for v in variants)

    def untimed(self, name: str) -> bool:
        return trace_seconds(self.store, self.ctx.engine, self.ctx.dtype, name) is None

    def estimate_full(self, name: str, profile_alone_s: float) -> float:
        """The model's full calibration when the DB holds less of it (see the class)."""
        check = self.check_s(name)
        if not check and not self.per_profile:  # nothing to estimate it from
            self.unpriced += 1
            return 0.0
        self.estimated += 1
        if check:
            return check * self.check_ratio()
        return profile_alone_s * float(np.median(self.per_profile))

    def check_ratio(self) -> float:
        """A full calibration's cost per unit of a check's cost."""
        return float(np.median(self.per_check)) if self.per_check else _CHECK_FALLBACK_RATIO

    def price(self, rows: Sequence[ModelCost], policy: str | None, missed: Collection[str] = ()) -> float:
        """Fill each row's tracing and calibration; returns the calibration already in the DB (with
        ``policy``, a plan's: what this run does not measure again). ``missed``: under ``check``, the models
        whose check misses, each then calibrated at its own depth (every other check passes)."""
        in_db, shared = 0.0, bool(self.per_check or self.per_profile)
        for r in rows:
            r.trace_s = self.trace_s(r.name)
            paid = sum(self.forwards.get(r.name, {}).values())
            r.calib_alone_s = self.full_s(r.name) or self.estimate_full(r.name, r.profile_alone_s)
            if policy is None or self.calibrated(r.name):  # as recorded (a plan does not run it again)
                r.calib_s = paid
                in_db += paid if policy is not None else 0.0
            elif policy == "all" or (policy == "check" and not shared):
                r.calib_s = r.calib_alone_s
            elif policy == "check":  # the check, and the calibration at its own depth only if it missed
                r.calib_s = r.calib_alone_s / self.check_ratio() * (self.light_ratio() if r.name in missed else 1.0)
            shared = shared or policy != "none"  # a model calibrated in full gives the later ones a shared fit
        return in_db

    def light_ratio(self) -> float:
        """A missed check's calibration (its own depth, one round, the check's forwards among them) per unit of
        the check's cost."""
        return float(np.median(self.per_check_light)) if self.per_check_light else _CHECK_FALLBACK_LIGHT


#: full calibration forwards per check forward (2 depths x 2 rounds x 9 shapes over 2 shapes), where the DB
#: has no fully calibrated model to measure the ratio of costs on
_CHECK_FALLBACK_RATIO = 18.0
_CHECK_FALLBACK_LIGHT = 4.5  # the 9 shapes of one round at full depth over the check's 2


@dataclass(frozen=True)
class PointCost:
    """Device seconds to profile one point of an op whose call takes ``t`` seconds: ``c0 + c1·(n(t) + 1)·t``.

    ``n(t)`` is the calls :func:`~dooly.profile.timing.time_calls` makes (warm-up, then repeats of an inner
    loop of at least ``min_sample_s``, the repeats cut once the point has cost ``budget_s``); the ``+ 1`` is
    the forward that sets up the job's context, which runs each op it profiles about once. ``c0`` (inputs
    materialised, the rest of the setup) and ``c1`` are fitted on the DB's measured points."""

    c0: float
    c1: float
    timer: TimerConfig = TimerConfig()

    def calls(self, t: np.ndarray) -> np.ndarray:
        cfg = self.timer
        t = np.maximum(np.asarray(t, dtype=np.float64), 1e-9)
        inner = np.clip(np.ceil(cfg.min_sample_s / t), 1, cfg.max_inner)
        # time_calls stops after the first repeat (from the third on) that takes the point past budget_s
        reps = np.floor((cfg.budget_s - cfg.warmup * t) / (inner * t)) + 1
        return max(1, cfg.warmup) + np.clip(reps, 3, cfg.repeats) * inner

    def __call__(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        return self.c0 + self.c1 * (self.calls(t) + 1) * t

    @classmethod
    def fit(cls, latency_s: Sequence[float], cost_s: Sequence[float], timer: TimerConfig | None = None) -> PointCost:
        """Non-negative least squares in relative error on measured points' (median latency, cost)."""
        from scipy.optimize import nnls

        timer = timer or TimerConfig()
        t, c = np.asarray(latency_s, dtype=np.float64), np.maximum(np.asarray(cost_s, dtype=np.float64), 1e-9)
        if len(t) < 2:
            return cls(0.0, 1.0, timer)
        A = np.column_stack([np.ones(len(t)), (cls(0.0, 1.0, timer).calls(t) + 1) * t]) / c[:, None]
        coef, _ = nnls(A, np.ones(len(t)))
        return cls(float(coef[0]), float(coef[1]) or 1.0, timer)


def estimate_costs(
    store: ProfileStore,
    ctx: ProfileContext,
    wanted: Mapping[str, tuple[Signature, Sequence[Mapping[str, int]]]],
    exclude: Collection[str] = (),
) -> dict[str, float]:
    """Predicted profiling cost of each ``{key: (signature, its grid points)}``: the shape model's latency at
    every point, priced by :class:`PointCost`; both fitted on the DB (less ``exclude``). A signature whose kind
    no shape model covers is left out (the caller prices it at the mean cost per point)."""
    from dooly.db.shape_model import ShapeModel, signatures_of

    raw = {k: v for k, v in store.all_points(ctx).items() if k not in set(exclude)}
    complete = store.complete_keys(ctx)
    pts = {k: [(p, m.median_s) for p, m in v] for k, v in raw.items() if k in complete}
    shape = ShapeModel.fit(signatures_of(store, ctx, pts), pts)
    flat = [m for v in raw.values() for _, m in v]
    price = PointCost.fit([m.median_s for m in flat], [m.cost_s for m in flat])
    out = {}
    for key, (sig, grid) in wanted.items():
        if shape.covers(sig):
            out[key] = float(price(shape.predict(sig, grid).seconds).sum())
    return out


def _signatures(plan: Plan) -> list[ModelSignatures]:
    out = []
    for mp in plan.models:
        phases = mp.needs.items()
        out.append(ModelSignatures(mp.name, {k: plan.grid_size.get(k, 1) for _, needs in phases for k in needs}))
    return out


def planned_points(plan: Plan) -> dict[str, tuple[Signature, list[dict[str, int]]]]:
    """Each signature of the plan with the grid points its owner profiles it on."""
    out: dict[str, tuple[Signature, list[dict[str, int]]]] = {}
    for mp in plan.models:
        for phase, needs in mp.needs.items():
            for k, n in needs.items():
                if plan.owner.get(k) == mp.name and k not in out:
                    out[k] = (n.signature, mp.grid.signature_points(phase, n.signature.symbols()))
    return out


def savings(
    plan: Plan,
    store: ProfileStore,
    predicted: Collection[str] = (),
    calibration: str | None = "all",
    missed: Collection[str] = (),
) -> Savings:
    """The plan's models, in the plan's order (``predicted``: signatures left to the shape model); signatures
    nothing is measured of are priced by :func:`estimate_costs`. ``calibration``: the policy the run gives a
    model not calibrated yet (None once the run is over: each model's calibration as the DB records it);
    ``missed``: under ``check``, the models whose check misses (every other check passes)."""
    measured = store.signature_costs(plan.ctx)
    wanted = {k: v for k, v in planned_points(plan).items() if k not in measured}
    estimated = estimate_costs(store, plan.ctx, wanted) if wanted else {}
    return savings_of(_signatures(plan), store, plan.ctx, plan.known, predicted, estimated, calibration, missed)


def _context_label(ctx: ProfileContext) -> str:
    return json.dumps(ctx.as_tuple())


def profiled_models(store: ProfileStore, ctx: ProfileContext) -> list[ModelSignatures]:
    """The models profiled into the DB under ``ctx``, in the order first profiled."""
    text = store.get_trace(_RECORD[0], _context_label(ctx), _RECORD[1])
    if not text:
        return []
    return [ModelSignatures(m["name"], m["points"]) for m in json.loads(text)["models"]]


def record_models(store: ProfileStore, ctx: ProfileContext, models: Sequence[ModelSignatures]) -> None:
    """Add ``models`` to the DB's record of models profiled under ``ctx`` (one already there keeps its place,
    with its signatures updated)."""
    recorded = {m.name: m for m in profiled_models(store, ctx)}
    for m in models:
        recorded[m.name] = m  # a dict keeps first-insertion order
    # an object, like every document in the traces table (the store checks that on open)
    doc = {"models": [{"name": m.name, "points": m.points} for m in recorded.values()]}
    store.put_trace(_RECORD[0], _context_label(ctx), _RECORD[1], json.dumps(doc, sort_keys=True))


def record_profiled(plan: Plan, store: ProfileStore) -> None:
    """Record the plan's models as profiled (``run_plan`` calls this once the plan has run)."""
    record_models(store, plan.ctx, _signatures(plan))


def profiled_savings(store: ProfileStore) -> dict[ProfileContext, Savings]:
    """Savings over the models profiled into the DB, per profile context that has any."""
    out = {}
    for ctx in store.contexts():
        models = profiled_models(store, ctx)
        if models:
            out[ctx] = savings_of(models, store, ctx)
    return out
