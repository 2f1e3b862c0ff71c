"""Collectives never timed at their size or group size: priced from the ones that were, by the ring algorithm.

A collective's time on this machine is measured between real processes (:mod:`dooly.profile.collectives`), but only
at the group sizes the machine can run (two ranks on two cores). A rank of a wider replica (tensor-parallel 4 or 8)
needs its collectives among 4 or 8 ranks, and a model never profiled needs them at its own message sizes. Per kind,
every measured point (any signature, any model) is fitted to a latency-bandwidth law over what a ring moves:

    t = alpha * steps(g) + beta * wire_bytes(g)

* all_reduce (reduce-scatter then all-gather): ``2 (g - 1)`` steps, ``2 (g - 1) / g`` of the tensor's bytes on the
  wire per rank;
* all_gather and gather (the input is one rank's shard): ``g - 1`` steps, ``(g - 1)`` shards' bytes;
* reduce_scatter (the input is the whole tensor): ``g - 1`` steps, ``(g - 1) / g`` of its bytes;
* send and recv (one pipeline stage to the next): one step, the tensor's bytes, whatever the group size.

``alpha`` and ``beta`` are non-negative, fitted in relative error. With one group size measured ``alpha`` and the
intercept are one parameter, so a prediction at a larger group size rests on the ring's scaling alone, not on
anything measured at that size: such signatures are reported as extrapolated, naming the group sizes measured. A
kind with no measured point borrows the fit of all measured kinds pooled (also reported).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dooly.predict.estimators import SignatureModel
from dooly.predict.passes import branch_keys
from dooly.predict.shapes import ShapeFill

_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1}


def ring_terms(kind: str, nbytes: float, group: int) -> tuple[float, float]:
    """``(steps, wire bytes per rank)`` of a ``kind`` collective of an ``nbytes`` input among ``group`` ranks."""
    g = max(1, int(group))
    if kind == "all_reduce":
        return 2.0 * (g - 1), 2.0 * (g - 1) / g * nbytes
    if kind in ("all_gather", "gather"):
        return float(g - 1), (g - 1) * nbytes
    if kind == "reduce_scatter":
        return float(g - 1), (g - 1) / g * nbytes
    return 1.0, float(nbytes)  # send / recv


def _call_terms(sig: object, values: Mapping[str, int]) -> tuple[str, float, int]:
    """(kind, input bytes, group size) of collective ``sig`` at request ``values``."""
    from dooly.profile.collectives import collective_call

    call = collective_call(sig, values)  # type: ignore[arg-type]
    nbytes = math.prod(call.shape) * _ITEMSIZE.get(call.dtype, 4)
    return call.kind, float(nbytes), call.group_size


@dataclass
class RingFit:
    """``t = alpha * steps + beta * wire_bytes`` for one kind (or all kinds pooled), with its spread."""

    alpha: float
    beta: float
    sigma: float  # RMS of the log residuals over the fitted points
    groups: tuple[int, ...]  # group sizes measured
    n: int

    def __call__(self, kind: str, nbytes: float, group: int) -> float:
        steps, wire = ring_terms(kind, nbytes, group)
        return self.alpha * steps + self.beta * wire


def _fit(rows: Sequence[tuple[float, float, float, int]]) -> RingFit | None:
    """Non-negative least squares in relative error over ``(steps, wire, seconds, group)`` rows."""
    if not rows:
        return None
    a = np.array([[s, w] for s, w, _, _ in rows], dtype=np.float64)
    t = np.array([r[2] for r in rows], dtype=np.float64)
    wa, wt = a / t[:, None], np.ones_like(t)
    from scipy.optimize import nnls

    coef, _ = nnls(wa, wt)
    pred = np.maximum(a @ coef, 1e-12)
    sigma = float(np.sqrt(np.mean(np.log(pred / t) ** 2)))
    return RingFit(float(coef[0]), float(coef[1]), sigma, tuple(sorted({r[3] for r in rows})), len(rows))


@dataclass
class CollectiveModel:
    """Ring fits per collective kind from a DB's measured collective points."""

    fits: dict[str, RingFit] = field(default_factory=dict)
    pooled: RingFit | None = None

    @classmethod
    def fit(
        cls, signatures: Mapping[str, object], points: Mapping[str, Sequence[tuple[Mapping, float]]]
    ) -> CollectiveModel:
        """Fit on the measured points of every collective signature in ``signatures`` (key -> Signature)."""
        from dooly.profile.collectives import collective_kind

        by_kind: dict[str, list[tuple[float, float, float, int]]] = {}
        for key, sig in signatures.items():
            if not collective_kind(sig.op):  # type: ignore[attr-defined]
                continue
            for values, seconds in points.get(key, ()):
                if not seconds > 0:
                    continue
                kind, nbytes, group = _call_terms(sig, {k: int(v) for k, v in values.items()})
                steps, wire = ring_terms(kind, nbytes, group)
                by_kind.setdefault(kind, []).append((steps, wire, float(seconds), group))
        fits = {k: f for k, rows in by_kind.items() if (f := _fit(rows)) is not None}
        pooled = _fit([r for rows in by_kind.values() for r in rows])
        return cls(fits, pooled)

    def for_kind(self, kind: str) -> tuple[RingFit | None, bool]:
        """The fit pricing ``kind``, and whether it is borrowed from the pooled kinds."""
        if kind in self.fits:
            return self.fits[kind], False
        return self.pooled, True


