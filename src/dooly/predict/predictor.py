"""Latency predictor: any signature at any request values, and any engine iteration from them.

Per signature the profile DB holds a rectilinear grid of request-symbol values and the median latency at
each point. Two estimators are available and chosen by measured error on held-out grid lines:

* ``interp``: piecewise-(multi)linear interpolation of log latency over ``log2(1 + value)`` axes, linear
  extrapolation beyond the grid;
* ``forest``: a random forest (as Vidur) on the same log features.

Interpolation tables of all signatures that share a symbol set and grid are stacked, so one iteration's
prediction is a handful of vectorised gathers rather than a Python loop over operators.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np

from dooly.core.batch import Batch
from dooly.core.errors import DoolyError
from dooly.trace.signature import contiguous_stride


def _feat(x: np.ndarray | float) -> np.ndarray:
    """Axis transform: log2(1 + value) keeps 0 (empty KV cache) finite and spacing log-like above 1."""
    return np.log2(1.0 + np.asarray(x, dtype=np.float64))


# ---------------------------------------------------------------------------------------------------------
# Grid tables
# ---------------------------------------------------------------------------------------------------------


@dataclass
class GridTable:
    """Log-latency of many signatures on one rectilinear grid (symbol axes in a fixed order)."""

    symbols: tuple[str, ...]
    axes: tuple[np.ndarray, ...]  # raw grid values per symbol, ascending
    keys: list[str] = field(default_factory=list)
    table: np.ndarray | None = None  # (n_sigs, *grid shape) of log(seconds)

    def __post_init__(self) -> None:
        self._faxes = tuple(_feat(a) for a in self.axes)

    def weights(self, values: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
        """Flat corner indices and multilinear weights (extrapolating linearly past the ends)."""
        idx_per_axis, w_per_axis = [], []
        for sym, fa in zip(self.symbols, self._faxes, strict=True):
            if len(fa) == 1:
                idx_per_axis.append((0, 0))
                w_per_axis.append((1.0, 0.0))
                continue
            x = float(_feat(values[sym]))
            j = int(np.clip(np.searchsorted(fa, x) - 1, 0, len(fa) - 2))
            t = (x - fa[j]) / (fa[j + 1] - fa[j])
            idx_per_axis.append((j, j + 1))
            w_per_axis.append((1.0 - t, t))
        shape = tuple(len(a) for a in self.axes)
        flat, wts = [], []
        for corner in itertools.product((0, 1), repeat=len(self.symbols)):
            ix = tuple(idx_per_axis[d][c] for d, c in enumerate(corner))
            flat.append(np.ravel_multi_index(ix, shape) if shape else 0)
            wts.append(math.prod(w_per_axis[d][c] for d, c in enumerate(corner)))
        return np.asarray(flat), np.asarray(wts)

    def predict_log(self, values: Mapping[str, float]) -> np.ndarray:
        """Interpolated log-latency of every signature in the table at ``values``."""
        assert self.table is not None
        flat, w = self.weights(values)
        t = self.table.reshape(len(self.keys), -1)[:, flat]
        return t @ w


def _build_grid(points: Sequence[tuple[Mapping[str, float], float]], symbols: tuple[str, ...]):
    """Axes and a dense log-latency array from scattered points on a (possibly incomplete) rectilinear grid.

    Missing grid cells (a point that failed or was skipped) take the value of the nearest measured point in
    log-feature space, so a partial grid still predicts (less accurately) instead of failing.
    """
    axes = tuple(np.array(sorted({float(p[s]) for p, _ in points})) for s in symbols)
    shape = tuple(len(a) for a in axes)
    arr = np.full(shape, np.nan)
    coords = []
    for p, lat in points:
        ix = tuple(int(np.searchsorted(a, float(p[s]))) for a, s in zip(axes, symbols, strict=True))
        arr[ix] = math.log(max(lat, 1e-9))
        coords.append(ix)
    if np.isnan(arr).any():
        known = np.array([[_feat(axes[d][i]) for d, i in enumerate(ix)] for ix in coords])
        vals = np.array([arr[ix] for ix in coords])
        for ix in zip(*np.nonzero(np.isnan(arr)), strict=True):
            f = np.array([_feat(axes[d][i]) for d, i in enumerate(ix)])
            arr[ix] = vals[int(np.argmin(((known - f) ** 2).sum(axis=1)))]
    return axes, arr


class GridEstimator:
    """``interp``: piecewise-(multi)linear interpolation of log latency over the signature's grid. Its tables
    stack: a predictor batches every signature of a symbol set and grid into one :class:`GridTable`."""

    stacks = True

    def __init__(self, symbols: tuple[str, ...], points: Sequence[tuple[Mapping[str, float], float]]) -> None:
        axes, arr = _build_grid(points, symbols)
        self.grid = GridTable(symbols, axes, ["_"], arr[None, ...])

    def __call__(self, values: Mapping[str, float]) -> float:
        return float(np.exp(self.grid.predict_log(values)[0]))


class ForestEstimator:
    """``forest``: a random forest (as Vidur) on the same log features; called one signature at a time."""

    stacks = False

    def __init__(self, symbols: tuple[str, ...], points: Sequence[tuple[Mapping[str, float], float]]) -> None:
        from sklearn.ensemble import RandomForestRegressor

        self.symbols = symbols
        X = np.array([[_feat(p[s]) for s in symbols] or [0.0] for p, _ in points])
        y = np.log(np.maximum([lat for _, lat in points], 1e-9))
        self.forest = RandomForestRegressor(n_estimators=30, min_samples_leaf=1, random_state=0).fit(X, y)

    def __call__(self, values: Mapping[str, float]) -> float:
        x = np.array([[float(_feat(values[s])) for s in self.symbols] or [0.0]])
        return float(np.exp(self.forest.predict(x)[0]))


#: Each predictor method by name: the estimator class of one signature's latency over its request symbols,
#: built from ``(symbols, points)``. A new method is a class with ``stacks`` and ``__call__``, and one line here.
PREDICTOR_METHODS: Mapping[str, type[GridEstimator] | type[ForestEstimator]] = MappingProxyType(
    {"interp": GridEstimator, "forest": ForestEstimator}
)


def predictor_method(name: str) -> type[GridEstimator] | type[ForestEstimator]:
    """The estimator class of the method ``name``, else one error naming the known methods."""
    cls = PREDICTOR_METHODS.get(name)
    if cls is None:
        raise DoolyError(f"unknown predictor method {name!r} (known: {', '.join(PREDICTOR_METHODS)})")
    return cls


class SignatureModel:
    """Latency of one signature as a function of its request symbols."""

    def __init__(
        self, symbols: Sequence[str], points: Sequence[tuple[Mapping[str, float], float]], method: str = "interp"
    ) -> None:
        if not points:
            raise DoolyError("signature has no profiled points")
        self.symbols = tuple(sorted(symbols))
        self.method = method
        self.estimator = predictor_method(method)(self.symbols, points)

    def __call__(self, values: Mapping[str, float]) -> float:
        return self.estimator(values)


def holdout_errors(
    symbols: Sequence[str], points: Sequence[tuple[Mapping[str, float], float]], method: str
) -> list[float]:
    """Relative errors predicting each interior grid line from a model fitted without it.

    Dropping a whole interior value of one axis keeps the rest a rectilinear grid, so both estimators are
    judged on points they never saw, at twice the grid's spacing (a pessimistic bound for the real grid).
    """
    errs: list[float] = []
    for s in symbols:
        vals = sorted({float(p[s]) for p, _ in points})
        for v in vals[1:-1]:
            train = [(p, t) for p, t in points if float(p[s]) != v]
            test = [(p, t) for p, t in points if float(p[s]) == v]
            model = SignatureModel(symbols, train, method)
            errs.extend(abs(model(p) - t) / t for p, t in test)
    return errs


# ---------------------------------------------------------------------------------------------------------
# Framework overhead: what a real forward costs beyond the sum of its operators
# ---------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------
# Page faults: what a CPU op pays for an output too large for the allocator to reuse
# ---------------------------------------------------------------------------------------------------------

#: Request values at which a signature's output is sized to screen it for page faults (outputs grow with them).
_SCREEN_VALUES = {"requests": 256, "tokens": 16384, "kv_len": 16384}
_FRESH_BYTES: dict[tuple[str, tuple], int] = {}


def fresh_output_bytes(sig: object, values: Mapping[str, int]) -> int:
    """Bytes of new storage the op allocates for its outputs at ``values``, from a call on meta tensors; 0
    where the op has no meta implementation."""
    key = (sig.key, tuple(sorted(values.items())))  # type: ignore[attr-defined]
    hit = _FRESH_BYTES.get(key)
    if hit is not None:
        return hit
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    full = {"requests": 1, "tokens": 1, "kv_len": 0, **values}
    try:
        args, kwargs = sig.build_call(  # type: ignore[attr-defined]
            full,
            lambda _i, spec, shape, stride: torch.empty_strided(
                shape,
                stride if stride is not None else contiguous_stride(shape),
                dtype=getattr(torch, spec.dtype),
                device="meta",
            ),
        )
        args, kwargs = tree_map(lambda x: torch.device("meta") if isinstance(x, torch.device) else x, (args, kwargs))
        ns, op, overload = sig.op.split(".")  # type: ignore[attr-defined]
        with torch.no_grad():
            out = getattr(getattr(getattr(torch.ops, ns), op), overload)(*args, **kwargs)
        # an output sharing an input's storage (a view, _unsafe_view, an in-place op) allocates nothing
        ins = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        outs = {
            t.untyped_storage()._cdata: t.untyped_storage().nbytes()
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)
        }
        n = sum(b for k, b in outs.items() if k not in ins)
    except Exception:  # no meta kernel, or an op that needs real data: no fault term for it
        n = 0
    if len(_FRESH_BYTES) >= 100_000:  # one entry per signature and request size: bounded for long-lived processes
        _FRESH_BYTES.clear()
    _FRESH_BYTES[key] = n
    return n


# ---------------------------------------------------------------------------------------------------------
# The predictor of one model
# ---------------------------------------------------------------------------------------------------------


class Predictor:
    """Latency of one model's forward passes and engine iterations, from the profile DB.

    ``Predictor.for_model("SmolLM2-135M", "profiles.db").iteration_latency(Batch(...))`` -> seconds.
    """

    def __init__(
        self,
        name: str,
        traces: Mapping[str, object],
        points: Mapping[str, Sequence[tuple[Mapping[str, float], float]]],
        method: str = "interp",
        overhead: OverheadModel | None = None,
    ) -> None:
        self.name = name
        self.traces = dict(traces)
        self.method = method
        predictor_method(method)  # an unknown name fails here, not halfway through the passes
        self.overhead = overhead or OverheadModel()
        self.n_records: dict[str, int] = {}
        self._passes: dict[str, object] = {}  # pass key (branch_key) -> its trace
        # per phase: the signatures with their multiplicities, grouped by symbol set into stacked tables
        self._groups: dict[str, list[tuple[GridTable, np.ndarray]]] = {}
        self._singles: dict[str, list[tuple[SignatureModel, int]]] = {}  # signatures of a method that does not stack
        self.missing: dict[str, list[str]] = {}
        # a phase whose code branches on a request size has one pass per branch (the trace's sides): each is
        # priced where its guards hold, under its own key (branch_key)
        for phase, tr in self.traces.items():
            self.missing[phase] = sorted({str(s) for s in tr.all_unique() if not points.get(s.key)})  # type: ignore[attr-defined]
            for key, branch in zip(_branch_keys(phase, tr), tr.branches(), strict=True):  # type: ignore[attr-defined]
                self._add_pass(key, branch, points, method)
        self._memo: dict[object, float] = {}
        self.flattens_batches = False  # set by for_model from the engine (see iteration_latency)
        # filled by for_model(shape=True): per pass, the signatures predicted from shape alone (never measured)
        self.shape_predicted: dict[str, list[ShapeFill]] = {}
        # seconds per byte of fresh pages (set by for_model from the DB on a CPU: the op profiles leave them
        # out, see dooly.profile.timing.reused_pages), and per pass the signatures whose outputs can need them
        self.page_cost_s_per_byte = 0.0
        self._large_outputs: dict[str, list[tuple[object, int]]] = {}

    def signature_keys(self) -> set[str]:
        """Every operator signature of the model's passes (all phases and branches)."""
        return _signature_keys(self.traces)

    def branch_key(self, phase: str, values: Mapping[str, int]) -> str:
        """The pass the engine runs in ``phase`` at ``values``: the phase, or ``phase/i`` for its i-th side."""
        tr = self.traces.get(phase)
        if tr is None or not tr.sides:  # type: ignore[attr-defined]
            return phase
        branch = tr.at(values)  # type: ignore[attr-defined]
        return _branch_keys(phase, tr)[next(i for i, b in enumerate(tr.branches()) if b is branch)]  # type: ignore[attr-defined]

    def _add_pass(self, key: str, tr: object, points: Mapping[str, Sequence], method: str) -> None:
        """Index one pass's signatures (with multiplicities) under ``key``, grouped by symbol set."""
        uniq = tr.unique()  # type: ignore[attr-defined]
        self._passes[key] = tr
        self.n_records[key] = len(tr.records)  # type: ignore[attr-defined]
        by_syms: dict[tuple, list] = {}
        for s, mult in uniq.items():
            pts = points.get(s.key)
            if not pts:
                continue
            syms = tuple(sorted(s.symbols()))
            if not predictor_method(method).stacks:
                self._singles.setdefault(key, []).append((SignatureModel(syms, pts, method), mult))
                continue
            axes, arr = _build_grid(pts, syms)
            gkey = (syms, tuple(tuple(a) for a in axes))
            by_syms.setdefault(gkey, []).append((s.key, arr, mult))
        groups = []
        for (syms, axes), members in by_syms.items():
            g = GridTable(syms, tuple(np.array(a) for a in axes), [k for k, _, _ in members])
            g.table = np.stack([a for _, a, _ in members])
            groups.append((g, np.array([m for *_, m in members], dtype=np.float64)))
        self._groups[key] = groups

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def for_model(
        cls,
        model: str | Mapping[str, object],
        db_path: str | Path,
        engine: object | None = None,
        *,
        threads: int | None = None,
        method: str = "auto",
        strict: bool = True,
        shape: bool = False,
        holdout: bool = False,
        unmeasured: Collection[str] = (),
    ) -> Predictor:
        """A predictor for ``model`` (zoo name, config path or dict) from the profile DB at ``db_path``.

        ``method``: ``interp``, ``forest`` or ``auto`` (whichever had the lower held-out error on this DB).
        ``strict``: refuse when a signature of the model is not completely profiled (else a missing one counts
        as zero and a partial grid is filled from its nearest measured points).
        ``shape``: predict a signature without a complete profile from the shape model of its operator kind
        (:mod:`dooly.db.shape_model`; listed in ``shape_predicted``); one whose kind has no model is still missing.
        ``holdout``: predict the model as if it had never been profiled (zero new points): the signatures no
        other profiled model needs are left out of the DB and of the shape fit, and the model's calibration
        forwards out of the overhead fit. Implies ``shape``.
        ``unmeasured``: signatures treated as never profiled (what ``dooly profile --budget`` would have left
        to the shape model), predicted from shape. Implies ``shape``.
        """
        from dooly.core.zoo import resolve_model
        from dooly.db.store import ProfileStore
        from dooly.engines import get_engine
        from dooly.profile import context_for, default_threads, model_traces

        if method != "auto" and method not in PREDICTOR_METHODS:
            raise DoolyError(f"unknown predictor method {method!r} (known: auto, {', '.join(PREDICTOR_METHODS)})")
        if not Path(db_path).exists():
            raise DoolyError(f"{db_path}: no such profile database (run `dooly profile` first)")
        engine = engine or get_engine()
        threads = threads if threads is not None else default_threads()
        name, cfg = resolve_model(model)  # type: ignore[arg-type]
        with ProfileStore(db_path, readonly=True) as store:
            ctx = context_for(engine, threads)  # type: ignore[arg-type]
            traces = model_traces(name, cfg, engine, store)  # type: ignore[arg-type]
            raw = store.all_points(ctx)
            complete = store.complete_keys(ctx)
            pts = {k: [(p, m.median_s) for p, m in v] for k, v in raw.items()}
            fills: dict[str, list[ShapeFill]] = {}
            held = set(unmeasured)
            if holdout:
                held |= own_signatures(store, ctx, name, traces)
            shape = shape or bool(held) or holdout
            if shape:
                measured = {k: v for k, v in pts.items() if k in complete and k not in held}
                fills, synth = shape_fill(traces, measured, store, ctx, cfg, held)
                pts_model = {**{k: v for k, v in pts.items() if k not in held}, **synth}
                complete = (complete - held) | set(synth)
            else:
                pts_model = pts
            if strict and holdout:
                _require_holdout_covered(store, ctx, traces, pts_model, name, db_path)
            if strict:
                _require_complete(traces, pts_model, complete, name, model, db_path, ctx.hardware)
            if method == "auto":
                method = choose_method({k: v for k, v in pts.items() if k not in held})
            pred = cls(name, traces, pts_model, method)
            pred.flattens_batches = engine.flattens_batches  # type: ignore[attr-defined]
            pred.shape_predicted = fills
            pred.page_cost_s_per_byte = page_cost(store, ctx)
            # with the shape model's points: a --budget profile's own calibration forwards ran every signature
            pred.overhead = fit_overhead(
                store,
                ctx,
                engine,
                pts_model,
                method,
                own=None if holdout else name,
                exclude=name if holdout else None,
                signatures=pred.signature_keys(),
            )
        return pred

    def shape_share(self, phase: str, values: Mapping[str, int]) -> tuple[float, float]:
        """Of the operator time at ``values``: the share predicted from shape alone, and its uncertainty
        relative to the whole (each shape-predicted signature's interval, summed as if fully correlated)."""
        fills = self.shape_predicted.get(self.branch_key(phase, values), [])
        if not fills:
            return 0.0, 0.0
        total = self.ops_latency(phase, values)
        shaped = unc = 0.0
        for f in fills:
            t = f.mult * float(f.model(values))
            shaped += t
            unc += t * f.rel_uncertainty
        return shaped / total, unc / total

    # -- prediction ---------------------------------------------------------------------------------------
    def ops_latency(self, phase: str, values: Mapping[str, int]) -> float:
        """Sum over the pass's operators (with multiplicities) at the given request values."""
        total = 0.0
        phase = self.branch_key(phase, values)
        for g, mult in self._groups.get(phase, []):
            total += float(np.exp(g.predict_log(values)) @ mult)
        for model, mult in self._singles.get(phase, []):
            total += model(values) * mult
        return total + self.page_faults(phase, values)

    def page_faults(self, phase: str, values: Mapping[str, int]) -> float:
        """Seconds the pass spends faulting in fresh pages: for every op output above the allocator's mmap
        ceiling (reused below it in a running engine, so free), its bytes at the machine's measured cost.
        ``phase`` is a pass key (:meth:`branch_key`)."""
        if not self.page_cost_s_per_byte:
            return 0.0
        from dooly.profile.timing import MMAP_MAX_BYTES

        if phase not in self._large_outputs:
            self._large_outputs[phase] = [
                (s, m)
                for s, m in self._passes[phase].unique().items()  # type: ignore[attr-defined]
                if fresh_output_bytes(s, _SCREEN_VALUES) >= MMAP_MAX_BYTES
            ]
        nbytes = 0
        for s, mult in self._large_outputs[phase]:
            b = fresh_output_bytes(s, values)
            nbytes += mult * b if b >= MMAP_MAX_BYTES else 0
        return nbytes * self.page_cost_s_per_byte

    def records_at(self, phase: str, values: Mapping[str, int]) -> int:
        """Operator calls of the pass the engine runs in ``phase`` at ``values``."""
        return self.n_records.get(self.branch_key(phase, values), 0)

    def forward_latency(self, phase: str, values: Mapping[str, int]) -> float:
        """One engine forward pass: operators plus the fitted framework overhead."""
        key = (phase, tuple(sorted(values.items())))
        hit = self._memo.get(key)
        if hit is None:
            ops = self.ops_latency(phase, values)
            hit = self._memo[key] = self.overhead(phase, ops, self.records_at(phase, values), values)
        return hit

    def iteration_latency(self, batch: Batch) -> float:
        """Seconds for one engine iteration, as the HF eager engine runs it (see :mod:`dooly.engines.hf_serving`):
        each prefill chunk is a forward of batch 1 over its new tokens; all decodes are one forward of batch
        B over KV padded to the longest. A chunk's cached prefix is not modelled beyond its new tokens (the
        traces have no phase with both new and cached tokens yet).

        An engine that flattens its batches (vLLM) runs one forward over all scheduled tokens: priced as one
        prefill pass over them (the GEMMs, norms and activations, which read the weights once per iteration,
        are then exact; attention is counted as one causal sequence of that length), plus what the decodes'
        KV adds to their attention (their decode pass at their KV length minus the same pass at the smallest
        profiled KV length), plus, for a later chunk of a prompt, its new tokens' attention over the cached prefix
        (:meth:`prefix_attention`)."""
        if self.flattens_batches and batch.prefill:
            total = self.forward_latency("prefill", {"requests": 1, "tokens": batch.num_tokens})
            total += sum(self.prefix_attention(new, cached) for new, cached in batch.prefill if cached)
            if batch.decode:
                b, kv = len(batch.decode), max(batch.decode)
                base = min(kv, _flat_kv_base())
                total += max(
                    0.0,
                    self.forward_latency("decode", {"requests": b, "kv_len": kv})
                    - self.forward_latency("decode", {"requests": b, "kv_len": base}),
                )
            return total
        total = 0.0
        for new, _cached in batch.prefill:
            total += self.forward_latency("prefill", {"requests": 1, "tokens": new})
        if batch.decode:
            total += self.forward_latency("decode", {"requests": len(batch.decode), "kv_len": max(batch.decode)})
        return total

    def prefix_attention(self, new: int, cached: int) -> float:
        """What ``new`` tokens attending over ``cached`` ones add to a pass that prices them as a sequence of
        their own: with a prefill pass F(t) = c0 + g t + a t^2 / 2 (per-token work plus causal attention),
        F(cached + new) - F(cached) - F(new) + c0 = a * cached * new, the cross term; c0 ~ F(1)."""

        def f(tokens: int) -> float:
            return self.forward_latency("prefill", {"requests": 1, "tokens": tokens})

        return max(0.0, f(cached + new) - f(cached) - f(new) + f(1))


