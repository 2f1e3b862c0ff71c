"""dooly as a library: what the CLI, the demo and the bench scripts call to answer serving questions.

* :func:`load_latency_model`: the profile DB's iteration-latency predictor for a model;
* :func:`serving_latency_model`: the same for an engine, falling back to HF eager's profiles for vLLM;
* :func:`sched_config`: the scheduler settings of one serving configuration;
* :func:`memory_model`: a model's memory model on a device of a given size;
* :func:`vllm_cpu_kv_blocks`: the KV blocks vLLM's CPU backend gives a model in a KV-cache space.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dooly.engines import DEFAULT_ENGINE
from dooly.errors import DoolyError

if TYPE_CHECKING:
    from dooly.predictor import Predictor
    from dooly.simulator import MemoryModel, SchedulerConfig


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
