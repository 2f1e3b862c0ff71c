"""The learning-rate schedule every tracesynth network trains on."""

from __future__ import annotations

import math


def warmup_cosine(peak: float, step: int, warmup: int, steps: int, time_limit: float | None, elapsed: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak by steps or by time, whichever is further
    along: a run stopped by its time limit still ends annealed (every tracesynth network trains on this)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    if time_limit:
        frac = max(frac, elapsed / time_limit)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
