"""dooly as a library: what the CLI, the demo and the bench scripts call to answer serving questions.

* :func:`load_latency_model`: the profile DB's iteration-latency predictor for a model;
* :func:`serving_latency_model`: the same for an engine, falling back to HF eager's profiles for vLLM;
* :func:`sched_config`: the scheduler settings of one serving configuration;
* :func:`memory_model`: a model's memory model on a device of a given size;
* :func:`vllm_cpu_kv_blocks`: the KV blocks vLLM's CPU backend gives a model in a KV-cache space;
* :func:`validation_predictors`: the predictors `dooly validate` scores (the profile's, and "zero new points");
* :func:`check_calibration`: whether the DB's shared overhead fit prices a new model's forwards (``--calibrate check``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dooly.engines import DEFAULT_ENGINE
from dooly.errors import DoolyError

if TYPE_CHECKING:
    from dooly.engines import Engine
    from dooly.predictor import Predictor
    from dooly.simulator import MemoryModel, SchedulerConfig
    from dooly.store import ProfileStore


def load_latency_model(
    model: str,
    db: Path,
    dtype: str = "bfloat16",
    threads: int | None = None,
    engine: str = DEFAULT_ENGINE,
    shape: bool = False,
    device: str = "cpu",
) -> Predictor:
    """The profile DB's iteration-latency predictor for `model` (profiled with the same engine settings);
    `shape`: signatures without a complete profile come from the shape model (after `dooly profile --budget`)."""
    from dooly.engines import get_engine
    from dooly.predictor import Predictor

    if not db.exists():
        raise DoolyError(f"{db}: no such profile database (run `dooly profile {model} --db {db}` first)")
    engine_obj = get_engine(engine, device=device, dtype=dtype)
    return Predictor.for_model(model, db, engine_obj, threads=threads, shape=shape)


def serving_latency_model(
    model: str,
    db: Path,
    dtype: str,
    threads: int | None,
    engine: str,
    shape: bool = False,
    log: Callable[[str], object] | None = None,
) -> tuple[Predictor, str]:
    """`engine`'s predictor for `model`; for vLLM, the HF engine's profiles while the DB has no vLLM ones.

    Returns ``(predictor, engine that profiled the ops)``; a fallback is said through `log` (default: printed)."""
    if engine != "vllm":
        return load_latency_model(model, db, dtype, threads, engine, shape), engine
    try:
        return load_latency_model(model, db, dtype, threads, "vllm", shape), "vllm"
    except (DoolyError, ImportError) as exc:  # no vLLM engine, no vLLM installed, or no profiles from it
        if log is None:
            from rich.console import Console

            log = Console().print
        log(f"[yellow]ops profiled with {DEFAULT_ENGINE}[/] (no vLLM profiles for {model}: {exc})")
        return load_latency_model(model, db, dtype, threads, DEFAULT_ENGINE, shape), DEFAULT_ENGINE


def sched_config(max_seqs: int, max_tokens: int, chunked: bool, block_size: int, kv_blocks: int) -> SchedulerConfig:
    """The scheduler settings of one serving configuration."""
    from dooly.simulator import SchedulerConfig

    return SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_tokens,
        chunked_prefill=chunked,
        block_size=block_size,
        num_kv_blocks=kv_blocks,
    )


def memory_model(
    model: str,
    memory_gb: float,
    utilization: float,
    dtype: str,
    kv_cache_dtype: str,
    activation_gb: float | None,
    engine: str = DEFAULT_ENGINE,
) -> MemoryModel:
    """MODEL's memory model on a device of `memory_gb` GiB (its config from the zoo or a config path)."""
    from dooly.engines import get_engine
    from dooly.simulator import MemoryModel
    from dooly.zoo import resolve_model

    config, name = resolve_model(model)[1], Path(model).stem
    limits = (memory_gb, utilization, dtype, kv_cache_dtype, activation_gb)
    return MemoryModel(config, *limits, name=name, engine=get_engine(engine, dtype=dtype))


def vllm_cpu_kv_blocks(model: str, gb: int, block_size: int, dtype: str) -> int:
    """vLLM CPU-backend KV blocks for MODEL; its architecture read as the memory model reads it everywhere
    (the HF engine's view of the config: vLLM builds its models from the same transformers config)."""
    from dooly.engines import get_engine
    from dooly.simulator import cpu_kv_blocks
    from dooly.units import dtype_bytes
    from dooly.zoo import resolve_model

    arch = get_engine(DEFAULT_ENGINE, dtype=dtype).architecture(resolve_model(model)[1])
    return cpu_kv_blocks(arch, gb, block_size, dtype_bytes(dtype))


def check_calibration(
    model: str, db: Path, store: ProfileStore, engine: Engine, threads: int | None
) -> tuple[bool, str]:
    """``dooly profile --calibrate check``: measure the model's forwards at the check shapes (stored as
    ``NAME#check``) and compare each with what the DB predicts without any calibration of its own (the
    overhead fitted once per engine and hardware over the other models); returns (passed, one line saying why).
    The check passes when every shape lands within :data:`~dooly.profiler.calibrate.CHECK_TOLERANCE` plus the
    stated uncertainty of the share of the pass predicted from shape."""
    from dooly.predictor import Predictor
    from dooly.profiler import context_for
    from dooly.profiler.calibrate import CHECK_TOLERANCE, check_forwards
    from dooly.zoo import resolve_model

    name, cfg = resolve_model(model)
    try:
        pred = Predictor.for_model(model, db, engine, threads=threads, shape=True)
    except DoolyError as exc:  # e.g. signatures that failed to time: the full calibration still fits it
        return False, f"cannot predict it from the DB ({exc})"
    if set(pred.overhead.coef) != {"prefill", "decode"}:
        return False, "no shared overhead fit on this engine and hardware yet"
    measured = check_forwards(name, cfg, store, engine, context_for(engine, threads), threads=threads)
    worst, parts = 0.0, []
    for (phase, point), seconds in measured.items():
        values = json.loads(point)
        err = abs(pred.forward_latency(phase, values) - seconds) / seconds
        tol = CHECK_TOLERANCE + pred.shape_share(phase, values)[1]
        worst = max(worst, err / tol)
        parts.append(f"{phase} {100 * err:.1f}% (within {100 * tol:.0f}%: {'yes' if err <= tol else 'no'})")
    what = f"shared fit of {pred.overhead.n_fit.get('decode', 0)} decode forwards vs {len(measured)} checked: "
    return worst <= 1.0, what + ", ".join(parts)


def validation_predictors(
    model: str, db: Path, engine: Engine, threads: int | None, method: str, shape: bool
) -> tuple[dict[str, Predictor], dict[str, DoolyError]]:
    """``dooly validate``'s predictors for `model`, by label: "profile" (the DB as profiled; `shape`: signatures
    without a complete profile from the shape model) and "zero new points" (the model predicted as if never
    profiled), with the error of each label that could not be built. Raises the "profile" error when neither
    could."""
    from dooly.predictor import Predictor

    predictors: dict[str, Predictor] = {}
    failed: dict[str, DoolyError] = {}
    for label, kw in (("profile", {"shape": shape}), ("zero new points", {"holdout": True})):
        try:
            predictors[label] = Predictor.for_model(model, db, engine, threads=threads, method=method, **kw)
        except DoolyError as exc:
            failed[label] = exc
    if "profile" in failed and not predictors:
        raise failed["profile"]
    return predictors, failed