def _flat_kv_base() -> int:
    """The smallest decode KV length of the default profiling grid (below it a decode pass is not profiled)."""
    from dooly.profile import GridSpec  # on use, as in for_model: the profiler package pulls in the engines

    return min(GridSpec().decode_kv_len)


def page_cost(store, ctx) -> float:  # type: ignore[no-untyped-def]
    """Seconds per byte of fresh pages on the machine of ``ctx`` (0 where ``dooly profile`` measured none:
    a GPU, a DB profiled on a Ray cluster)."""
    from dooly.profile.timing import PAGE_COST_KEY

    rows = store.forwards(ctx, PAGE_COST_KEY[0])
    return rows[0][3].median_s / rows[0][2]["bytes"] if rows else 0.0


def _signature_keys(traces: Mapping[str, object]) -> set[str]:
    """Every signature key of a model's traced passes (all phases and branches)."""
    return {s.key for tr in traces.values() for s in tr.all_unique()}  # type: ignore[attr-defined]


def _require_holdout_covered(store, ctx, traces, pts_model, name: str, db_path) -> None:  # type: ignore[no-untyped-def]
    """Refuse a zero-new-points predictor with signatures no shape model covers, saying why: profiling the
    model again would not help, its own points are what is held out."""
    n = sum(1 for k in _signature_keys(traces) if not pts_model.get(k))
    if not n:
        return
    from dooly.profile.savings import profiled_models

    if not any(m.name != name for m in profiled_models(store, ctx)):
        raise DoolyError(
            f"{db_path}: it holds no profiled model but {name}, so nothing to predict "
            "it from with zero new points (profile other models into it)"
        )
    raise DoolyError(
        f"{db_path}: {n} signatures of {name} are of operator kinds no shape model "
        "covers (the DB's other models measured too few signatures of them), so they "
        "cannot be predicted from shape alone"
    )


