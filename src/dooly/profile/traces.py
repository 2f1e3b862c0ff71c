"""A model's traces, from the store's trace cache when this exact config and tracing code were traced before."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dooly.db.store import ProfileStore
from dooly.engines import Engine
from dooly.trace.signature import ModelTrace

PHASE_SYMBOLS = {"prefill": ("requests", "tokens"), "decode": ("requests", "kv_len")}
#: traces-table rows (this engine key, model, ``engine:dtype``) holding ``{"seconds": s}``: the time tracing
#: took, counted in the model's onboarding cost; a DB from before this record counts tracing as 0
TRACE_SECONDS = "trace_seconds"


def trace_seconds(store: ProfileStore, engine: str, dtype: str, model: str) -> float | None:
    """Seconds tracing ``model`` (a calibration variant ``NAME#...`` is its own row) took, None if not recorded."""
    import json

    text = store.get_trace(TRACE_SECONDS, model, f"{engine}:{dtype}")
    return float(json.loads(text)["seconds"]) if text else None


def tracer_version() -> str:
    """Digest of the tracing code (the trace/ and engines/ packages): a cached trace is stale once any of it changes."""
    import hashlib

    import dooly.engines
    import dooly.trace

    h = hashlib.sha256()
    for pkg in (dooly.trace, dooly.engines):
        for f in sorted(Path(pkg.__file__).parent.glob("*.py")):  # type: ignore[arg-type]
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def trace_cache_key(name: str, config: Mapping[str, Any]) -> str:
    """Key of a model's traces in the store's trace cache (model, exact config, tracing code)."""
    from dooly.trace.tracer import config_hash

    return f"{name}@{config_hash(config)}@{tracer_version()}"


#: traces made in this process for a read-only store (which keeps no trace), by engine, cache key and phase: the
#: commands that only read a DB whose trace cache is stale (the tracing code changed) trace each pass once, not once
#: per predictor
_TRACED: dict[tuple[str, str, str], ModelTrace] = {}
#: folded stages' shallow traces made in this process (:func:`fold_traced`), by the role engine's context, dtype,
#: model, shallow config and phase
_ROLE_TRACES: dict[tuple[str, str, str, str, str], ModelTrace] = {}


def _remember(memo: dict, key: tuple, tr: ModelTrace) -> ModelTrace:
    """Keep ``tr`` in a process-wide ``memo`` (emptied once it holds 64: a long sweep's traces are not all kept)."""
    if len(memo) >= 64:
        memo.clear()
    memo[key] = tr
    return tr


def model_traces(
    name: str, config: Mapping[str, Any], engine: Engine, store: ProfileStore | None = None, fold: bool = False
) -> dict[str, ModelTrace]:
    """Both phases' traces of a model, from the store's trace cache when this exact config was traced (the
    time a trace took is recorded under :data:`TRACE_SECONDS`). ``fold``: a deep model whose decoder layers are
    all alike is traced at :data:`FOLD_DEPTH` layers per pipeline stage and unfolded to its depth
    (:func:`fold_traced`), the same records as a full trace at a fraction of the time."""
    import json
    import time

    from dooly.trace.tracer import trace_model

    key = trace_cache_key(name, config)
    eng_key = engine.trace_context + ":" + getattr(engine, "dtype", "float32")
    out: dict[str, ModelTrace] = {}
    spent = 0.0
    for phase in PHASE_SYMBOLS:
        cached = store.get_trace(eng_key, key, phase) if store else None
        if cached is not None:
            out[phase] = ModelTrace.from_json(cached, f"trace cache for {key}")
            continue
        memo = (eng_key, key, phase)
        keeps_nothing = store is not None and getattr(store, "readonly", False)
        if keeps_nothing and memo in _TRACED:  # traced earlier in this process for a read-only store
            out[phase] = _TRACED[memo]
            continue
        t0 = time.perf_counter()
        tr = fold_traced(config, phase, name, engine) if fold else None
        tr = tr or trace_model(config, phase, name=name, engine=engine)
        spent += time.perf_counter() - t0
        if store is not None:
            store.put_trace(eng_key, key, phase, tr.to_json())
        if keeps_nothing:
            _remember(_TRACED, memo, tr)
        out[phase] = tr
    if store is not None and spent:
        doc = json.dumps({"seconds": round(spent, 3)})
        store.put_trace(TRACE_SECONDS, name, f"{engine.name}:{getattr(engine, 'dtype', 'float32')}", doc)
    return out


# -- folded traces of deep models ------------------------------------------------------------------------------

#: decoder layers per pipeline stage a folded trace runs: the stage's first layer (which may differ: vLLM's first
#: layer norms its input without a residual to add) and two more, which must run the same signatures
FOLD_DEPTH = 3
#: config fields that make decoder layers differ from one another (a layer pattern, dense layers among MoE ones, a
#: window on some layers): a model with any of them is traced at full depth
_LAYER_VARYING = re.compile(r"layer_types|pattern|interval|freq|step|first_k|dense|window_layers|mlp_only|no_rope")


def _foldable(config: Mapping[str, Any], layers: int) -> bool:
    """Whether the config says its decoder layers are all alike: no per-layer list, no field that varies them."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    for k, v in text.items():  # type: ignore[union-attr]
        if isinstance(v, list) and len(v) == layers and len({json_key(x) for x in v}) > 1:
            return False
        if _LAYER_VARYING.search(k) and v not in (None, False, 0, [], {}):
            return False
    return True


def json_key(x: Any) -> str:
    import json

    return json.dumps(x, sort_keys=True, default=str)


def fold_traced(config: Mapping[str, Any], phase: str, name: str, engine: Engine) -> ModelTrace | None:
    """One phase of a deep model traced at :data:`FOLD_DEPTH` decoder layers per pipeline stage and unfolded to
    the stage's real layer count, or None where folding does not apply (a shallow model, layers the config or the
    traced pass shows to differ).

    The traced pass is cut at the first op of each layer: a head (before the first layer), one segment per layer
    (its ops, with whatever ran between it and the next layer) and a tail (after the last layer's last op). When
    every traced layer's segment but the stage's first runs the same signatures, the last one is repeated until
    the stage holds as many layers as vLLM gives it (``get_pp_indices``), its layer numbers moved to the real ones.
    Each branch of the phase is unfolded alike; the result records what was traced in ``meta["folded"]``."""
    from dooly.core.zoo import at_depth, num_layers
    from dooly.trace.tracer import config_hash, trace_model

    total = num_layers(config)
    pp, stage = int(getattr(engine, "pp", 1)), int(getattr(engine, "stage", 0))
    if total is None or total < pp * (FOLD_DEPTH + 2) or not _foldable(config, total):
        return None
    # the stage is traced as the same role's stage of the shortest pipeline (the engine's role_engine), once per
    # process, and told its own pipeline's size: a sweep over layouts traces each role once per tensor-parallel size
    role = engine.role_engine() if hasattr(engine, "role_engine") else engine
    role_pp, role_stage = int(getattr(role, "pp", 1)), int(getattr(role, "stage", 0))
    shallow = at_depth(config, FOLD_DEPTH * role_pp)
    if shallow is None:
        return None
    parts = [total // pp] * pp  # as vLLM splits the layers (dooly.simulator.layouts.pp_partition)
    for i in range(2, total % pp + 2):
        parts[-i] += 1
    first = sum(parts[:stage])
    memo = (role.trace_context, getattr(role, "dtype", ""), name, config_hash(shallow), phase)
    tr = _ROLE_TRACES.get(memo)
    if tr is None:
        tr = _remember(_ROLE_TRACES, memo, trace_model(shallow, phase, name=name, engine=role))
    if role is not engine:
        sized = set(getattr(engine, "pipeline_size_ops", ()))
        tr = _with_pipeline_size(tr, sized, pp, getattr(engine, "layout", dict)())
    branches = [_unfold(b, FOLD_DEPTH * role_stage, first, parts[stage]) for b in tr.branches()]
    if any(b is None for b in branches):
        return None
    main, *sides = branches
    main.sides = sides  # type: ignore[union-attr]
    for b in branches:
        b.config_hash = config_hash(config)  # type: ignore[union-attr]
        b.meta["folded"] = {"traced_layers": FOLD_DEPTH, "layers": parts[stage]}  # type: ignore[union-attr]
    return main


def _with_pipeline_size(tr: ModelTrace, ops: set[str], pp: int, layout: dict[str, int]) -> ModelTrace:
    """``tr`` and its sides (a stage traced in another pipeline) with ``ops``' last argument, the pipeline's size,
    set to ``pp`` and the meta's layout to ``layout``: the records a trace of this pipeline's stage holds."""
    import json
    from dataclasses import replace

    from dooly.trace.signature import canonical_json

    def sized(r: Any) -> Any:
        if r.signature.op not in ops:
            return r
        args = json.loads(r.signature.args)
        args["args"][-1] = pp
        return replace(r, signature=replace(r.signature, args=canonical_json(args)))

    main, *sides = [
        replace(b, records=[sized(r) for r in b.records], meta={**b.meta, **layout}, sides=[]) for b in tr.branches()
    ]
    main.sides = sides
    return main


def _unfold(tr: ModelTrace, traced_first: int, real_first: int, layers: int) -> ModelTrace | None:
    """``tr`` (a stage traced with ``FOLD_DEPTH`` layers from ``traced_first``) with ``layers`` layers from
    ``real_first``; None when its layers do not run the same signatures."""
    from dataclasses import replace

    from dooly.trace.signature import OpRecord

    recs = tr.records
    starts: list[int] = []
    seen: set[int] = set()
    for i, r in enumerate(recs):
        if r.layer is not None and r.layer not in seen and r.layer >= traced_first:
            seen.add(r.layer)
            starts.append(i)
    if len(starts) != FOLD_DEPTH:
        return None
    end = max(i for i, r in enumerate(recs) if r.layer is not None) + 1
    bounds = [*starts, end]
    segments = [recs[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    if len({tuple(r.signature.key for r in seg) for seg in segments[1:]}) != 1:
        return None  # the layers after the stage's first differ: trace the model whole
    last = segments[-1]
    out: list[OpRecord] = list(recs[: starts[0]])

    def moved(r: OpRecord, shift: int) -> OpRecord:
        if r.layer is None or r.layer < traced_first:
            return r
        new = r.layer + shift
        return replace(
            r, layer=new, module=_LAYER_NUMBER.sub(lambda m: m.group(0).replace(str(r.layer), str(new)), r.module, 1)
        )

    shift = real_first - traced_first
    for seg in segments:
        out += [moved(r, shift) for r in seg]
    for k in range(FOLD_DEPTH, layers):
        out += [
            moved(r, shift + k - (FOLD_DEPTH - 1)) if r.layer == traced_first + FOLD_DEPTH - 1 else moved(r, shift)
            for r in last
        ]
    out += recs[end:]
    records = [replace(r, order=i) for i, r in enumerate(out)]
    return ModelTrace(
        tr.model, tr.config_hash, tr.phase, tr.engine, records, dict(tr.hints), list(tr.guards), dict(tr.meta)
    )


_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
