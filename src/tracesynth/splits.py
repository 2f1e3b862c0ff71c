"""Train / validation / test splits by contiguous time blocks.

Windows are cut inside a block, never across two, so no test window (nor any overlap of one)
reaches training. Every component that needs a split (model, constraints, evaluation) uses this.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tracesynth.errors import TraceSynthError
from tracesynth.trace import Trace


def split_by_time(trace: Trace, fractions: Sequence[float] = (0.8, 0.1, 0.1)) -> list[Trace]:
    """Cut a trace into consecutive blocks holding the given fractions of its events, in time order."""
    fr = np.asarray(fractions, dtype=float)
    if np.any(fr < 0) or not np.isclose(fr.sum(), 1.0):
        raise TraceSynthError(f"split fractions must be non-negative and sum to 1, got {list(fractions)}")
    bounds = np.round(np.concatenate([[0.0], np.cumsum(fr)]) * len(trace)).astype(int)
    bounds[-1] = len(trace)
    return [trace.slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
