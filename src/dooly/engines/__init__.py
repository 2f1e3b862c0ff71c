"""Inference engines behind one interface (:class:`Engine`), found by name in a registry.

The default is HF transformers eager on the CPU; ``vllm`` is vLLM's own model code and CPU kernels, in-process
(:mod:`dooly.engines.vllm`, needs the ``vllm`` package). Another engine registers a factory under its
name with :func:`register_engine`; every command that takes ``--engine`` then finds it.
"""

from __future__ import annotations

from collections.abc import Callable

from dooly.core.errors import DoolyError
from dooly.engines.base import Engine, Executor, RequestShape

DEFAULT_ENGINE = "hf-eager"


def _hf_eager(device: str, dtype: str) -> Engine:
    from dooly.engines.hf import HFEagerEngine  # transformers is imported only when the engine is used

    return HFEagerEngine(device=device, dtype=dtype)


def _vllm(device: str, dtype: str, tp: int = 1, pp: int = 1, pp_stage: int = 0) -> Engine:
    from dooly.engines.vllm import VLLMEngine  # vllm is imported only when the engine is used

    return VLLMEngine(device, dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_stage=pp_stage)


_REGISTRY: dict[str, Callable[[str, str], Engine]] = {"hf-eager": _hf_eager, "vllm": _vllm}


def register_engine(name: str, factory: Callable[[str, str], Engine]) -> None:
    """Make ``get_engine(name, device, dtype)`` build ``factory(device, dtype)``."""
    _REGISTRY[name] = factory


def engine_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


#: engines that build one rank of a tensor- or pipeline-parallel replica (their factory takes ``tp``, ``pp`` and
#: ``pp_stage``)
PARALLEL_ENGINES = {"vllm"}


def get_engine(
    name: str = DEFAULT_ENGINE,
    device: str = "cpu",
    dtype: str = "bfloat16",
    *,
    tp: int = 1,
    pp: int = 1,
    pp_stage: int = 0,
) -> Engine:
    """An engine by name (``"hf-eager"``) on ``device`` (``"cpu"``, ``"cuda"``) with weights in ``dtype``; ``tp``
    and ``pp`` > 1: the engine runs one rank of a replica split over ``tp`` x ``pp`` devices (the first
    tensor-parallel rank of pipeline stage ``pp_stage``)."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise DoolyError(f"unknown engine {name!r} (known: {', '.join(_REGISTRY)})")
    if tp == pp == 1 and pp_stage == 0:
        return factory(device, dtype)
    if name not in PARALLEL_ENGINES:
        raise DoolyError(
            f"engine {name}: no tensor or pipeline parallelism (--tp/--pp need one of: {', '.join(PARALLEL_ENGINES)})"
        )
    return factory(device, dtype, tp=tp, pp=pp, pp_stage=pp_stage)  # type: ignore[call-arg]


__all__ = [
    "DEFAULT_ENGINE",
    "PARALLEL_ENGINES",
    "Engine",
    "Executor",
    "RequestShape",
    "engine_names",
    "get_engine",
    "register_engine",
]
