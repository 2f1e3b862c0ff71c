"""Framework overhead: what a real forward costs beyond the sum of its operators, fitted from the
calibration forwards stored in the profile DB."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dooly.predict.pages import page_cost


def overhead_features(n_records: int, values: Mapping[str, int]) -> np.ndarray:
    """Features of the per-iteration framework overhead (Python modules, dispatch, allocator).

    The engine pays a roughly fixed host cost per pass and per operator call (the Python module code around
    each op, which the op's own profile does not contain); the multiplicative term on the operator sum absorbs
    what running inside the model changes for every kernel alike. A term growing with the batch was tried and
    dropped: fitted on a handful of noisy calibration forwards it over-predicted small decodes by ~30%.
    """
    return np.array([1.0, float(n_records)])


@dataclass
class OverheadModel:
    """``real = alpha * sum(ops) + w . features`` fitted with non-negative least squares per phase.

    ``overlapped`` (an asynchronous device, CUDA): the host queues kernels while the device runs earlier ones,
    so a pass takes the longer of the two, ``max(sum(ops), w . features)``, the host's cost fitted alone.
    """

    coef: dict[str, np.ndarray] = field(default_factory=dict)  # phase -> [alpha, w...]
    n_fit: dict[str, int] = field(default_factory=dict)
    overlapped: bool = False

    def __call__(self, phase: str, ops_sum: float, n_records: int, values: Mapping[str, int]) -> float:
        c = self.coef.get(phase)
        if c is None:
            return ops_sum
        host = float(c[1:] @ overhead_features(n_records, values))
        return max(ops_sum, host) if self.overlapped else float(c[0] * ops_sum) + host

    @classmethod
    def fit(
        cls, rows: Sequence[tuple[str, float, int, Mapping[str, int], float]], overlapped: bool = False
    ) -> OverheadModel:
        """Rows: (phase, predicted op sum, records in the pass, request values, measured forward seconds)."""
        from scipy.optimize import nnls

        out = cls(overlapped=overlapped)
        for phase in ("prefill", "decode"):
            sel = [r for r in rows if r[0] == phase]
            if not sel:
                continue
            # relative least squares (divide by the measurement) so short and long passes weigh alike
            ops = np.array([o for _, o, *_ in sel])
            feats = np.array([overhead_features(n, v) for _, _, n, v, _ in sel])
            y = np.array([m for *_, m in sel])
            if overlapped:
                # the host's cost alone, then again on the forwards the device never held up (alpha is unused)
                w, _ = nnls(feats / y[:, None], np.ones(len(y)))
                kept = ops <= feats @ w
                if 2 <= kept.sum() < len(kept):
                    w, _ = nnls(feats[kept] / y[kept, None], np.ones(int(kept.sum())))
                coef = np.concatenate([[1.0], w])
            else:
                coef, _ = nnls(np.column_stack([ops, feats]) / y[:, None], np.ones(len(y)))
                if coef[0] == 0.0:
                    coef[0] = 1.0
            out.coef[phase] = coef
            out.n_fit[phase] = len(sel)
        return out


#: What :func:`fit_overhead` prices a calibrated model's operators with: ``(name, traces, points, method)`` ->
#: an object with ``ops_latency``, ``records_at``, ``signature_keys`` and ``page_cost_s_per_byte``
#: (:class:`dooly.predict.predictor.Predictor`, passed in by it).
OpsPredictor = Callable[[str, Mapping[str, object], Mapping[str, Sequence], str], Any]


def fit_overhead(
    store,
    ctx,
    engine,
    pts,
    method,
    own: str | None = None,
    exclude: str | None = None,  # type: ignore[no-untyped-def]
    signatures: Collection[str] = (),
    *,
    predictor: OpsPredictor,
    replica: str | None = None,
    own_depth_only: bool = False,
) -> OverheadModel:
    """Fit the framework overhead from the real forwards stored under ``ctx``.

    A model with calibration forwards of its own (``own``; its half-depth ones included, and its check's when the
    check missed) is fitted on those alone: the Python cost around each op differs between architectures (module
    layout, norms, biases). A
    model never run on this machine is fitted on the models whose passes hold every one of its
    ``signatures`` (its architecture at another depth or under another name), else on every model in the DB
    (``exclude``: a model whose forwards are left out, to predict it as if it had never run here).
    ``predictor`` prices each calibrated model's operators (:data:`OpsPredictor`). ``replica``: fit on that
    tensor-parallel replica's forwards alone (``NAME@tpN``, priced with ``engine``, its rank's); without it a
    replica's forwards are never read. ``own_depth_only``: ``own`` fitted on its first round at its own depth (and
    its check) alone, what a missed ``--calibrate check`` measures, though the DB holds more of it.
    """
    from dooly.profile import model_traces
    from dooly.profile.calibrate import CHECK_SUFFIX, REPLICA_MARK

    rows: dict[str, list] = {}  # model -> its rows (every calibration round and depth of it)
    checked: dict[str, list] = {}  # model -> its check's rows: read only for a model with a calibration of its own
    cost = page_cost(store, ctx)
    sigs: dict[str, set[str]] = {}  # model -> the signatures of its passes, over its depths
    by_key: dict[str, Any] = {}
    for key, phase, values, m in store.forwards(ctx):
        if "#holdout" in key or key.startswith("#"):  # validation measurements and machine constants
            continue
        model = key.split("#")[0]
        ours = model == replica if replica is not None else REPLICA_MARK not in model  # one device, or the replica
        if not ours:
            continue
        if exclude is not None and model == exclude:
            continue
        if own_depth_only and model == own and key not in (own, own + CHECK_SUFFIX):
            continue
        # "<name>#round2": another round; "<name>#layers15": a depth; "<name>#check": a check, at its own depth
        variant = re.sub(rf"(#round\d+|{CHECK_SUFFIX})$", "", key)
        if variant not in by_key:
            cfg_json = store.get_trace("config", variant, "config")
            if cfg_json is None:
                continue
            by_key[variant] = predictor(
                variant, model_traces(variant, json.loads(cfg_json), engine, store), pts, method
            )
            by_key[variant].page_cost_s_per_byte = cost  # its forwards paid them too
            sigs.setdefault(model, set()).update(by_key[variant].signature_keys())
        p = by_key[variant]
        row = (phase, p.ops_latency(phase, values), p.records_at(phase, values), values, m.median_s)
        (checked if key.endswith(CHECK_SUFFIX) else rows).setdefault(model, []).append(row)
    for model in rows:  # a check that missed is the first two forwards of the calibration that followed it
        rows[model] += checked.get(model, [])
    overlapped = ctx.hardware.startswith("cuda")

    def fit(models: Collection[str]) -> OverheadModel | None:
        sel = [r for m in models for r in rows[m]]
        return OverheadModel.fit(sel, overlapped) if {r[0] for r in sel} == {"prefill", "decode"} else None

    same = [m for m in rows if signatures and set(signatures) <= sigs[m]]
    for models in ([own] if own in rows else [], same, list(rows)):
        fitted = fit(models) if models else None
        if fitted is not None:
            return fitted
    return OverheadModel(overlapped=overlapped)
