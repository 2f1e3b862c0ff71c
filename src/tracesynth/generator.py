"""The interface every generator (the diffusion model and each baseline) implements.

The evaluation harness only ever sees this, so it scores every generator the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from tracesynth.trace import Trace


@runtime_checkable
class Generator(Protocol):
    name: str

    def fit(self, traces: Sequence[Trace]) -> Generator:
        """Learn from real traces; returns self."""
        ...

    def sample(self, n_events: int, seed: int = 0) -> Trace:
        """Generate a synthetic trace of n_events events; the same seed gives the same trace."""
        ...

    def save(self, directory: str | Path) -> Path:
        """Write the fitted generator to a directory (JSON + safetensors, no pickle)."""
        ...

    @classmethod
    def load(cls, directory: str | Path) -> Generator:
        """Read a generator written by save()."""
        ...
