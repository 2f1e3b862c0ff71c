"""Signatures predicted from shape alone: filling a model's unmeasured signatures from the shape model of
their operator kind (:mod:`dooly.db.shape_model`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dooly.predict.estimators import SignatureModel
from dooly.predict.passes import branch_keys, signature_keys


@dataclass
class ShapeFill:
    """One signature of a pass predicted from the shape model of its kind, never measured."""

    key: str
    signature: object
    mult: int
    model: SignatureModel  # interpolates the shape model's figures on the grid it would have been profiled on
    rel_uncertainty: float  # exp(sigma) - 1 of the kind's leave-one-signature-out spread, leverage included


def own_signatures(store, ctx, name: str, traces: Mapping[str, object]) -> set[str]:  # type: ignore[no-untyped-def]
    """The signatures of ``name`` that no other model profiled into the DB needs: what profiling it added."""
    from dooly.profile.savings import profiled_models

    others = {k for m in profiled_models(store, ctx) if m.name != name for k in m.points}
    return signature_keys(traces) - others


def shape_fill(traces, measured, store, ctx, config, exclude=(), skip=()):  # type: ignore[no-untyped-def]
    """Shape-model points for every signature of ``traces`` not in ``measured`` (nor in ``skip``: priced
    otherwise), on the default grid within the model's positions: ``({phase: [ShapeFill]}, {key: [(values,
    seconds)]})``. The shape model is fitted on ``measured`` less ``exclude``; a signature whose kind it does not
    cover is left out (still missing)."""
    from dooly.core.zoo import max_positions
    from dooly.profile.plan import GridSpec

    model = _fitted(store, ctx, measured, exclude)
    grid = GridSpec().within(max_positions(config))
    fills: dict[str, list[ShapeFill]] = {}
    synth: dict[str, list[tuple[dict[str, int], float]]] = {}
    unc: dict[str, float] = {}
    for phase, tr in traces.items():
        for key, branch in zip(branch_keys(phase, tr), tr.branches(), strict=True):
            for sig, mult in branch.unique().items():
                if sig.key in measured or sig.key in skip or not model.covers(sig):
                    continue
                syms = tuple(sorted(sig.symbols()))
                if sig.key not in synth:
                    grid_pts = grid.signature_points(phase, syms)
                    pred = model.predict(sig, grid_pts)
                    synth[sig.key] = [(p, float(t)) for p, t in zip(grid_pts, pred.seconds, strict=True)]
                    unc[sig.key] = pred.rel_uncertainty
                fills.setdefault(key, []).append(
                    ShapeFill(sig.key, sig, mult, SignatureModel(syms, synth[sig.key]), unc[sig.key])
                )
    return fills, synth


_FITS: dict[tuple, object] = {}  # the last shape model fitted, by DB file, context and the points it was fitted on


def _fitted(store, ctx, measured, exclude):  # type: ignore[no-untyped-def]
    """The shape model fitted on ``measured`` less ``exclude``, once per DB file, context and point set (the
    predictors of a layout sweep's many ranks all fit the same one)."""
    from dooly.db.shape_model import ShapeModel, signatures_of

    path = getattr(store, "path", None)
    points = tuple(sorted((k, len(v), sum(float(t) for _, t in v)) for k, v in measured.items()))
    key = (str(path), ctx, points, frozenset(exclude)) if path is not None else None
    if key is not None and key in _FITS:
        return _FITS[key]
    model = ShapeModel.fit(signatures_of(store, ctx, measured), measured, exclude)
    if key is not None:
        _FITS.clear()  # one at a time: another DB or point set replaces the last
        _FITS[key] = model
    return model
