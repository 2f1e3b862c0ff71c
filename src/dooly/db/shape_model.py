"""Shape-generic operator models: the latency of a signature never profiled, from its shapes alone.

Every point in the profile DB is one operator at one concrete shape. Per operator **kind** (engine, aten
overload, input dtypes and ranks, a matmul's operand layouts, the non-numeric arguments such as a causal flag) the
points of all signatures of that kind are pooled and one small model is fitted over shape-derived work measures:

* ``flops``: ``2·M·N·K`` (times the batch) for a matmul or linear, ``4·B·H·L·S·D`` for attention, the element count
  for everything else (an elementwise op's: its inputs' broadcast shape);
* ``bytes``: what the call reads and writes (inputs, plus the output as large as the largest input or an elementwise
  op's broadcast shape, or a matmul's ``M·N``; attention reads the keys and values once per query head,
  ``B·H·(2·L + 2·S)·D``, however few KV heads store them);
* ``tasks``: attention's batch x heads (its kernels split the work per sequence and head, each with a fixed
  cost); zero for every other op;
* ``gemv``: the bytes of a matmul or linear whose left operand has one row (a decode step of one request), zero
  otherwise: the CPU libraries run such a call as a matrix-vector product, a kernel of its own that streams the
  weights slower than two or more rows do (Mistral 7B's 4096 x 14336 projection: 10.3 ms at one request, 9.7 ms at
  three), which no smooth law over flops and bytes can follow;

Two forms are fitted, each with numpy least squares, and the one with the lower leave-one-signature-out
error is kept per kind:

* ``roofline``: ``t = c0 + c1·flops + c2·bytes + c3·tasks + c4·gemv`` with non-negative coefficients, fitted in
  relative error (a fixed launch cost plus a compute and a memory rate);
* ``loglog``: ``log t = a + b·log(1 + flops) + c·log(1 + bytes) + d·log(1 + tasks) + e·log(1 + gemv)``
  (efficiency that changes with size), its exponents non-negative.

**Uncertainty.** Each kind keeps the spread of its leave-one-signature-out residuals (``sigma``: RMS of the
log error when each signature is predicted by a fit that never saw it), widened for a signature whose
shapes lie outside the fitted ones by the leverage of its points in log-feature space: a prediction
interval ``exp(± sigma · sqrt(1 + h))``. A kind with fewer than :data:`MIN_SIGNATURES` signatures has no
model; the signature then falls back to its coarse kind (engine, overload, dtypes), then to a family of
overloads that cost alike whatever their name (:func:`family_kinds_of`: views, factories, and elementwise operators
by dtypes, then of any dtype), pooled and fitted in the roofline form only; the family's leave-one-signature-out
spread says how far apart its members are. With no model there either it must be profiled.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dooly.trace.signature import Signature

#: A kind needs this many profiled signatures for a model (leave-one-signature-out needs two to say anything).
MIN_SIGNATURES = 2
_MAX_SIGMA = 3.0  # log-space: an interval past x20 says "unknown" as well as any wider one

_MATMUL = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}
_ITEMSIZE = {
    "float64": 8,
    "int64": 8,
    "complex64": 8,
    "float32": 4,
    "int32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def kind_of(sig: Signature) -> str:
    """What must match for two signatures to share a shape model: engine, overload, input dtypes and ranks, a
    matmul's operand layouts, and the arguments that are not numbers (flags, dtypes), with every number replaced by
    ``#``."""

    def skeleton(x: object) -> object:
        if isinstance(x, list):
            return [skeleton(y) for y in x]
        if isinstance(x, dict):
            if set(x) == {"sym"}:
                return "#"
            if set(x) == {"tensor"}:
                return x
            return {k: skeleton(v) for k, v in x.items()}
        # sizes, dims, offsets and scalars are numbers: the shapes carry what matters about them
        return "#" if isinstance(x, int | float) and not isinstance(x, bool) else x

    args = skeleton(json.loads(sig.args))
    ins = ",".join(f"{t.dtype}/{len(t.shape)}" for t in sig.inputs)
    return f"{sig.engine}|{sig.op}|{ins}{_layouts(sig)}|{json.dumps(args, sort_keys=True)}"


def coarse_kind_of(sig: Signature) -> str:
    """The fallback when a kind has too few signatures: engine, overload and input dtypes only (a causal and a
    plain attention, or a 3-d and a 4-d add, then share one model; its wider error says so); a matmul keeps its
    operands' layouts."""
    return f"{sig.engine}|{sig.op}|{','.join(t.dtype for t in sig.inputs)}{_layouts(sig)}"


