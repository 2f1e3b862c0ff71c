"""A model's traces, from the store's trace cache when this exact config and tracing code were traced before."""

from __future__ import annotations

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


def model_traces(
    name: str, config: Mapping[str, Any], engine: Engine, store: ProfileStore | None = None
) -> dict[str, ModelTrace]:
    """Both phases' traces of a model, from the store's trace cache when this exact config was traced (the
    time a trace took is recorded under :data:`TRACE_SECONDS`)."""
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
        t0 = time.perf_counter()
        tr = trace_model(config, phase, name=name, engine=engine)
        spent += time.perf_counter() - t0
        if store is not None:
            store.put_trace(eng_key, key, phase, tr.to_json())
        out[phase] = tr
    if store is not None and spent:
        doc = json.dumps({"seconds": round(spent, 3)})
        store.put_trace(TRACE_SECONDS, name, f"{engine.name}:{getattr(engine, 'dtype', 'float32')}", doc)
    return out
