"""Latency of one model's forward passes and engine iterations: the per-signature estimators
(:mod:`~dooly.predict.estimators`) summed over each pass, plus page faults (:mod:`~dooly.predict.pages`) and the
fitted framework overhead (:mod:`~dooly.predict.overhead`); unmeasured signatures filled from shape
(:mod:`~dooly.predict.shapes`).

Interpolation tables of all signatures that share a symbol set and grid are stacked, so one iteration's
prediction is a handful of vectorised gathers rather than a Python loop over operators.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dooly.core.batch import Batch
from dooly.core.errors import DoolyError
from dooly.predict.collectives import collective_fill
from dooly.predict.estimators import (
    PREDICTOR_METHODS,
    GridTable,
    SignatureModel,
    build_grid,
    choose_method,
    predictor_method,
)
from dooly.predict.overhead import OverheadModel, fit_overhead
from dooly.predict.pages import can_fault, faulting_bytes, page_cost
from dooly.predict.passes import branch_keys, signature_keys
from dooly.predict.shapes import ShapeFill, own_signatures, shape_fill


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
        # signatures of a method that does not stack: (model, multiplicity, signature key)
        self._singles: dict[str, list[tuple[SignatureModel, int, str]]] = {}
        self.missing: dict[str, list[str]] = {}
        # a phase whose code branches on a request size has one pass per branch (the trace's sides): each is
        # priced where its guards hold, under its own key (branch_key)
        for phase, tr in self.traces.items():
            self.missing[phase] = sorted({str(s) for s in tr.all_unique() if not points.get(s.key)})  # type: ignore[attr-defined]
            for key, branch in zip(branch_keys(phase, tr), tr.branches(), strict=True):  # type: ignore[attr-defined]
                self._add_pass(key, branch, points, method)
        self._memo: dict[object, float] = {}
        self.flattens_batches = False  # set by for_model from the engine (see iteration_latency)
        # filled by for_model(shape=True): per pass, the signatures predicted from shape alone (never measured)
        self.shape_predicted: dict[str, list[ShapeFill]] = {}
        # filled by for_model(shape=True): one line per collective kind and group size priced by the ring model
        # (dooly.predict.collectives), saying which group sizes were measured and whether it is extrapolated
        self.collective_notes: list[str] = []
        # seconds per byte of fresh pages (set by for_model from the DB on a CPU: the op profiles leave them
        # out, see dooly.profile.timing.reused_pages), and per pass the signatures whose outputs can need them
        self.page_cost_s_per_byte = 0.0
        self._large_outputs: dict[str, list[tuple[object, int]]] = {}

    def signature_keys(self) -> set[str]:
        """Every operator signature of the model's passes (all phases and branches)."""
        return signature_keys(self.traces)

    def branch_key(self, phase: str, values: Mapping[str, int]) -> str:
        """The pass the engine runs in ``phase`` at ``values``: the phase, or ``phase/i`` for its i-th side."""
        tr = self.traces.get(phase)
        if tr is None or not tr.sides:  # type: ignore[attr-defined]
            return phase
        branch = tr.at(values)  # type: ignore[attr-defined]
        return branch_keys(phase, tr)[next(i for i, b in enumerate(tr.branches()) if b is branch)]  # type: ignore[attr-defined]

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
                self._singles.setdefault(key, []).append((SignatureModel(syms, pts, method), mult, s.key))
                continue
            axes, arr = build_grid(pts, syms)
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
        shared_overhead: bool = False,
        own_depth_overhead: bool = False,
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
        ``shared_overhead``: the framework overhead fitted on the DB's other calibrated models, leaving the
        model's own calibration forwards out: how a model profiled with ``--calibrate none`` (or whose ``check``
        passed) is priced, with its own operator points.
        ``own_depth_overhead``: the overhead fitted on the first round of the model's own calibration at its own
        depth alone: how a model whose ``--calibrate check`` missed is priced, though the DB holds more of it.
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
            coll_notes: list[str] = []
            if shape:
                measured = {k: v for k, v in pts.items() if k in complete and k not in held}
                # collectives first, by the ring model over the measured ones (any group size they were timed at)
                coll = collective_fill(traces, measured, store, ctx, cfg)
                fills, synth = shape_fill(traces, measured, store, ctx, cfg, held, skip=coll.synth)
                for key, more in coll.fills.items():
                    fills.setdefault(key, []).extend(more)
                synth.update(coll.synth)
                coll_notes = coll.notes
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
            pred.collective_notes = coll_notes
            pred.page_cost_s_per_byte = page_cost(store, ctx)
            pred.overhead = _overhead(
                store, ctx, engine, pts_model, pred, holdout, shared_overhead, db_path, own_depth_overhead
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
        for model, mult, _ in self._singles.get(phase, []):
            total += model(values) * mult
        return total + self.page_faults(phase, values)

    def collectives_share(self, phase: str, values: Mapping[str, int]) -> float:
        """Of the operator time at ``values``: the share a parallel rank spends in collectives (0 on one device)."""
        from dooly.profile.collectives import collective_kind

        key = self.branch_key(phase, values)
        keys = {s.key for s in self._passes[key].unique() if collective_kind(s.op)}  # type: ignore[attr-defined]
        part = 0.0
        for g, mult in self._groups.get(key, []):
            sel = np.array([k in keys for k in g.keys])
            if sel.any():
                part += float(np.exp(g.predict_log(values))[sel] @ mult[sel])
        part += sum(model(values) * mult for model, mult, k in self._singles.get(key, []) if k in keys)
        total = self.ops_latency(phase, values)
        return part / total if total else 0.0

    def page_faults(self, phase: str, values: Mapping[str, int]) -> float:
        """Seconds the pass spends faulting in fresh pages: for every op output above the allocator's mmap
        ceiling (reused below it in a running engine, so free), its bytes at the machine's measured cost.
        ``phase`` is a pass key (:meth:`branch_key`)."""
        if not self.page_cost_s_per_byte:
            return 0.0
        if phase not in self._large_outputs:
            self._large_outputs[phase] = [
                (s, m)
                for s, m in self._passes[phase].unique().items()  # type: ignore[attr-defined]
                if can_fault(s)
            ]
        nbytes = 0
        for s, mult in self._large_outputs[phase]:
            nbytes += mult * faulting_bytes(s, values)
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


def _overhead(  # type: ignore[no-untyped-def]
    store, ctx, engine, pts_model, pred: Predictor, holdout: bool, shared: bool, db_path, own_depth: bool
) -> OverheadModel:
    """The framework overhead of ``pred``'s model: from its own calibration forwards, else (``holdout``,
    ``shared``, or none stored) from the DB's other models; ``shared`` refuses where no other model has any.
    With the shape model's points: a --budget profile's own calibration forwards ran every signature. A
    tensor-parallel rank takes its replica's calibration where one is stored, else the one-device overhead."""
    from dooly.profile.calibrate import replica_key

    without_own = holdout or shared
    replica = replica_key(pred.name, engine)
    if replica is not None and not without_own and store.forwards(ctx, replica):
        # a tensor-parallel rank whose replica was calibrated: its own overhead, collectives and all
        return fit_overhead(store, ctx, engine, pts_model, pred.method, own=replica, replica=replica,
                            signatures=pred.signature_keys(), predictor=type(pred))  # fmt: skip
    fitted = fit_overhead(
        store,
        ctx,
        _one_device(engine),
        pts_model,
        pred.method,
        own=None if without_own else pred.name,
        exclude=pred.name if without_own else None,
        signatures=pred.signature_keys(),
        predictor=type(pred),
        own_depth_only=own_depth,
    )
    if shared and not fitted.n_fit:
        raise DoolyError(
            f"{db_path}: no calibrated model but {pred.name} in it, so no overhead fitted on other models "
            "(profile other models into it with calibration)"
        )
    return fitted


def _one_device(engine: Any) -> Any:
    """The engine whose forwards the overhead is fitted on where a parallel rank's replica was not calibrated: the
    same engine on one device (the framework's cost around each op is taken to be a rank's as well)."""
    if getattr(engine, "tp", 1) * getattr(engine, "pp", 1) == 1:
        return engine
    from dooly.engines import get_engine

    return get_engine(engine.name, device=engine.device, dtype=getattr(engine, "dtype", "float32"))


def _require_holdout_covered(store, ctx, traces, pts_model, name: str, db_path) -> None:  # type: ignore[no-untyped-def]
    """Refuse a zero-new-points predictor with signatures no shape model covers, saying why: profiling the
    model again would not help, its own points are what is held out."""
    n = sum(1 for k in signature_keys(traces) if not pts_model.get(k))
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
    keys = signature_keys(traces)
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
