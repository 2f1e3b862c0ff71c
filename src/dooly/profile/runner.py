"""Running one job of a plan: an engine-built forward context, materialised inputs, timing, commit per point.

:func:`dooly.profile.run.run_plan` runs a whole plan's jobs, in-process or on a Ray cluster.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from dooly.core.errors import DoolyError
from dooly.db.store import Measurement, ProfileContext, ProfileStore
from dooly.engines import Engine, RequestShape
from dooly.profile.collectives import CollectiveTimer, collective_call, collective_kind, describe
from dooly.profile.plan import Job
from dooly.profile.timing import (
    CLOCKS,
    TimerConfig,
    clock_of,
    reused_pages,
    time_calls,
)
from dooly.trace.signature import Signature, TensorSpec, contiguous_stride

_ROTATE_BYTES = 96 * 2**20  # > 2x a server L3: a rotated weight is never cache-hot, as in a real forward
_ROTATE_MIN_TENSOR = 256 * 2**10


_LAYOUTS_KEPT = 64  # calls kept per operator, one per distinct input layout (first seen)


class _Pool(TorchDispatchMode):
    """Collects every tensor the engine's real forward touches, by (shape, stride, dtype): "context reuse".

    It also keeps, per operator, the inputs of its first call of each input layout: an op whose inputs carry
    values a fresh tensor cannot supply (a KV-cache slot mapping next to same-shaped positions, an engine's
    handle to a packed weight) is then timed on the very tensors the forward called it with. Per layout, not
    the first few calls: the logits GEMM comes after every layer's GEMMs, and a synthetic oneDNN handle is
    a null pointer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[tuple, Any] = {}
        # op -> input layouts -> inputs of the first such call (unique tensors, signature order)
        self.calls: dict[str, dict[tuple, list[Any]]] = {}
        self.resident: set[int] = set()  # storages the pass reads but did not compute (see _resident_storages)

    def call_inputs(self, op: str, layouts: Sequence[tuple[tuple[int, ...], tuple[int, ...], Any]]) -> list | None:
        """The inputs of a recorded call of ``op`` whose tensors have exactly these (shape, stride, dtype)."""
        for inputs in self.calls.get(op, {}).values():
            if len(inputs) == len(layouts) and all(
                _same_layout(t, shape, stride, dtype) for t, (shape, stride, dtype) in zip(inputs, layouts, strict=True)
            ):
                return inputs
        return None

    def add(self, t: Any) -> None:
        import torch

        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            self.tensors.setdefault((tuple(t.shape), tuple(t.stride()), t.dtype), t)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Mapping[str, Any] | None = None):
        import torch
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        calls = self.calls.setdefault(str(func), {})
        if len(calls) < _LAYOUTS_KEPT:  # unique input tensors in pytree order, as the signature numbers them
            inputs = list({id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}.values())
            calls.setdefault(tuple(_layout(t) for t in inputs), inputs)
        out = func(*args, **kwargs)
        for t in tree_leaves((args, kwargs, out)):
            self.add(t)
        return out


def _layout(t: Any) -> tuple:
    """(shape, stride, dtype); stride None where the tensor has none (sparse, nested)."""
    try:
        stride = t.stride()
    except (RuntimeError, NotImplementedError):
        stride = None
    return tuple(t.shape), stride, t.dtype


def _same_layout(t: Any, shape: tuple[int, ...], stride: tuple[int, ...], dtype: Any) -> bool:
    """Whether tensor ``t`` has this shape, dtype and stride (a size-1 dimension's stride does not matter)."""
    return (
        tuple(t.shape) == tuple(shape)
        and t.dtype == dtype
        and all(n == 1 or a == b for n, a, b in zip(shape, t.stride(), stride, strict=True))
    )


def _resident_storages(model: Any, inputs: Mapping[str, Any]) -> set[int]:
    """Storage addresses of what a forward reads but does not compute: weights, buffers, the KV cache passed in.

    Inside a forward these were last touched a whole pass ago (cold in every cache), while everything the
    pass computes, such as the cache extended by this step's keys, is read hot right after it is written.
    The inputs are walked generically (dicts, sequences, object attributes) to reach the cache's tensors.
    """
    import torch

    ptrs = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    seen: set[int] = set()

    def walk(x: Any, depth: int) -> None:
        if isinstance(x, torch.Tensor):
            ptrs.add(x.untyped_storage().data_ptr())
            return
        if depth > 4 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, Mapping):
            items: Any = x.values()
        elif isinstance(x, (list, tuple)):
            items = x
        elif hasattr(x, "__dict__"):
            items = vars(x).values()
        else:
            return
        for v in items:
            walk(v, depth + 1)

    walk(inputs, 0)
    return ptrs