def _require_complete(traces, points, complete, name, model, db_path, hardware) -> None:  # type: ignore[no-untyped-def]
    """Refuse a model with a signature that has no profile, or one whose planned grid is not all stored."""
    keys = _signature_keys(traces)
    from dooly.db.store import profile_command

    again = profile_command(model, db_path, name)
    missing = sum(1 for k in keys if not points.get(k))
    if missing:
        raise DoolyError(f"{db_path}: {missing} signatures of {name} have no profile for {hardware} (run `{again}`)")
    unfinished = len(keys - complete)
    if unfinished:
        raise DoolyError(
            f"{db_path}: the profile of {name} is incomplete for {hardware} ({unfinished} of {len(keys)} signatures "
            f"lack planned points): finish it with `{again}`"
        )


def choose_method(points: Mapping[str, Sequence[tuple[Mapping[str, float], float]]], sample: int = 40) -> str:
    """The method with the lowest held-out MAPE on (a sample of) the DB's signatures (``interp`` on a tie, or
    when some method could not be scored)."""
    errs = method_errors(points, sample)
    if not all(errs.values()):
        return "interp"
    return min(errs, key=lambda m: float(np.mean(errs[m])))  # the first (interp) on a tie


def method_errors(
    points: Mapping[str, Sequence[tuple[Mapping[str, float], float]]], sample: int = 40
) -> dict[str, list[float]]:
    """Held-out relative errors of every method over up to ``sample`` multi-point signatures."""
    keys = sorted(k for k, v in points.items() if len(v) >= 3)
    rng = np.random.default_rng(0)
    if len(keys) > sample:
        keys = list(rng.choice(keys, size=sample, replace=False))
    out: dict[str, list[float]] = {m: [] for m in PREDICTOR_METHODS}
    for k in keys:
        syms = tuple(sorted(points[k][0][0]))
        for meth in out:
            out[meth].extend(holdout_errors(syms, points[k], meth))
    return out


