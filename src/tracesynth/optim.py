"""What every tracesynth network trains with: the learning-rate schedule and the device."""

from __future__ import annotations

import math
import os

import torch

from tracesynth.errors import TraceSynthError


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun environment; (0, 1, 0) otherwise."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def resolve_device(name: str) -> torch.device:
    """cpu, cuda or cuda:N; under torchrun each process takes the GPU of its local rank."""
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TraceSynthError("--device cuda asked for, but no CUDA GPU is available")
        if name == "cuda":
            return torch.device("cuda", world()[2] % torch.cuda.device_count())
    return torch.device(name)


def warmup_cosine(peak: float, step: int, warmup: int, steps: int, time_limit: float | None, elapsed: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak by steps or by time, whichever is further
    along: a run stopped by its time limit still ends annealed (every tracesynth network trains on this)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    if time_limit:
        frac = max(frac, elapsed / time_limit)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