def _layouts(sig: Signature) -> str:
    """A matmul's two matrix operands' layouts, ``"/n,t"``: ``n`` rows contiguous (row-major, or a slice of rows),
    ``t`` columns contiguous (a transposed view), ``s`` anything else; empty for any other op.

    The CPU libraries pick their kernels by layout: GPT-2's Conv1D passes ``addmm`` its weight as stored, K x N,
    where ``nn.Linear`` passes a transposed N x K view, and the same shapes then stream at about 7 GB/s against 11
    (GPT-2 large's projections at three requests), which no law fitted on one layout can know."""
    if sig.op not in _MATMUL or len(sig.inputs) < 2:
        return ""

    def layout(stride: tuple[object, ...] | None) -> str:
        if stride is None or stride[-1] == 1:
            return "n"
        return "t" if len(stride) >= 2 and stride[-2] == 1 else "s"

    return "/" + ",".join(layout(t.stride) for t in sig.inputs[-2:])


def family_kinds_of(sig: Signature) -> tuple[str, ...]:
    """The last fallbacks, in order, of an operator whose own and coarse kinds have no model: families of
    overloads that cost alike whatever their name.

    * a **view** (PyTorch's schema says the result aliases an input: ``permute``, ``unsqueeze``, ``t``...) moves no
      data, a dispatch cost of a microsecond or two: ``engine|view``;
    * a **factory** (no tensor input: ``arange``, ``full``) writes the elements its arguments size:
      ``engine|factory``;
    * an elementwise operator (PyTorch tags the overload ``pointwise``) streams its elements through memory:
      first the family of its input dtypes, ``engine|pointwise|bfloat16,bool``, then every dtype pooled,
      ``engine|pointwise|*`` (the bytes measure already weighs each dtype's size).
    Any other operator has none."""
    kind = _op_family(sig.op)
    if kind == "view":
        return (f"{sig.engine}|view",)
    if not sig.inputs:
        return (f"{sig.engine}|factory",)
    if kind == "pointwise":
        return (f"{sig.engine}|pointwise|{','.join(t.dtype for t in sig.inputs)}", f"{sig.engine}|pointwise|*")
    return ()


@functools.cache
def _op_family(op: str) -> str | None:
    """The family of the overload named ``op`` ("aten.tanh.default") by its schema and PyTorch's tags: "view",
    "pointwise", or None for any other (or an overload torch does not know)."""
    import torch

    try:
        ns, name, overload = op.split(".")
        packet = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (ValueError, AttributeError, RuntimeError):
        return None
    returns = packet._schema.returns
    alias = returns[0].alias_info if returns else None
    if alias is not None and not alias.is_write:
        return "view"
    return "pointwise" if torch.Tag.pointwise in packet.tags else None


def work(sig: Signature, values: Mapping[str, int]) -> tuple[float, float, float]:
    """``(flops, bytes, tasks)`` of one call of ``sig`` at request ``values`` (see the module docstring)."""
    return features(sig, values)[:3]


def features(sig: Signature, values: Mapping[str, int]) -> tuple[float, float, float, float]:
    """``(flops, bytes, tasks, gemv)`` of one call of ``sig`` at request ``values``: :func:`work` plus, for a
    matmul or linear with one row, its bytes again (see the module docstring)."""
    shapes, args = sig.concrete(values)
    numels = [math.prod(s) for s, _ in shapes]
    sizes = [_ITEMSIZE.get(t.dtype, 4) for t in sig.inputs]
    read = float(sum(n * b for n, b in zip(numels, sizes, strict=True)))
    item = sizes[0] if sizes else 4
    if sig.op in _MATMUL and len(shapes) >= 2:
        a, b = shapes[-2][0], shapes[-1][0]  # addmm/baddbmm: (bias, a, b)
        m, k, n = a[-2], a[-1], b[-1]
        batch = math.prod(a[:-2])
        moved = read + batch * m * n * item
        return 2.0 * batch * m * n * k, moved, 0.0, moved if m == 1 else 0.0
    if sig.op == "aten.linear.default" and len(shapes) >= 2:
        x, w = shapes[0][0], shapes[1][0]  # x (..., K) @ w (N, K)^T
        rows, n, k = math.prod(x[:-1]), w[0], x[-1]
        moved = read + rows * n * item
        return 2.0 * rows * n * k, moved, 0.0, moved if rows == 1 else 0.0
    if "scaled_dot_product" in sig.op and len(shapes) >= 3:
        q, k = shapes[0][0], shapes[1][0]
        batch_heads, length, dim, kv_len = math.prod(q[:-2]), q[-2], q[-1], k[-2]
        # the kernels run per (sequence, query head), and each reads its KV head's keys and values in full: with
        # grouped-query attention the KV heads set what is stored, the query heads what is read
        moved = batch_heads * (2 * length + 2 * kv_len) * dim * item  # q and the output, then K and V per q head
        return 4.0 * batch_heads * length * kv_len * dim, float(moved), float(batch_heads), 0.0
    # elementwise, reductions, copies, creation ops: the element count (a creation op's size is in its args)
    sym_ints: list[int] = []

    def grab(x: object) -> None:
        if isinstance(x, int) and not isinstance(x, bool):
            sym_ints.append(x)
        elif isinstance(x, list):
            for y in x:
                grab(y)

    grab(args.get("args", []) if isinstance(args, dict) else [])
    elements = float(max(numels + [abs(v) for v in sym_ints if abs(v) < 2**40] + [1]))
    if len(shapes) >= 2 and _op_family(sig.op) == "pointwise":
        # an elementwise op writes its inputs' broadcast shape, which can outgrow every input: a (B, H, 1, L) bias
        # masked by a (B, 1, L, L) mask fills (B, H, L, L)
        try:
            elements = max(elements, float(math.prod(np.broadcast_shapes(*(tuple(s) for s, _ in shapes)))))
        except ValueError:
            pass
    return elements, read + elements * item, 0.0, 0.0


