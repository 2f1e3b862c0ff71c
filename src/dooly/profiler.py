"""Redundancy-aware profiler: time each unique operator signature once, over a grid of request values.

The plan is a list of independent jobs (one per signature not yet complete in the profile DB); a job
materialises inputs of the signature's concrete shapes, warms up, times the operator with the device's clock
and commits every finished point to the :class:`~dooly.store.ProfileStore` at once, so a killed run resumes
where it stopped. Jobs run in-process by default, or on a Ray cluster (``ray_address``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from dooly.engines import Engine, RequestShape
from dooly.errors import DoolyError
from dooly.signature import ModelTrace, Signature, TensorSpec, canonical_json
from dooly.store import Measurement, ProfileContext, ProfileStore, canonical_point, hardware_fingerprint

# ---------------------------------------------------------------------------------------------------------
# Timing harness
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimerConfig:
    """How hard to time one point. Defaults suit a noisy shared CPU: a few samples, medians."""

    warmup: int = 2
    repeats: int = 7
    min_sample_s: float = 2e-4  # short ops are looped so one sample lasts at least this long
    max_inner: int = 64
    budget_s: float = 1.5  # stop adding repeats (keeping at least 3) once a point has cost this much


@contextmanager
def fixed_threads(threads: int | None) -> Iterator[None]:
    """Pin torch's intra-op thread count for the duration (timings are only comparable at a fixed count)."""
    import torch

    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def default_clock(device: str, threads: int | None) -> str:
    """``thread`` (CPU time of the calling thread) for a one-thread CPU engine, else ``wall``.

    With one intra-op thread every kernel runs on the calling thread, so its CPU time is the latency the pass
    has on a core of its own; wall time on a shared machine also counts the time other tenants' processes
    hold the core, which long forwards suffer and short op samples (whose median drops preempted samples) do
    not -- timing both with the thread clock keeps them comparable. ``$DOOLY_CLOCK`` overrides.
    """
    env = os.environ.get("DOOLY_CLOCK")
    if env in ("wall", "thread"):
        return env
    return "thread" if device == "cpu" and threads == 1 else "wall"


_CLOCK = {"wall": time.perf_counter, "thread": time.thread_time}


_EVICT: list[Any] = []


