"""Trace a model: one dummy request through the engine per phase, every aten op recorded with provenance.

``trace_model(config, phase)`` builds the model from its config under a ``FakeTensorMode`` (weights cost no
memory, so 8B and MoE models trace on a laptop), asks the engine to prepare one forward pass whose request sizes
are symbolic (:class:`dooly.trace.taint.RequestSymbols`), and runs the engine's ``forward`` with an
:class:`~dooly.trace.taint.OpRecorder` on top. The engine's own eager code runs op by op -- masks, rotary embeddings,
grouped-query ``repeat_kv``, the sdpa kernel the CPU backend picks, the KV cache's ``cat`` -- and each op is
written as a :class:`~dooly.trace.signature.Signature` whose sizes are ints (model constants) or expressions over
``requests``, ``tokens``, ``kv_len``.

Phases: ``prefill`` (``requests`` x ``tokens`` new tokens, empty cache), ``decode`` (``requests`` sequences
each adding one token to a cache of ``kv_len`` tokens, the cache filled by the engine's own prefill) and ``chunk``
(a chunked-prefill step: ``tokens`` new tokens on top of ``kv_len`` cached ones).

The dummy request is a batch of equal-length sequences without padding (all-ones attention mask, token id 0),
so the engine takes the branches of such a batch (e.g. a causal sdpa without a materialised mask in prefill);
the trace's ``guards`` list the conditions on request sizes it relied on (e.g. ``kv_len < 4095`` against a
sliding window of 4096).

There is no per-architecture code here, in :mod:`dooly.trace.taint` or in :mod:`dooly.engines`: a model is its config.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import sympy
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import UnsupportedOperatorException

from dooly.core.digest import config_hash
from dooly.core.errors import DoolyError, one_line
from dooly.engines import Engine, RequestShape, get_engine
from dooly.trace.signature import PHASES, ModelTrace, OpRecord, layer_of
from dooly.trace.taint import OpRecorder, RequestSymbols, SpecialisedError, render_guard

#: Dummy request values. Any values >= 2 give the same signatures (they only steer guards); they are distinct
#: so a reader of a raw trace can tell them apart, and kv_len is a realistic mid-generation length.
DEFAULT_HINTS: dict[str, dict[str, int]] = {
    "prefill": {"requests": 3, "tokens": 37},
    "decode": {"requests": 3, "kv_len": 113},
    "chunk": {"requests": 3, "tokens": 37, "kv_len": 113},
}


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


#: At most this many branches (the trace and its sides) per phase: code with more paths over request sizes is
#: refused rather than traced in part.
MAX_BRANCHES = 8


def real_run_failure(
    engine: Engine, config: Mapping[str, Any], phase: str | None, values: Mapping[str, int]
) -> str | None:
    """Why a real run of ``engine`` (real tensors, the request ``values``) fails in ``phase`` (None: building the
    model only), in one line; None if it runs."""
    try:
        with torch.no_grad():
            model = engine.build_model(config)
            if phase is not None:
                tokens = 1 if phase == "decode" else int(values["tokens"])
                shape = RequestShape(int(values["requests"]), tokens, int(values.get("kv_len", 0)))
                engine.forward(model, engine.prepare(model, shape))
    except Exception as exc:  # noqa: BLE001 - any failure of the engine's own code is the answer
        return one_line(exc)
    return None


def _engine_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback outside torch: the engine code at fault."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def _no_fake_impl(exc: UnsupportedOperatorException, where: str) -> DoolyError:
    """A custom op (an engine's compiled kernel) with no shape-only implementation cannot run on fake tensors."""
    return DoolyError(
        f"the engine calls {exc.func} in {where}, an op with no fake (shape-only) implementation, "
        "so the model cannot be traced"
    )


def trace_model(
    config: Mapping[str, Any],
    phase: str = "prefill",
    *,
    name: str | None = None,
    engine: Engine | None = None,
    hints: Mapping[str, int] | None = None,
) -> ModelTrace:
    """Trace one phase of the model described by ``config`` (a config.json dict with ``model_type``).

    Where the engine's code branches on a request size (a guard that does not hold for every size, e.g. a
    sliding window shorter than the context), the other side of each branch is traced too, at request sizes
    where the guards fail: the result's ``sides`` (see :func:`_explore`), each exact where its guards hold.
    """
    if phase not in PHASES:
        raise DoolyError(f"unknown phase {phase!r} (expected one of {', '.join(PHASES)})")
    from dooly.core.zoo import check_sizes

    # time and memory grow with the layers traced: a config far beyond any model is refused, not run for hours
    check_sizes(config, str(name or config.get("_name_or_path") or config.get("model_type")))
    engine = engine or get_engine()
    values = dict(DEFAULT_HINTS[phase])
    values.update(hints or {})
    t0 = time.perf_counter()
    first = _trace_once(config, phase, values, name, engine)
    branches = _explore(config, phase, values, name, engine, first)
    main = branches[0]
    main.sides = branches[1:]
    main.meta["seconds"] = round(time.perf_counter() - t0, 3)
    return main


def _composites_symbolic():
    """Before torch 2.13 some C++ composite ops (matmul, linear) read sizes as ints, which fixes every request
    size; there the Python dispatcher runs torch's Python decompositions of them instead, which keep sizes
    symbolic (they can add a copy that eager does not make). From 2.13 the C++ ones match eager op for op."""
    old = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
    return enable_python_dispatcher() if old else nullcontext()


def _build_on_fakes(config: Mapping[str, Any], engine: Engine, syms: RequestSymbols, values: Mapping[str, int]):  # type: ignore[no-untyped-def]
    """``engine``'s model for ``config``, built on fake tensors; a failure says whether it builds at all."""
    try:
        with syms.fake_mode:
            return engine.build_model(config)
    except DoolyError:
        raise
    except UnsupportedOperatorException as exc:
        raise _no_fake_impl(exc, "building the model") from None
    except Exception as exc:
        # the engine's constructor failed on fake tensors: say whether it builds at all, else where fakes break it
        # (a constant it computes with torch and reads back, a module it builds on the meta device)
        real = real_run_failure(engine, config, None, values)
        if real is not None:
            raise DoolyError(f"the engine cannot build this model even on real tensors ({real})") from None
        raise DoolyError(
            f"the model builds on real tensors but not on fake ones, so it cannot be traced "
            f"({one_line(exc)} at {_engine_frame(exc)})"
        ) from None


def _request_shape(syms: RequestSymbols, phase: str, values: Mapping[str, int]) -> RequestShape:
    """The dummy request of ``phase`` at ``values``, its sizes symbolic (``requests`` made first)."""
    requests = syms.new("requests", values["requests"])
    if phase == "prefill":
        return RequestShape.prefill(requests, syms.new("tokens", values["tokens"]))
    if phase == "decode":
        return RequestShape.decode(requests, syms.new("kv_len", values["kv_len"]))
    return RequestShape(requests, syms.new("tokens", values["tokens"]), syms.new("kv_len", values["kv_len"]))


def _trace_once(
    config: Mapping[str, Any],
    phase: str,
    values: Mapping[str, int],
    name: str | None,
    engine: Engine,
    allow_constants: bool = False,
) -> tuple[ModelTrace, list[sympy.Basic]]:
    """One traced pass at the dummy request ``values``, and the guards (sympy, over the named request symbols)
    its control flow relied on. The trace's ``guards`` are filled in by :func:`_explore`. ``allow_constants``:
    a request size the code fixes stays fixed (the guards then pin it to that value)."""
    t0 = time.perf_counter()
    syms = RequestSymbols()
    syms.allow_constants = allow_constants
    model = _build_on_fakes(config, engine, syms, values)
    shape = _request_shape(syms, phase, values)
    t_build = time.perf_counter() - t0

    try:
        with (
            syms.fake_mode,
            _composites_symbolic(),
            syms.int_sites(),
            engine.tracing_context(),
            _module_tracking(model) as stack,
        ):
            recorder = OpRecorder(syms, engine.engine_id, lambda: stack[-1] if stack else "")
            with recorder:
                inputs = engine.prepare(model, shape)  # tracked for values (the cache prefill), not recorded
                recorder.recording = True
                engine.forward(model, inputs)
                recorder.recording = False
    except DoolyError:
        raise
    except UnsupportedOperatorException as exc:
        raise _no_fake_impl(exc, f"its {phase}") from None
    except Exception:
        # A request size the code turned into a constant can break the pass later on (e.g. an SSM's chunk step
        # adds the cached length to a shape it fixed at prefill); that is the reason to report, as in the other
        # phases. Where the engine's own code fails on real tensors too, there is nothing to trace: one line says
        # so. Any other failure is a tracer bug and keeps its traceback.
        syms.check_specialised()
        real = real_run_failure(engine, config, phase, values)
        if real is not None:
            raise DoolyError(f"the engine cannot run this model's {phase} even on real tensors ({real})") from None
        raise
    syms.check_specialised()

    records = [OpRecord(sig, i, module, layer_of(module), view) for i, (sig, module, view) in enumerate(recorder.calls)]
    meta = dict(engine.describe(model))
    meta.update({"seconds": round(time.perf_counter() - t0, 3), "build_seconds": round(t_build, 3)})
    meta["parameters"] = int(sum(p.numel() for p in model.parameters()))
    meta["data_reads"] = recorder.data_reads[:50]
    trace = ModelTrace(
        model=name or str(config.get("_name_or_path") or config.get("model_type")),
        config_hash=config_hash(config),
        phase=phase,
        engine=engine.engine_id,
        records=records,
        hints=dict(syms.hints),
        meta=meta,
    )
    return trace, syms.guards()


# -- branches over request sizes ------------------------------------------------------------------------------

_REQUESTS_LIMIT = 1024  # largest batch the exploration tries
_POSITIONS_LIMIT = 1 << 17  # largest context it tries when the config sets no limit


def _candidates(values: Mapping[str, int], positions: int | None) -> list[dict[str, int]]:
    """Request sizes the exploration checks guards at: the dummy request with one size changed at a time to small
    sizes, powers of two and their neighbours (the usual thresholds), within the model's positions."""
    limit = min(positions or _POSITIONS_LIMIT, _POSITIONS_LIMIT)
    out = [dict(values)]
    for s in sorted(values):
        top = _REQUESTS_LIMIT if s == "requests" else limit
        sizes = set(range(2, 9)) | {2**k + d for k in range(3, top.bit_length()) for d in (-1, 0, 1)}
        for v in sorted(x for x in sizes if 2 <= x <= top):
            pt = {**values, s: v}
            if pt.get("tokens", 1) + pt.get("kv_len", 0) <= limit:
                out.append(pt)
    return out


class _Guards:
    """Guards evaluated at concrete request sizes (memoised on the symbols each one uses)."""

    def __init__(self) -> None:
        self._memo: dict[tuple, bool] = {}

    def holds(self, g: sympy.Basic, pt: Mapping[str, int]) -> bool:
        free = sorted(g.free_symbols, key=str)
        key = (g, tuple(pt.get(str(x), 0) for x in free))
        hit = self._memo.get(key)
        if hit is None:
            try:
                hit = bool(g.xreplace({x: sympy.Integer(pt.get(str(x), 0)) for x in free}))
            except (TypeError, ZeroDivisionError):
                # not decidable at these sizes (or the code's own arithmetic divides by zero there, so no run
                # has them): not a branch dooly can split on
                hit = True
            self._memo[key] = hit
        return hit

    def region(self, guards: list[sympy.Basic], pt: Mapping[str, int]) -> bool:
        return all(self.holds(g, pt) for g in guards)

    def boundary(self, g: sympy.Basic, good: Mapping[str, int], bad: Mapping[str, int]) -> list[dict[str, int]]:
        """Where ``g`` flips on the way from ``good`` (holds) to ``bad`` (fails), when they differ in one size:
        the last size where it holds and the first where it fails (thresholds need not be powers of two)."""
        diff = [s for s in good if good[s] != bad.get(s)]
        if len(diff) != 1:
            return []
        (s,) = diff
        lo, hi = good[s], bad[s]  # holds at lo, fails at hi
        while abs(hi - lo) > 1:
            mid = (lo + hi) // 2
            if self.holds(g, {**good, s: mid}):
                lo = mid
            else:
                hi = mid
        return [{**good, s: lo}, {**good, s: hi}]


def _explore(
    config: Mapping[str, Any],
    phase: str,
    values: Mapping[str, int],
    name: str | None,
    engine: Engine,
    first: tuple[ModelTrace, list[sympy.Basic]],
) -> list[ModelTrace]:
    """The trace at ``values`` and one more per region of request sizes its guards leave out, until every candidate
    size (:func:`_candidates`, refined to each guard's threshold) lies where some branch's guards all hold.
    Each branch keeps, as its ``guards``, those that fail somewhere among the candidates (the others hold for
    every size tried: they say nothing about where the branch applies)."""
    from dooly.core.zoo import max_positions

    ev = _Guards()
    cands = _candidates(values, max_positions(config))
    branches = [first]
    while True:
        for tr, guards in branches:
            for g in guards:
                for pt in [p for p in cands if not ev.holds(g, p)]:
                    cands.extend(p for p in ev.boundary(g, tr.hints, pt) if p not in cands)
        uncovered = [p for p in cands if not any(ev.region(gs, p) for _, gs in branches)]
        if not uncovered:
            break
        if len(branches) >= MAX_BRANCHES:
            raise DoolyError(
                f"the engine's code takes more than {MAX_BRANCHES} paths over request sizes in {phase} "
                f"(no traced branch covers {uncovered[0]}); it is not traced in part"
            )
        try:
            branches.append(_trace_once(config, phase, uncovered[0], name, engine))
        except SpecialisedError:
            # a path taken at this one size (a threshold met exactly): traced there with the size as a constant
            branches.append(_trace_once(config, phase, uncovered[0], name, engine, allow_constants=True))
    out = []
    for tr, guards in branches:
        # guards that flip at the same candidate sizes say the same thing: the shortest one is kept
        by_truth: dict[tuple[bool, ...], str] = {}
        try:
            for g in guards:
                truth = tuple(ev.holds(g, p) for p in cands)
                if all(truth):
                    continue
                text = render_guard(g)
                if truth not in by_truth or len(text) < len(by_truth[truth]):
                    by_truth[truth] = text
            tr.guards = list(by_truth.values())
        except DoolyError as exc:
            raise DoolyError(f"the engine's code branches on a request size dooly cannot write ({exc})") from None
        out.append(tr)
    return out


def overlap_matrix(traces: list[ModelTrace]) -> list[list[float]]:
    """``m[i][j]``: share of model i's unique signatures that model j also has (1.0 on the diagonal)."""
    sets = [set(t.unique()) for t in traces]
    return [[len(a & b) / len(a) if a else 0.0 for b in sets] for a in sets]


__all__ = ["DEFAULT_HINTS", "MAX_BRANCHES", "config_hash", "overlap_matrix", "trace_model"]
