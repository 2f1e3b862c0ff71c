"""The passes of a model's traces: the key of each (phase and branch), and the signatures they hold."""

from __future__ import annotations

from collections.abc import Mapping


def branch_keys(phase: str, trace: object) -> list[str]:
    """Keys of a phase's passes: the phase for the trace itself, ``phase/i`` for its i-th side."""
    return [phase] + [f"{phase}/{i}" for i in range(1, len(trace.branches()))]  # type: ignore[attr-defined]


def signature_keys(traces: Mapping[str, object]) -> set[str]:
    """Every signature key of a model's traced passes (all phases and branches)."""
    return {s.key for tr in traces.values() for s in tr.all_unique()}  # type: ignore[attr-defined]