def evict_caches() -> None:
    """Read a buffer twice the size of the last-level cache, so what runs next finds every cache cold.

    Used before each timed forward: copying its KV cache into place left the cache hot, while in serving it
    was last touched a whole pass ago. (Single ops are not timed this way: bench/bench_cold_cache.py shows a
    full eviction makes a matmul slower than it is inside the model, and a loop over rotated copies of its
    weight about as slow as it is there.)
    """
    import torch

    if not _EVICT:
        llc = 32 * 2**20
        for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
            try:
                text = (idx / "size").read_text().strip().upper()
                llc = int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
                break
            except (OSError, ValueError):
                continue
        _EVICT.append(torch.ones(max(64 * 2**20, 2 * llc) // 4, dtype=torch.float32))
    _EVICT[0].sum()


def time_calls(
    call: Callable[[int], Any], device: str = "cpu", cfg: TimerConfig | None = None, clock: str = "wall"
) -> Measurement:
    """Time ``call(i)`` (``i`` rotates over input copies so weights are not cache-hot) and return its stats.

    CPU: ``clock`` (``wall`` = perf_counter, ``thread`` = thread CPU time) around a loop of calls. CUDA: CUDA
    events around the loop, synchronised.
    """
    cfg = cfg or TimerConfig()
    now = _CLOCK[clock]
    start = now()  # cost is counted on the same clock as the samples
    cuda = device.startswith("cuda")
    if cuda:
        import torch

        sync = torch.cuda.synchronize
    else:

        def sync() -> None:
            return None

    i = 0
    # warm-up, and a first estimate of one call's duration
    t_one = float("inf")
    for _ in range(max(1, cfg.warmup)):
        sync()
        t0 = now()
        call(i)
        sync()
        t_one = min(t_one, now() - t0)
        i += 1
    inner = int(min(cfg.max_inner, max(1, math.ceil(cfg.min_sample_s / max(t_one, 1e-9)))))
    samples: list[float] = []
    if cuda:
        import torch

        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(cfg.repeats):
        if cuda:
            ev0.record()
            for _ in range(inner):
                call(i)
                i += 1
            ev1.record()
            ev1.synchronize()
            samples.append(ev0.elapsed_time(ev1) / 1e3 / inner)
        else:
            t0 = now()
            for _ in range(inner):
                call(i)
                i += 1
            samples.append((now() - t0) / inner)
        if r >= 2 and now() - start > cfg.budget_s:
            break
    cost = now() - start
    return Measurement(
        median_s=statistics.median(samples),
        p10_s=_quantile(samples, 0.1),
        p90_s=_quantile(samples, 0.9),
        repeats=len(samples) * inner,
        cost_s=cost,
    )


def default_threads() -> int:
    """Threads used for profiling and validation unless told otherwise (env DOOLY_THREADS, else 1).

    One thread by default: on a shared machine it is the setting whose timings stay reproducible.
    """
    return int(os.environ.get("DOOLY_THREADS", "1"))


# ---------------------------------------------------------------------------------------------------------
# Models and traces
# ---------------------------------------------------------------------------------------------------------

PHASE_SYMBOLS = {"prefill": ("requests", "tokens"), "decode": ("requests", "kv_len")}


def resolve_model(model: str | Path | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, config dict)`` for a zoo name, a config.json path, a model directory, or a config dict."""
    if isinstance(model, Mapping):
        cfg = dict(model)
        return str(cfg.get("_name_or_path") or cfg.get("model_type")), cfg
    from dooly.zoo import load_config

    mc = load_config(model)
    return mc.name, dict(mc.config)


def tracer_version() -> str:
    """Digest of the tracing code (tracer, taint, engines): a cached trace is stale once any of it changes."""
    import hashlib

    import dooly.engines as engines_pkg
    import dooly.signature
    import dooly.taint
    import dooly.tracer

    h = hashlib.sha256()
    files = [Path(m.__file__) for m in (dooly.tracer, dooly.taint, dooly.signature)]  # type: ignore[arg-type]
    files += sorted(Path(engines_pkg.__file__).parent.glob("*.py"))  # type: ignore[arg-type]
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def trace_cache_key(name: str, config: Mapping[str, Any]) -> str:
    """Key of a model's traces in the store's trace cache (model, exact config, tracing code)."""
    from dooly.tracer import config_hash

    return f"{name}@{config_hash(config)}@{tracer_version()}"


def model_traces(
    name: str, config: Mapping[str, Any], engine: Engine, store: ProfileStore | None = None
) -> dict[str, ModelTrace]:
    """Both phases' traces of a model, from the store's trace cache when this exact config was traced."""
    from dooly.tracer import trace_model

    key = trace_cache_key(name, config)
    eng_key = engine.engine_id + ":" + getattr(engine, "dtype", "float32")
    out: dict[str, ModelTrace] = {}
    for phase in PHASE_SYMBOLS:
        cached = store.get_trace(eng_key, key, phase) if store else None
        if cached is not None:
            out[phase] = ModelTrace.from_json(cached, f"trace cache for {key}")
            continue
        tr = trace_model(config, phase, name=name, engine=engine)
        if store is not None:
            store.put_trace(eng_key, key, phase, tr.to_json())
        out[phase] = tr
    return out


TIMING_METHOD = "resident1"


def context_for(engine: Engine, threads: int | None) -> ProfileContext:
    """The store key of everything but the signature: hardware (+ clock), engine, backend, dtype."""
    backend = getattr(engine, "attn_implementation", None) or "default"
    clock = default_clock(engine.device, threads)
    # TIMING_METHOD: profiles taken with an older timing method are not mixed with newer ones
    hw = f"{hardware_fingerprint(engine.device, threads)}:{TIMING_METHOD}"
    hw += ":threadclock" if clock == "thread" else ""
    return ProfileContext(hardware=hw, engine=engine.name, backend=backend, dtype=getattr(engine, "dtype", "float32"))


def clock_of(ctx: ProfileContext) -> str:
    """The clock timings under ``ctx`` were (and must be) taken with."""
    return "thread" if ctx.hardware.endswith(":threadclock") else "wall"


# ---------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridSpec:
    """Request-symbol values swept per phase (log-spaced). Defaults are sized for small models on a CPU."""

    prefill_requests: tuple[int, ...] = (1, 2, 4)
    prefill_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    decode_requests: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_kv_len: tuple[int, ...] = (16, 64, 256, 1024)

    @classmethod
    def tiny(cls) -> GridSpec:
        """A grid for tests: a few points per axis."""
        return cls((1, 2), (1, 4, 8), (1, 2), (4, 16))

    def axes(self, phase: str) -> dict[str, tuple[int, ...]]:
        if phase == "prefill":
            return {"requests": self.prefill_requests, "tokens": self.prefill_tokens}
        return {"requests": self.decode_requests, "kv_len": self.decode_kv_len}

    def phase_points(self, phase: str) -> list[dict[str, int]]:
        ax = self.axes(phase)
        names = list(ax)
        return [dict(zip(names, vals, strict=True)) for vals in itertools.product(*(ax[n] for n in names))]

    def signature_points(self, phase: str, symbols: Iterable[str]) -> list[dict[str, int]]:
        ax = self.axes(phase)
        names = sorted(s for s in symbols)
        for s in names:
            if s not in ax:
                raise DoolyError(f"signature uses request symbol {s!r}, which the {phase} grid does not sweep")
        return [dict(zip(names, vals, strict=True)) for vals in itertools.product(*(ax[n] for n in names))]


@dataclass
class SignatureNeed:
    """One unique signature of one model phase and how often the pass runs it."""

    signature: Signature
    multiplicity: int
    first_layer: int | None


@dataclass
class ModelPlan:
    name: str
    config: dict[str, Any]
    traces: dict[str, ModelTrace]
    needs: dict[str, dict[str, SignatureNeed]]  # phase -> sig key -> need


@dataclass(frozen=True)
class Job:
    """One independent unit of profiling: a forward context (model, phase, request shape) and the
    (signature, point) pairs to time in it. Picklable, so it can run in another process or on a Ray worker."""

    model: str
    config: dict[str, Any]
    phase: str
    shape: tuple[int, int, int]  # requests, tokens, kv_len
    num_layers: int
    items: tuple[tuple[str, str, str], ...]  # (sig key, sig JSON, canonical point JSON)


@dataclass
class Plan:
    ctx: ProfileContext
    grid: GridSpec
    models: list[ModelPlan]
    owner: dict[str, str]  # sig key -> model that profiles it
    known: set[str]  # sig keys already complete in the DB
    jobs: list[Job]
    grid_size: dict[str, int]  # sig key -> planned points
    estimated_point_cost_s: float

    @property
    def todo_points(self) -> int:
        return sum(len(j.items) for j in self.jobs)


def _first_layers(trace: ModelTrace) -> dict[Signature, int | None]:
    out: dict[Signature, int | None] = {}
    for r in trace.records:
        if r.signature not in out or (out[r.signature] is None and r.layer is not None):
            out.setdefault(r.signature, r.layer)
    return out


def _num_layers(config: Mapping[str, Any]) -> int | None:
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(k), int):
            return int(config[k])
    text = config.get("text_config")
    return _num_layers(text) if isinstance(text, Mapping) else None


def make_plan(
    models: Sequence[str | Mapping[str, Any]],
    store: ProfileStore,
    engine: Engine,
    grid: GridSpec | None = None,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Trace the models, dedup their signatures within and across models and against the DB, and lay out jobs."""
    grid = grid or GridSpec()
    ctx = context_for(engine, threads)
    known = store.complete_keys(ctx)
    plans: list[ModelPlan] = []
    owner: dict[str, str] = {}
    grid_size: dict[str, int] = {}
    for m in models:
        name, cfg = resolve_model(m)
        if progress:
            progress(f"tracing {name}")
        traces = model_traces(name, cfg, engine, store)
        needs: dict[str, dict[str, SignatureNeed]] = {}
        for phase, tr in traces.items():
            firsts = _first_layers(tr)
            needs[phase] = {
                s.key: SignatureNeed(s, mult, firsts.get(s)) for s, mult in tr.unique().items()
            }  # fmt: skip
            for key, need in needs[phase].items():
                owner.setdefault(key, name)
                grid_size.setdefault(key, len(grid.signature_points(phase, need.signature.symbols())))
        plans.append(ModelPlan(name, cfg, traces, needs))

    jobs: list[Job] = []
    assigned: set[str] = set()
    for mp in plans:
        total_layers = _num_layers(mp.config)
        for phase, needs in mp.needs.items():
            todo = {k: n for k, n in needs.items() if owner[k] == mp.name and k not in known and k not in assigned}
            assigned |= set(todo)
            if not todo:
                continue
            for k, n in todo.items():
                store.register_signature(ctx, k, canonical_json(n.signature.to_dict()), grid_size[k])
            done = {k: store.done_points(ctx, k) for k in todo}
            layers_needed = max((n.first_layer or 0) for n in todo.values()) + 1
            if total_layers is not None:
                layers_needed = min(layers_needed, total_layers)
            seen: set[tuple[str, str]] = set()
            for pt in grid.phase_points(phase):
                items = []
                for k, n in todo.items():
                    sp = canonical_point({s: pt[s] for s in sorted(n.signature.symbols())})
                    if sp in done[k] or (k, sp) in seen:
                        continue
                    seen.add((k, sp))
                    items.append((k, canonical_json(n.signature.to_dict()), sp))
                if items:
                    shape = (pt["requests"], pt.get("tokens", 1), pt.get("kv_len", 0))
                    jobs.append(Job(mp.name, mp.config, phase, shape, layers_needed, tuple(items)))
    costs = store.signature_costs(ctx)
    n_pts = sum(len(store.done_points(ctx, k)) for k in costs) or 0
    est = (sum(costs.values()) / n_pts) if n_pts else 0.05
    return Plan(ctx, grid, plans, owner, known, jobs, grid_size, est)


# ---------------------------------------------------------------------------------------------------------
# Running a job: engine-built context, materialised inputs, timing, commit
# ---------------------------------------------------------------------------------------------------------

_ROTATE_BYTES = 96 * 2**20  # > 2x a server L3: a rotated weight is never cache-hot, as in a real forward
_ROTATE_MIN_TENSOR = 256 * 2**10


class _Pool(TorchDispatchMode):
    """Collects every tensor the engine's real forward touches, by (shape, stride, dtype): "context reuse"."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[tuple, Any] = {}
        self.resident: set[int] = set()  # storages the pass reads but did not compute (see _resident_storages)

    def add(self, t: Any) -> None:
        import torch

        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            self.tensors.setdefault((tuple(t.shape), tuple(t.stride()), t.dtype), t)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Mapping[str, Any] | None = None):
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in tree_leaves((args, kwargs, out)):
            self.add(t)
        return out


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


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    acc, out = 1, []
    for s in reversed(shape):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


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
        import torch

        t0 = _CLOCK[self.clock]()
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
        setup = _CLOCK[self.clock]() - t0
        share = setup / max(1, len(job.items))  # the context's cost is part of each point's profiling cost
        spent = setup
        dev = torch.device(self.engine.device)
        for key, sig_json, point in job.items:
            sig = Signature.from_dict(json.loads(sig_json))
            values = json.loads(point)
            values_full = {"requests": req, "tokens": tok, "kv_len": kv, **values}
            try:
                call = self._materialise(sig, values_full, pool, dev)
                with torch.no_grad():  # as the engine runs its forward
                    m = time_calls(call, self.engine.device, self.timer, self.clock)
            except Exception as exc:  # an op that cannot run standalone is reported, not fatal
                self.stats["failed"] += 1
                _log_failure(sig, values, exc)
                continue
            m = Measurement(m.median_s, m.p10_s, m.p90_s, m.repeats, m.cost_s + share)
            self.store.put_point(self.ctx, key, values, m)
            self.stats["points"] += 1
            spent += m.cost_s - share
        return spent

    def _materialise(self, sig: Signature, values: Mapping[str, int], pool: _Pool, dev: Any) -> Callable[[int], Any]:
        """The op as a callable of the rotation slot (see ``time_calls``)."""
        import torch

        rotated: dict[int, list[Any]] = {}

        def make_tensor(i: int, spec: TensorSpec, shape: tuple[int, ...], stride: tuple[int, ...] | None) -> Any:
            dtype = getattr(torch, spec.dtype)
            stride = stride if stride is not None else _contiguous_stride(shape)
            t = pool.tensors.get((tuple(shape), tuple(stride), dtype))
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


_FAILURES: list[str] = []


def _log_failure(sig: Signature, values: Mapping[str, int], exc: Exception) -> None:
    _FAILURES.append(f"{sig} at {dict(values)}: {type(exc).__name__}: {str(exc)[:200]}")


def failures() -> list[str]:
    """Ops that could not be timed standalone in this process (reported by the CLI)."""
    return list(_FAILURES)


# ---------------------------------------------------------------------------------------------------------
# Running a plan: in-process (default) or on Ray
# ---------------------------------------------------------------------------------------------------------


def _finish(plan: Plan, store: ProfileStore) -> int:
    """Mark every planned signature whose grid is fully measured as complete; return how many are."""
    n = 0
    for key, size in plan.grid_size.items():
        if key in plan.known:
            continue
        if len(store.done_points(plan.ctx, key)) >= size:
            store.mark_complete(plan.ctx, key)
            n += 1
    return n


def run_plan(
    plan: Plan,
    store: ProfileStore,
    engine: Engine,
    *,
    timer: TimerConfig | None = None,
    threads: int | None = None,
    ray_address: str | None = None,
    on_job: Callable[[Job, float], None] | None = None,
) -> dict[str, Any]:
    """Execute the plan's jobs; every finished point is already committed when this returns or dies."""
    t0 = time.perf_counter()
    if ray_address:
        spent = _run_ray(plan, store, engine, timer, threads, ray_address, on_job)
        stats: dict[str, Any] = {}
    else:
        runner = JobRunner(engine, store, plan.ctx, timer)
        spent = 0.0
        with fixed_threads(threads):
            for job in plan.jobs:
                s = runner.run(job)
                spent += s
                if on_job:
                    on_job(job, s)
        stats = dict(runner.stats)
    stats.update({"device_s": spent, "wall_s": time.perf_counter() - t0, "completed": _finish(plan, store)})
    return stats


def _ray_job(job: Job, db_path: str, engine_spec: dict[str, Any], timer: TimerConfig, threads: int | None) -> float:
    from dooly.engines import get_engine

    engine = get_engine(**engine_spec)
    with ProfileStore(db_path) as store, fixed_threads(threads):
        ctx = context_for(engine, threads)
        return JobRunner(engine, store, ctx, timer).run(job)


def _run_ray(plan, store, engine, timer, threads, address, on_job) -> float:  # type: ignore[no-untyped-def]
    try:
        import ray  # noqa: PLC0415 - optional, only for distributed profiling
    except ImportError:
        raise DoolyError("--ray-address given but ray is not installed (pip install 'ray[default]')") from None
    ray.init(address=address, ignore_reinit_error=True)
    # workers share the DB file: one host (or a shared filesystem) and SQLite's WAL serialise the writes.
    # Each worker's hardware fingerprint is its own, so a heterogeneous cluster never mixes timings.
    remote = ray.remote(num_cpus=threads or 1)(_ray_job)
    spec = {"name": engine.name, "device": engine.device, "dtype": getattr(engine, "dtype", "float32")}
    futures = {remote.remote(job, str(store.path), spec, timer or TimerConfig(), threads): job for job in plan.jobs}
    spent = 0.0
    pending = list(futures)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        s = float(ray.get(ready[0]))
        spent += s
        if on_job:
            on_job(futures[ready[0]], s)
    return spent


# ---------------------------------------------------------------------------------------------------------
# Real end-to-end forwards: framework-overhead calibration and validation
# ---------------------------------------------------------------------------------------------------------

#: Shapes whose real forwards calibrate the framework overhead; off the grid and off the validation shapes.
CALIBRATION_SHAPES: dict[str, list[dict[str, int]]] = {
    "prefill": [
        {"requests": 1, "tokens": 12}, {"requests": 1, "tokens": 64}, {"requests": 1, "tokens": 160},
        {"requests": 2, "tokens": 72},
    ],
    "decode": [
        {"requests": 1, "kv_len": 200}, {"requests": 2, "kv_len": 30}, {"requests": 4, "kv_len": 60},
        {"requests": 8, "kv_len": 500}, {"requests": 20, "kv_len": 80},
    ],
}  # fmt: skip
CALIBRATION_ROUNDS = 2  # every shape measured in interleaved rounds, so one slow minute does not skew the fit


def measure_forward(
    engine: Engine,
    model: Any,
    phase: str,
    values: Mapping[str, int],
    repeats: int = 5,
    warmup: int = 1,
    clock: str = "wall",
) -> Measurement:
    """Time one real engine forward at ``values`` (the KV cache is rebuilt, untimed, before each run)."""
    import copy

    shape = (
        RequestShape.prefill(values["requests"], values["tokens"])
        if phase == "prefill"
        else RequestShape.decode(values["requests"], values["kv_len"])
    )
    now = _CLOCK[clock]
    t_start = now()
    base = engine.prepare(model, shape)
    samples = []
    for r in range(warmup + repeats):
        inputs = copy.deepcopy(base)  # forward extends the cache in place; each run starts from the same state
        if not engine.device.startswith("cuda"):
            evict_caches()  # the copy left the KV cache hot; in serving it was last touched a pass ago
        if engine.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        t0 = now()
        engine.forward(model, inputs)
        if engine.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        if r >= warmup:
            samples.append(now() - t0)
    return Measurement(
        statistics.median(samples), _quantile(samples, 0.1), _quantile(samples, 0.9), len(samples),
        now() - t_start,
    )  # fmt: skip


def calibrate(
    name: str,
    config: Mapping[str, Any],
    store: ProfileStore,
    engine: Engine,
    ctx: ProfileContext,
    shapes: Mapping[str, list[dict[str, int]]] | None = None,
    threads: int | None = None,
    repeats: int = 5,
) -> float:
    """Measure and store real forwards of the full model at the calibration shapes; returns seconds spent."""
    import torch

    shapes = shapes or CALIBRATION_SHAPES
    store.put_trace("config", name, "config", canonical_json(dict(config)))
    todo = []
    for k in range(CALIBRATION_ROUNDS):
        key = name if k == 0 else f"{name}#round{k + 1}"  # the overhead fit reads every round as its own rows
        have = {(ph, canonical_point(v)) for _, ph, v, _ in store.forwards(ctx, key)}
        todo += [(key, ph, v) for ph, vs in shapes.items() for v in vs if (ph, canonical_point(v)) not in have]
    if not todo:
        return 0.0
    torch.manual_seed(0)
    model = engine.build_model(config)
    spent = 0.0
    with fixed_threads(threads):
        for key, ph, v in todo:
            m = measure_forward(engine, model, ph, v, repeats=repeats, clock=clock_of(ctx))
            store.put_forward(ctx, key, ph, v, m)
            spent += m.cost_s
    del model
    return spent


# ---------------------------------------------------------------------------------------------------------
# Savings accounting
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ModelCost:
    name: str
    signatures: int  # unique signatures of the model (both phases; repeated layers count once)
    new: int  # profiled for this model (first in the list to need them, not already in the DB)
    reused_models: int  # already needed by an earlier model in the list
    reused_db: int  # already complete in the DB before this run
    alone_s: float  # profiling cost of this model on its own (within-model reuse only)
    marginal_s: float  # cost this model adds when profiled after the earlier ones, with reuse


@dataclass
class Savings:
    models: list[ModelCost]
    with_reuse_s: float
    without_reuse_s: float
    measured_share: float  # share of the signature costs that are measured (the rest estimated from the grid)

    @property
    def saved_pct(self) -> float:
        return 100.0 * (1.0 - self.with_reuse_s / self.without_reuse_s) if self.without_reuse_s else 0.0


def savings(plan: Plan, store: ProfileStore) -> Savings:
    """Profiling cost with cross-model reuse vs each model alone (both dedup repeated layers, as Vidur)."""
    measured = store.signature_costs(plan.ctx)
    point_cost = plan.estimated_point_cost_s

    def cost(key: str) -> float:
        return measured[key] if key in measured else plan.grid_size.get(key, 1) * point_cost

    seen: set[str] = set()
    rows = []
    n_meas = n_all = 0
    for mp in plan.models:
        keys = set().union(*(set(n) for n in mp.needs.values()))
        new = {k for k in keys if k not in seen and k not in plan.known}
        reused_models = {k for k in keys if k in seen}
        reused_db = {k for k in keys if k not in seen and k in plan.known}
        alone = sum(cost(k) for k in keys)
        marginal = sum(cost(k) for k in keys - seen)
        rows.append(ModelCost(mp.name, len(keys), len(new), len(reused_models), len(reused_db), alone, marginal))
        n_meas += sum(1 for k in keys - seen if k in measured)
        n_all += len(keys - seen)
        seen |= keys
    with_reuse = sum(r.marginal_s for r in rows)
    without = sum(r.alone_s for r in rows)
    return Savings(rows, with_reuse, without, n_meas / n_all if n_all else 1.0)
