"""Trace a model: one dummy request through the engine per phase, every aten op recorded with provenance.

``trace_model(config, phase)`` builds the model from its config under a ``FakeTensorMode`` (weights cost no
memory, so 8B and MoE models trace on a laptop), asks the engine to prepare one forward pass whose request sizes
are symbolic (:class:`dooly.taint.RequestSymbols`), and runs the engine's ``forward`` with an
:class:`~dooly.taint.OpRecorder` on top. The engine's own eager code runs op by op -- masks, rotary embeddings,
grouped-query ``repeat_kv``, the sdpa kernel the CPU backend picks, the KV cache's ``cat`` -- and each op is
written as a :class:`~dooly.signature.Signature` whose sizes are ints (model constants) or expressions over
``requests``, ``tokens``, ``kv_len``.

Phases: ``prefill`` (``requests`` x ``tokens`` new tokens, empty cache), ``decode`` (``requests`` sequences
each adding one token to a cache of ``kv_len`` tokens, the cache filled by the engine's own prefill) and ``chunk``
(a chunked-prefill step: ``tokens`` new tokens on top of ``kv_len`` cached ones).

The dummy request is a batch of equal-length sequences without padding (all-ones attention mask, token id 0),
so the engine takes the branches of such a batch (e.g. a causal sdpa without a materialised mask in prefill);
the trace's ``guards`` list the conditions on request sizes it relied on (e.g. ``kv_len < 4095`` against a
sliding window of 4096).

There is no per-architecture code here, in :mod:`dooly.taint` or in :mod:`dooly.engines`: a model is its config.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from dooly.engines import Engine, RequestShape, get_engine
from dooly.errors import DoolyError
from dooly.signature import PHASES, ModelTrace, OpRecord, canonical_json, layer_of
from dooly.taint import OpRecorder, RequestSymbols

#: Dummy request values. Any values >= 2 give the same signatures (they only steer guards); they are distinct
#: so a reader of a raw trace can tell them apart, and kv_len is a realistic mid-generation length.
DEFAULT_HINTS: dict[str, dict[str, int]] = {
    "prefill": {"requests": 3, "tokens": 37},
    "decode": {"requests": 3, "kv_len": 113},
    "chunk": {"requests": 3, "tokens": 37, "kv_len": 113},
}


def config_hash(config: Mapping[str, Any]) -> str:
    """Stable digest of a config dict (what the model is, not where it came from)."""
    body = {k: v for k, v in config.items() if not k.startswith("_")}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()[:16]


@contextmanager
def _module_tracking(model: torch.nn.Module) -> Iterator[list[str]]:
    """Keep a stack of the dotted names of the modules currently running (global forward hooks)."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        stack.append(names.get(id(module), stack[-1] if stack else ""))

    def post(module: torch.nn.Module, args: Any, out: Any) -> None:
        if stack:
            stack.pop()

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    h1 = register_module_forward_pre_hook(pre)
    h2 = register_module_forward_hook(post, always_call=True)
    try:
        yield stack
    finally:
        h1.remove()
        h2.remove()


def trace_model(
    config: Mapping[str, Any],
    phase: str = "prefill",
    *,
    name: str | None = None,
    engine: Engine | None = None,
    hints: Mapping[str, int] | None = None,
) -> ModelTrace:
    """Trace one phase of the model described by ``config`` (a config.json dict with ``model_type``)."""
    if phase not in PHASES:
        raise DoolyError(f"unknown phase {phase!r} (expected one of {', '.join(PHASES)})")
    engine = engine or get_engine()
    values = dict(DEFAULT_HINTS[phase])
    values.update(hints or {})
    t0 = time.perf_counter()

    syms = RequestSymbols()
    with syms.fake_mode:
        model = engine.build_model(config)
    requests = syms.new("requests", values["requests"])
    if phase == "prefill":
        shape = RequestShape.prefill(requests, syms.new("tokens", values["tokens"]))
    elif phase == "decode":
        shape = RequestShape.decode(requests, syms.new("kv_len", values["kv_len"]))
    else:
        shape = RequestShape(requests, syms.new("tokens", values["tokens"]), syms.new("kv_len", values["kv_len"]))
    t_build = time.perf_counter() - t0

    try:
        with syms.fake_mode, syms.int_sites(), engine.tracing_context(), _module_tracking(model) as stack:
            recorder = OpRecorder(syms, engine.engine_id, lambda: stack[-1] if stack else "")
            with recorder:
                inputs = engine.prepare(model, shape)  # tracked for values (the cache prefill), not recorded
                recorder.recording = True
                engine.forward(model, inputs)
                recorder.recording = False
    except DoolyError:
        raise
    except Exception:
        # A request size the code turned into a constant can break the pass later on (e.g. an SSM's chunk step
        # adds the cached length to a shape it fixed at prefill); that is the reason to report, as in the other
        # phases. Any other failure is not explained by the labelling and keeps its traceback.
        syms.check_specialised()
        raise
    syms.check_specialised()

    records = [OpRecord(sig, i, module, layer_of(module), view) for i, (sig, module, view) in enumerate(recorder.calls)]
    meta = dict(engine.describe(model))
    meta.update({"seconds": round(time.perf_counter() - t0, 3), "build_seconds": round(t_build, 3)})
    meta["parameters"] = int(sum(p.numel() for p in model.parameters()))
    meta["data_reads"] = recorder.data_reads[:50]
    return ModelTrace(
        model=name or str(config.get("_name_or_path") or config.get("model_type")),
        config_hash=config_hash(config),
        phase=phase,
        engine=engine.engine_id,
        records=records,
        hints=dict(syms.hints),
        guards=syms.guards(),
        meta=meta,
    )


def overlap_matrix(traces: list[ModelTrace]) -> list[list[float]]:
    """``m[i][j]``: share of model i's unique signatures that model j also has (1.0 on the diagonal)."""
    sets = [set(t.unique()) for t in traces]
    return [[len(a & b) / len(a) if a else 0.0 for b in sets] for a in sets]


__all__ = ["DEFAULT_HINTS", "config_hash", "overlap_matrix", "trace_model"]
