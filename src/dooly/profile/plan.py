"""The plan: trace the models, dedup their signatures within and across models and against the DB, lay out jobs.

The request-value grid is clamped to each model's position limit (a GPT-2-style model has 1024 positions,
so a decode at kv_len 1024 cannot run); a signature is profiled by the first model whose grid reaches
furthest, so a model with fewer positions never has to run a point it cannot hold.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dooly.core.errors import DoolyError
from dooly.core.zoo import ModelSpec, max_positions, num_layers, resolve_model
from dooly.db.store import ProfileContext, ProfileStore, canonical_point
from dooly.engines import Engine
from dooly.profile.timing import context_for
from dooly.profile.traces import model_traces
from dooly.trace.signature import ModelTrace, Signature, canonical_json


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

    def within(self, positions: int | None) -> GridSpec:
        """This grid clamped to a model that holds at most ``positions`` positions per sequence.

        A prefill of N tokens holds N positions; a decode step at kv_len holds kv_len + 1. Values past the
        limit become the limit itself, so the grid still reaches as far as the model can go.
        """
        if positions is None:
            return self
        if positions < 2:
            raise DoolyError(f"a model with {positions} positions cannot decode a single token")

        def clamp(values: tuple[int, ...], top: int) -> tuple[int, ...]:
            return tuple(sorted({min(v, top) for v in values}))

        return GridSpec(
            self.prefill_requests,
            clamp(self.prefill_tokens, positions),
            self.decode_requests,
            clamp(self.decode_kv_len, positions - 1),
        )

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


def positions_held(phase: str, values: Mapping[str, int]) -> int:
    """Positions one sequence holds in a forward at ``values`` (a decode step adds one to its cache)."""
    if phase == "prefill":
        return int(values.get("tokens", 1)) + int(values.get("kv_len", 0))
    return int(values.get("kv_len", 0)) + 1


def shapes_within(shapes: Mapping[str, list[dict[str, int]]], positions: int | None) -> dict[str, list[dict[str, int]]]:
    """The forward shapes a model limited to ``positions`` positions can run (all of them when unbounded)."""
    return {ph: [v for v in vs if positions is None or positions_held(ph, v) <= positions] for ph, vs in shapes.items()}


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
    grid: GridSpec  # the plan's grid within this model's position limit
    positions: int | None  # that limit (None: unbounded)


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

    @property
    def in_db(self) -> set[str]:
        """This plan's signatures already complete in the DB (``known`` also holds other models')."""
        return self.known & self.grid_size.keys()

    @property
    def todo_points(self) -> int:
        return sum(len(j.items) for j in self.jobs)

    def without(self, keys: Iterable[str]) -> Plan:
        """This plan with the given signatures left unmeasured (``--budget``: predicted from shape instead)."""
        drop = set(keys)
        jobs = []
        for j in self.jobs:
            items = tuple(it for it in j.items if it[0] not in drop)
            if items:
                jobs.append(Job(j.model, j.config, j.phase, j.shape, j.num_layers, items))
        return Plan(self.ctx, self.grid, self.models, self.owner, self.known, jobs, self.grid_size)


def _first_layers(trace: ModelTrace) -> dict[Signature, int | None]:
    out: dict[Signature, int | None] = {}
    for r in (r for b in trace.branches() for r in b.records):
        if r.signature not in out or (out[r.signature] is None and r.layer is not None):
            out.setdefault(r.signature, r.layer)
    return out


def _reaches_further(a: int | None, b: int | None) -> bool:
    """Whether a model limited to ``a`` positions can run grid points one limited to ``b`` cannot."""
    return b is not None and (a is None or a > b)


def make_plan(
    models: Sequence[str | Mapping[str, Any] | ModelSpec],
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
    owner: dict[str, ModelPlan] = {}
    grid_size: dict[str, int] = {}
    planned: dict[str, list[dict[str, int]]] = {}  # sig key -> its points on its owner's grid
    for m in models:
        name, cfg = resolve_model(m)
        if any(mp.name == name for mp in plans):
            continue  # a model named twice is one model
        if progress:
            progress(f"tracing {name}")
        traces = model_traces(name, cfg, engine, store)
        positions = max_positions(cfg)
        mp = ModelPlan(name, cfg, traces, {}, grid.within(positions), positions)
        for phase, tr in traces.items():
            firsts = _first_layers(tr)
            # every branch's signatures (a phase whose code branches on a request size runs each somewhere)
            mp.needs[phase] = {s.key: SignatureNeed(s, mult, firsts.get(s)) for s, mult in tr.all_unique().items()}
            for key, need in mp.needs[phase].items():
                if owner.get(key) is mp:
                    continue  # met in an earlier phase of this model, which plans it
                points = mp.grid.signature_points(phase, need.signature.symbols())
                # the first model to need a signature profiles it, unless a later one can run grid points the
                # first cannot hold (more positions)
                if key not in owner or (points != planned[key] and _reaches_further(positions, owner[key].positions)):
                    owner[key], planned[key], grid_size[key] = mp, points, len(points)
        plans.append(mp)

    jobs: list[Job] = []
    assigned: set[str] = set()
    for mp in plans:
        total_layers = num_layers(mp.config)
        for phase, needs in mp.needs.items():
            todo = {k: n for k, n in needs.items() if owner[k] is mp and k not in known and k not in assigned}
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
            for pt in mp.grid.phase_points(phase):
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
    return Plan(ctx, grid, plans, {k: mp.name for k, mp in owner.items()}, known, jobs, grid_size)
