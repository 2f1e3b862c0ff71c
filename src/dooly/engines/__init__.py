"""Inference engines behind one interface (:class:`Engine`); the default is HF transformers eager on the CPU."""

from __future__ import annotations

from dooly.engines.base import Engine, RequestShape
from dooly.errors import DoolyError

ENGINES = ("hf-eager",)


def get_engine(name: str = "hf-eager", device: str = "cpu", dtype: str = "bfloat16") -> Engine:
    """An engine by name (``"hf-eager"``) on ``device`` (``"cpu"``, ``"cuda"``) with weights in ``dtype``."""
    if name == "hf-eager":
        from dooly.engines.hf import HFEagerEngine

        return HFEagerEngine(device=device, dtype=dtype)
    raise DoolyError(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")


__all__ = ["ENGINES", "Engine", "RequestShape", "get_engine"]
