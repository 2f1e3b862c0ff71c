"""Byte sizes: how wide a dtype's elements are, and a size as a reader wants it (GiB, or MiB when small)."""

from __future__ import annotations

from dooly.core.errors import DoolyError

GIB = 2**30
FP8_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def size(nbytes: int) -> str:
    """Bytes as GiB, or MiB below one GiB (small test models would read as 0.00 GiB)."""
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.1f} MiB"


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``bfloat16``, ``float16``, ``float32``) or an fp8 KV dtype."""
    if dtype in FP8_NAMES:
        return 1
    import torch

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise DoolyError(f"unknown dtype {dtype!r} (use a torch dtype name such as bfloat16, or fp8)")
    return torch.empty((), dtype=dt).element_size()