def signature_rows(sig: Signature, pts: Sequence[tuple[Mapping[str, float], float]]) -> tuple[np.ndarray, np.ndarray]:
    """A signature's profiled points as a kind's fit takes them: work rows (`features`) and seconds."""
    fb = np.array([features(sig, {s: int(v) for s, v in p.items()}) for p, _ in pts])
    return fb, np.maximum(np.array([lat for _, lat in pts], dtype=np.float64), 1e-9)


def _features(fb: np.ndarray) -> np.ndarray:
    """Log-space design of work rows: ``[1, log(1 + flops), log(1 + bytes), ...]``."""
    return np.column_stack([np.ones(len(fb)), np.log1p(fb)])


@dataclass
class _Fit:
    form: str  # "roofline" or "loglog"
    coef: np.ndarray

    def predict(self, fb: np.ndarray) -> np.ndarray:
        if self.form == "roofline":
            return np.column_stack([np.ones(len(fb)), fb]) @ self.coef
        return np.exp(_features(fb) @ self.coef)


def _fit(form: str, fb: np.ndarray, t: np.ndarray) -> _Fit:
    if form == "roofline":
        from scipy.optimize import nnls

        A = np.column_stack([np.ones(len(fb)), fb]) / t[:, None]  # relative least squares
        scale = np.maximum(A.max(axis=0), 1e-300)
        coef, _ = nnls(A / scale, np.ones(len(t)))
        coef = coef / scale
        if not coef.any():
            coef[0] = float(np.median(t))
        return _Fit(form, coef)
    # slopes non-negative (an op does not get faster as its work grows): a free fit of a size that hardly moves
    # in the kind's points (a rotary cache's rows, one per model) can take any sign and, far from those points,
    # predict a smaller cache to cost a hundred times more; the intercept is free (its +1 and -1 columns)
    from scipy.optimize import nnls

    X = _features(fb)
    coef, _ = nnls(np.column_stack([X[:, :1], -X[:, :1], X[:, 1:]]), np.log(t))
    return _Fit(form, np.concatenate([[coef[0] - coef[1]], coef[2:]]))


@dataclass
class KindModel:
    """The shape model of one operator kind, with its leave-one-signature-out error."""

    kind: str
    fit: _Fit
    sigma: float  # RMS leave-one-signature-out log error
    loso_mape: float  # mean leave-one-signature-out relative error (%), for the report
    n_signatures: int
    n_points: int
    _xtx_inv: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((5, 5)))

    def predict(self, fb: np.ndarray) -> np.ndarray:
        return np.maximum(self.fit.predict(fb), 1e-9)

    def leverage(self, fb: np.ndarray) -> float:
        """Mean leverage of these points against the fitted ones (0 inside a dense cloud, large far outside)."""
        X = _features(fb)
        return float(np.mean(np.einsum("ij,jk,ik->i", X, self._xtx_inv, X)))