def fit_overhead(
    store,
    ctx,
    engine,
    pts,
    method,
    own: str | None = None,
    exclude: str | None = None,  # type: ignore[no-untyped-def]
    signatures: Collection[str] = (),
) -> OverheadModel:
    """Fit the framework overhead from the real forwards stored under ``ctx``.

    A model with calibration forwards of its own (``own``; its half-depth ones included) is fitted on those
    alone: the Python cost around each op differs between architectures (module layout, norms, biases). A
    model never run on this machine is fitted on the models whose passes hold every one of its
    ``signatures`` (its architecture at another depth or under another name), else on every model in the DB
    (``exclude``: a model whose forwards are left out, to predict it as if it had never run here).
    """
    from dooly.profile import model_traces

    rows: dict[str, list] = {}  # model -> its rows (every calibration round and depth of it)
    cost = page_cost(store, ctx)
    sigs: dict[str, set[str]] = {}  # model -> the signatures of its passes, over its depths
    by_key: dict[str, Predictor] = {}
    for key, phase, values, m in store.forwards(ctx):
        if "#holdout" in key or key.startswith("#"):  # validation measurements and machine constants
            continue
        model = key.split("#")[0]
        if exclude is not None and model == exclude:
            continue
        variant = re.sub(r"#round\d+$", "", key)  # "<name>#round2": another round; "<name>#layers15": a depth
        if variant not in by_key:
            cfg_json = store.get_trace("config", variant, "config")
            if cfg_json is None:
                continue
            by_key[variant] = Predictor(
                variant, model_traces(variant, json.loads(cfg_json), engine, store), pts, method
            )
            by_key[variant].page_cost_s_per_byte = cost  # its forwards paid them too
            sigs.setdefault(model, set()).update(by_key[variant].signature_keys())
        p = by_key[variant]
        rows.setdefault(model, []).append(
            (phase, p.ops_latency(phase, values), p.records_at(phase, values), values, m.median_s)
        )
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