@dataclass
class CollectiveFill:
    """What :func:`collective_fill` priced: per pass the filled signatures, their points, and one line each kind."""

    fills: dict[str, list[ShapeFill]] = field(default_factory=dict)
    synth: dict[str, list[tuple[dict[str, int], float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def collective_fill(traces, measured, store, ctx, config) -> CollectiveFill:  # type: ignore[no-untyped-def]
    """Points, on the default grid within the model's positions, for every collective of ``traces`` with no
    complete profile (not in ``measured``), from the ring fits of the DB's measured collectives; with the lines
    saying which were extrapolated past the group sizes measured."""
    from dooly.core.zoo import max_positions
    from dooly.db.shape_model import signatures_of
    from dooly.profile.collectives import collective_kind
    from dooly.profile.plan import GridSpec

    out = CollectiveFill()
    wanted = [
        (phase, key, sig, mult)
        for phase, tr in traces.items()
        for key, branch in zip(branch_keys(phase, tr), tr.branches(), strict=True)
        for sig, mult in branch.unique().items()
        if collective_kind(sig.op) and sig.key not in measured
    ]
    if not wanted:
        return out
    known = {k: v for k, v in measured.items() if v}
    sigs = {k: s for k, s in signatures_of(store, ctx, known).items() if collective_kind(s.op)}
    model = CollectiveModel.fit(sigs, known)
    grid = GridSpec().within(max_positions(config))
    said: dict[tuple[str, int], str] = {}
    for phase, key, sig, mult in wanted:
        kind = collective_kind(sig.op) or ""
        fit, borrowed = model.for_kind(kind)
        if fit is None:
            continue  # nothing measured at all: still missing (profile a parallel rank: `dooly profile --tp 2`)
        syms = tuple(sorted(sig.symbols()))
        if sig.key not in out.synth:
            pts = grid.signature_points(phase, syms)
            out.synth[sig.key] = [(p, max(1e-9, fit(*_call_terms(sig, p)))) for p in pts]
        group = _call_terms(sig, out.synth[sig.key][0][0])[2]
        unc = math.exp(fit.sigma) - 1
        priced = SignatureModel(syms, out.synth[sig.key])
        out.fills.setdefault(key, []).append(ShapeFill(sig.key, sig, mult, priced, unc))
        if (kind, group) not in said:
            measured_g = ", ".join(map(str, fit.groups))
            ring = kind not in ("send", "recv")  # a transfer between two stages is the same at any group size
            how = "extrapolated" if ring and group > max(fit.groups) else "priced"
            src = "all kinds' points pooled" if borrowed else f"{fit.n} measured points"
            said[(kind, group)] = (
                f"{kind} among {group}: {how} by the ring model from {src} at group size {measured_g} "
                f"(±{100 * unc:.0f}% over them)"
            )
    out.notes = [said[k] for k in sorted(said)]
    return out
