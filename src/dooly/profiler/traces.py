"""A model's traces, from the store's trace cache when this exact config and tracing code were traced before."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dooly.engines import Engine
from dooly.signature import ModelTrace
from dooly.store import ProfileStore

PHASE_SYMBOLS = {"prefill": ("requests", "tokens"), "decode": ("requests", "kv_len")}


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