def fit_kind(
    kind: str,
    rows: Mapping[str, tuple[np.ndarray, np.ndarray]],
    fallback: KindModel | None = None,
    forms: tuple[str, ...] = ("roofline", "loglog"),
) -> KindModel | None:
    """Fit one kind from ``{signature key: (work rows, seconds)}``; None below MIN_SIGNATURES.

    With ``fallback`` (the model of the coarse kind), a kind of a single signature is still fitted (the roofline
    form, on that signature's own points: it extrapolates in the sizes the request does not move) and takes
    the coarse kind's leave-one-signature-out spread as its uncertainty, the only one measurable."""
    keys = sorted(rows)
    if len(rows) == 1 and fallback is not None:
        fb, t = rows[keys[0]]
        return KindModel(
            kind, _fit("roofline", fb, t), fallback.sigma, fallback.loso_mape, 1, len(t), fallback._xtx_inv
        )
    if len(rows) < MIN_SIGNATURES:
        return None
    best: tuple[float, str, list[float]] | None = None
    # the log-log form has three free coefficients: from one signature's points (whose flops and bytes move
    # together) it is underdetermined, so with two signatures only the roofline form is tried
    for form in forms if len(keys) > 2 else ("roofline",):
        errs: list[float] = []
        for k in keys:
            train = [rows[j] for j in keys if j != k]
            f = _fit(form, np.vstack([a for a, _ in train]), np.concatenate([b for _, b in train]))
            fb, t = rows[k]
            errs.extend(np.log(np.maximum(f.predict(fb), 1e-9) / t))
        score = float(np.sqrt(np.mean(np.square(errs))))
        if best is None or score < best[0]:
            best = (score, form, errs)
    assert best is not None
    sigma, form, errs = best
    fb_all = np.vstack([rows[k][0] for k in keys])
    t_all = np.concatenate([rows[k][1] for k in keys])
    X = _features(fb_all)
    xtx_inv = np.linalg.pinv(X.T @ X)
    return KindModel(
        kind,
        _fit(form, fb_all, t_all),
        sigma,
        100 * float(np.mean(np.abs(np.expm1(errs)))),
        len(keys),
        len(t_all),
        xtx_inv,
    )


@dataclass
class ShapePrediction:
    """A signature's predicted latency at some request values, and how far to trust it."""

    seconds: np.ndarray  # one per requested point
    sigma: float  # log-space standard error (leverage included); inf when no model covers the kind

    @property
    def rel_uncertainty(self) -> float:
        """Half-width of the ~68% interval as a fraction of the prediction (``exp(sigma) - 1``)."""
        return math.expm1(self.sigma) if math.isfinite(self.sigma) else math.inf


class ShapeModel:
    """Per-kind latency models fitted on a profile DB's points (see the module docstring).

    ``ShapeModel.fit(signatures, points)`` with ``{key: Signature}`` and ``{key: [(values, seconds)]}``;
    ``exclude`` leaves signatures out of the fit (a model held out to be predicted with zero new points).
    """

    def __init__(self, kinds: dict[str, KindModel]) -> None:
        self.kinds = kinds

    @classmethod
    def fit(
        cls,
        signatures: Mapping[str, Signature],
        points: Mapping[str, Sequence[tuple[Mapping[str, float], float]]],
        exclude: Collection[str] = (),
    ) -> ShapeModel:
        fine: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        coarse: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        family: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        parent: dict[str, str] = {}
        for key, pts in points.items():
            sig = signatures.get(key)
            if sig is None or key in exclude or not pts:
                continue
            fb, t = signature_rows(sig, pts)
            fine_kind, coarse_kind = kind_of(sig), coarse_kind_of(sig)
            fine.setdefault(fine_kind, {})[key] = (fb, t)
            coarse.setdefault(coarse_kind, {})[key] = (fb, t)
            parent[fine_kind] = coarse_kind
            for fam in family_kinds_of(sig):
                family.setdefault(fam, {})[key] = (fb, t)
        kinds = {k: m for k, rows in coarse.items() if (m := fit_kind(k, rows)) is not None}
        # a family pools overloads whose bytes per element differ: the log-log form's free exponents on two collinear
        # measures extrapolate without bound there (a sigmoid priced at 6e78 s), the roofline's rates cannot
        kinds.update({k: m for k, rows in family.items() if (m := fit_kind(k, rows, forms=("roofline",))) is not None})
        for k, rows in fine.items():
            m = fit_kind(k, rows, kinds.get(parent[k]))
            if m is not None:
                kinds[k] = m
        return cls(kinds)

    def model_for(self, sig: Signature) -> KindModel | None:
        """The model of the signature's kind, else of its coarse kind, else of its first family that has one (None:
        none has enough signatures)."""
        for kind in (kind_of(sig), coarse_kind_of(sig), *family_kinds_of(sig)):
            if (found := self.kinds.get(kind)) is not None:
                return found
        return None

    def covers(self, sig: Signature) -> bool:
        return self.model_for(sig) is not None

    def predict(self, sig: Signature, values: Iterable[Mapping[str, int]]) -> ShapePrediction:
        """Seconds at each of ``values`` (one dict of request values each)."""
        vals = list(values)
        km = self.model_for(sig)
        if km is None:
            return ShapePrediction(np.full(len(vals), np.nan), math.inf)
        fb = np.array([features(sig, v) for v in vals])
        return ShapePrediction(km.predict(fb), min(_MAX_SIGMA, km.sigma * math.sqrt(1.0 + km.leverage(fb))))


def signatures_of(store: object, ctx: object, keys: Iterable[str]) -> dict[str, Signature]:
    """The stored signatures (by key) of a profile DB context."""
    out = {}
    for k in keys:
        text = store.signature_json(ctx, k)  # type: ignore[attr-defined]
        if text:
            out[k] = Signature.from_dict(json.loads(text))
    return out