class JobRunner:
    """Runs jobs in one process, keeping truncated models between jobs of the same model."""

    def __init__(self, engine: Engine, store: ProfileStore, ctx: ProfileContext, timer: TimerConfig | None = None):
        self.engine = engine
        self.store = store
        self.ctx = ctx
        self.timer = timer or TimerConfig()
        self.clock = clock_of(ctx)
        self._models: dict[tuple[str, int], Any] = {}
        self.stats = {"from_context": 0, "synthetic": 0, "points": 0, "failed": 0}
        self.failures: list[str] = []  # ops this runner could not time standalone, one line each
        self._collective_timer: CollectiveTimer | None = None  # started at the first collective

    def _model(self, job: Job) -> Any:
        key = (job.model, job.num_layers)
        if key not in self._models:
            self._models.clear()  # one model at a time keeps memory flat
            import torch

            torch.manual_seed(0)
            self._models[key] = self.engine.build_model(job.config, num_layers=job.num_layers)
        return self._models[key]

    def run(self, job: Job) -> float:
        """Time every item of ``job``, committing each point as it finishes. Returns device seconds spent."""
        items = [(key, Signature.from_dict(json.loads(sig_json)), point) for key, sig_json, point in job.items]
        # a collective exchanges data with other ranks: timed between real processes, not in this rank's forward
        coll = [it for it in items if collective_kind(it[1].op)]
        ops = [it for it in items if not collective_kind(it[1].op)]
        spent = self._run_collectives(job, coll) if coll else 0.0
        return spent + (self._run_ops(job, ops) if ops else 0.0)

    def _run_ops(self, job: Job, items: Sequence[tuple[str, Signature, str]]) -> float:
        """Time ``items`` in the forward context of ``job``'s shape (see :class:`_Pool`)."""
        import torch

        t0 = CLOCKS[self.clock]()
        model = self._model(job)
        req, tok, kv = job.shape
        shape = RequestShape(req, tok, kv) if job.phase == "prefill" else RequestShape.decode(req, kv)
        pool = _Pool()
        inputs = self.engine.prepare(model, shape)
        pool.resident = _resident_storages(model, inputs)  # before the forward replaces the cache's tensors
        for v in inputs.values():
            pool.add(v)
        with pool:
            self.engine.forward(model, inputs)
        setup = CLOCKS[self.clock]() - t0
        share = setup / max(1, len(items))  # the context's cost is part of each point's profiling cost
        spent = setup
        dev = torch.device(self.engine.device)
        for key, sig, point in items:
            values = json.loads(point)
            values_full = {"requests": req, "tokens": tok, "kv_len": kv, **values}
            try:
                call = self._materialise(sig, values_full, pool, dev)
                # as the engine runs its forward; on a CPU without page faults (the predictor adds them)
                with torch.no_grad(), nullcontext() if self.engine.device.startswith("cuda") else reused_pages():
                    m = time_calls(call, self.engine.device, self.timer, self.clock)
            except Exception as exc:  # an op that cannot run standalone is reported, not fatal
                self.stats["failed"] += 1
                self.failures.append(f"{sig} at {dict(values)}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            m = Measurement(m.median_s, m.p10_s, m.p90_s, m.repeats, m.cost_s + share)
            self.store.put_point(self.ctx, key, values, m)
            self.stats["points"] += 1
            spent += m.cost_s - share
        return spent

    def _run_collectives(self, job: Job, items: Sequence[tuple[str, Signature, str]]) -> float:
        """Time the collectives ``items`` between real processes (:mod:`dooly.profile.collectives`)."""
        req, tok, kv = job.shape
        points = [json.loads(point) for _, _, point in items]
        calls = [
            collective_call(sig, {"requests": req, "tokens": tok, "kv_len": kv, **values})
            for (_, sig, _), values in zip(items, points, strict=True)
        ]
        t0 = time.perf_counter()
        results: list[Measurement | str]
        if self.engine.device != "cpu":  # NCCL between GPUs is not timed yet: a failure, not a one-rank copy's time
            results = [f"no two-process timing of collectives on {self.engine.device}"] * len(calls)
        else:
            self._collective_timer = self._collective_timer or CollectiveTimer()
            try:
                results = self._collective_timer.time(calls, self.timer)
            except DoolyError as exc:  # the workers did not start or hung: these points fail, the run goes on
                self.close()
                results = [str(exc)] * len(calls)
        spent = time.perf_counter() - t0
        # the workers' start and the pipe are part of the points' profiling cost
        share = (spent - sum(m.cost_s for m in results if isinstance(m, Measurement))) / len(items)
        for (key, sig, _), values, call, m in zip(items, points, calls, results, strict=True):
            if isinstance(m, str):
                self.stats["failed"] += 1
                self.failures.append(f"{sig} at {dict(values)}: {describe(call)}: {m}")
                continue
            self.store.put_point(self.ctx, key, values, Measurement(*m.row()[:4], m.cost_s + share))
            self.stats["points"] += 1
        return spent

    def close(self) -> None:
        """Stop the collective workers, if any were started."""
        if self._collective_timer is not None:
            self._collective_timer.close()
            self._collective_timer = None

    def _materialise(self, sig: Signature, values: Mapping[str, int], pool: _Pool, dev: Any) -> Callable[[int], Any]:
        """The op as a callable of the rotation slot (see ``time_calls``)."""
        import torch

        rotated: dict[int, list[Any]] = {}
        shapes, _ = sig.concrete(values)
        own = pool.call_inputs(
            sig.op,
            [
                (sh, st if st is not None else contiguous_stride(sh), getattr(torch, spec.dtype))
                for (sh, st), spec in zip(shapes, sig.inputs, strict=True)
            ],
        )

        def make_tensor(i: int, spec: TensorSpec, shape: tuple[int, ...], stride: tuple[int, ...] | None) -> Any:
            dtype = getattr(torch, spec.dtype)
            stride = stride if stride is not None else contiguous_stride(shape)
            t = own[i] if own is not None else pool.tensors.get((tuple(shape), tuple(stride), dtype))
            if t is None and spec.stride is None:
                t = next((x for (s, _, d), x in pool.tensors.items() if s == tuple(shape) and d == dtype), None)
                if t is not None and not t.is_contiguous():
                    t = None
            if t is not None:
                self.stats["from_context"] += 1
                # weights and the cache passed in were last touched a whole pass ago in a real forward: rotate
                # copies of them so the timed op reads them cold, as it would there; what the pass computes
                # (the cache extended by this step) is read hot there, so it is not rotated
                cold = t.untyped_storage().data_ptr() in pool.resident
            else:
                self.stats["synthetic"] += 1
                t = _fresh(shape, stride, dtype, dev)
                cold = not spec.symbols() or "kv_len" in spec.symbols()  # no context: a weight or the cache
            nbytes = t.numel() * t.element_size()
            if cold and nbytes >= _ROTATE_MIN_TENSOR:
                k = int(min(48, max(2, _ROTATE_BYTES // max(nbytes, 1))))
                rotated[i] = [t] + [_fresh(shape, stride, dtype, dev, like=t) for _ in range(k - 1)]
            return t

        args, kwargs = sig.build_call(values, make_tensor)
        func = _resolve_op(sig.op)
        if not rotated:
            return lambda _i: func(*args, **kwargs)

        from torch.utils._pytree import tree_map

        # one (args, kwargs) variant per rotation slot, built once so the timed loop only indexes a list
        slot_of = {id(copies[0]): copies for copies in rotated.values()}
        n = max(len(v) for v in rotated.values())
        variants = []
        for slot in range(n):

            def swap(x: Any, slot: int = slot) -> Any:
                copies = slot_of.get(id(x))
                return copies[slot % len(copies)] if copies is not None else x

            variants.append((tree_map(swap, list(args)), tree_map(swap, dict(kwargs))))
        return lambda i: func(*variants[i % n][0], **variants[i % n][1])


def _fresh(shape: Sequence[int], stride: Sequence[int], dtype: Any, dev: Any, like: Any = None) -> Any:
    """A new tensor with exactly this shape and stride (stride 0 / overlapping layouts included).

    Values: a copy of ``like`` when given, else small normals (floats), True (bools) or 0 (integers: an
    index of 0 is in range of every table).
    """
    import torch

    extent = 1 + sum((int(n) - 1) * int(st) for n, st in zip(shape, stride, strict=True) if int(n) > 0)
    if any(int(n) == 0 for n in shape):
        extent = 0
    base = torch.empty(extent, dtype=dtype, device=dev)
    if like is not None:
        src = like.as_strided((like.untyped_storage().nbytes() // like.element_size(),), (1,), 0)
        base.copy_(src[like.storage_offset() : like.storage_offset() + extent])
    elif dtype.is_floating_point:
        base.normal_(0, 0.02)
    elif dtype == torch.bool:
        base.fill_(True)
    else:
        base.zero_()
    return base.as_strided(tuple(int(n) for n in shape), tuple(int(s) for s in stride))


def _resolve_op(name: str) -> Any:
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default``."""
    import torch

    ns, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except AttributeError:
        raise DoolyError(f"operator {name} does not exist in this torch build") from None
