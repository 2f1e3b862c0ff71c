"""Per-signature latency estimators over a profiled grid, and the choice between them by held-out error.

Per signature the profile DB holds a rectilinear grid of request-symbol values and the median latency at
each point. Two estimators are available and chosen by measured error on held-out grid lines:

* ``interp``: piecewise-(multi)linear interpolation of log latency over ``log2(1 + value)`` axes, linear
  extrapolation beyond the grid (each axis apart, never downward: :meth:`GridTable.predict_log`);
* ``forest``: a random forest (as Vidur) on the same log features.

Interpolation tables of all signatures that share a symbol set and grid stack into one :class:`GridTable`
(see :class:`dooly.predict.predictor.Predictor`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from dooly.core.errors import DoolyError


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

    def weights(self, values: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray, list[tuple[float, np.ndarray]]]:
        """Flat corner indices of the grid cell nearest ``values``, the multilinear weights at ``values`` clamped
        into it, and for each axis ``values`` lies past an end of: how far past (in axis units) and the weights of
        the cell's slope along that axis."""
        idx_per_axis, t_per_axis, spans, past = [], [], [], []
        for sym, fa in zip(self.symbols, self._faxes, strict=True):
            if len(fa) == 1:
                idx_per_axis.append((0, 0))
                t_per_axis.append(0.0)
                spans.append(1.0)
                continue
            x = float(_feat(values[sym]))
            j = int(np.clip(np.searchsorted(fa, x) - 1, 0, len(fa) - 2))
            span = float(fa[j + 1] - fa[j])
            t = (x - fa[j]) / span
            inside = min(max(t, 0.0), 1.0)
            idx_per_axis.append((j, j + 1))
            t_per_axis.append(inside)
            spans.append(span)
            if t != inside:
                past.append((len(spans) - 1, (t - inside) * span))
        shape = tuple(len(a) for a in self.axes)
        corners = list(itertools.product((0, 1), repeat=len(self.symbols)))
        flat = [
            np.ravel_multi_index(tuple(idx_per_axis[d][c] for d, c in enumerate(corner)), shape) if shape else 0
            for corner in corners
        ]

        def weight(corner: tuple[int, ...], skip: int = -1) -> float:
            return math.prod((t_per_axis[d] if c else 1.0 - t_per_axis[d]) for d, c in enumerate(corner) if d != skip)

        slopes = [
            (dist, np.asarray([weight(c, d) * (1.0 if c[d] else -1.0) / spans[d] for c in corners])) for d, dist in past
        ]
        return np.asarray(flat), np.asarray([weight(c) for c in corners]), slopes

    def predict_log(self, values: Mapping[str, float]) -> np.ndarray:
        """Interpolated log-latency of every signature in the table at ``values``. Past the grid it goes on from
        the nearest grid point along each axis on its own, at the edge cell's slope, never downward: multilinear
        weights past two ends at once would multiply the slopes' noise (a view op of microseconds once came out at
        hours, extrapolated 30-fold in requests and 70-fold in KV length)."""
        assert self.table is not None
        flat, w, slopes = self.weights(values)
        t = self.table.reshape(len(self.keys), -1)[:, flat]
        out = t @ w
        for dist, dw in slopes:  # more work never costs less (a noisy edge cell's slope can point down)
            out += dist * np.maximum(t @ dw, 0.0)
        return out


def build_grid(points: Sequence[tuple[Mapping[str, float], float]], symbols: tuple[str, ...]):
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
        axes, arr = build_grid(points, symbols)
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