# ---------------------------------------------------------------------------------------------------------
# Signatures predicted from shape alone (dooly.db.shape_model)
# ---------------------------------------------------------------------------------------------------------


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
    return _signature_keys(traces) - others


def shape_fill(traces, measured, store, ctx, config, exclude=()):  # type: ignore[no-untyped-def]
    """Shape-model points for every signature of ``traces`` not in ``measured``, on the default grid within the
    model's positions: ``({phase: [ShapeFill]}, {key: [(values, seconds)]})``. The shape model is fitted on
    ``measured`` less ``exclude``; a signature whose kind it does not cover is left out (still missing)."""
    from dooly.core.zoo import max_positions
    from dooly.db.shape_model import ShapeModel, signatures_of
    from dooly.profile.plan import GridSpec

    model = ShapeModel.fit(signatures_of(store, ctx, measured), measured, exclude)
    grid = GridSpec().within(max_positions(config))
    fills: dict[str, list[ShapeFill]] = {}
    synth: dict[str, list[tuple[dict[str, int], float]]] = {}
    unc: dict[str, float] = {}
    for phase, tr in traces.items():
        for key, branch in zip(_branch_keys(phase, tr), tr.branches(), strict=True):
            for sig, mult in branch.unique().items():
                if sig.key in measured or not model.covers(sig):
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


def _branch_keys(phase: str, trace: object) -> list[str]:
    """Keys of a phase's passes: the phase for the trace itself, ``phase/i`` for its i-th side."""
    return [phase] + [f"{phase}/{i}" for i in range(1, len(trace.branches()))]  # type: ignore[attr-defined]
