"""Per-workload summaries that show how traces differ: event mix, syscall latency, context switches.

All numbers are computed column-wise (numpy), so they cost little even on millions of events.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tracesynth.trace import Trace

# Event families by name prefix (LTTng vocabulary), in display order.
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("syscall", ("syscall_",)),
    ("sched", ("sched_",)),
    ("fault", ("x86_exceptions_", "exceptions_", "page_fault")),
    ("irq", ("irq_",)),
    ("timer", ("timer_",)),
    ("signal", ("signal_",)),
)
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class SyscallLatency:
    """Entry->exit latency quantiles (ns) of one syscall (or all of them)."""

    name: str
    count: int
    p50_ns: float
    p90_ns: float
    p99_ns: float


@dataclass
class WorkloadSummary:
    workload: str
    events: int
    duration_s: float
    event_types: int
    events_per_s: float
    top_events: list[tuple[str, int, float]]  # (name, count, share)
    families: dict[str, float]  # family -> share of events
    context_switches_per_s: float
    syscalls_per_s: float
    syscall_latency: SyscallLatency | None
    top_syscall_latency: list[SyscallLatency] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def syscall_latencies(trace: Trace) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(latency ns as uint64, syscall code, syscall names) of every entry->exit pair, matched per thread.

    An exit pairs with the same thread's immediately preceding syscall event when that is the
    entry of the same syscall; unmatched halves (trace edges, calls that never return) are dropped.
    """
    codes, vocab = trace.codes("event")
    empty = (np.zeros(0, np.uint64), np.zeros(0, np.int32), [])
    if len(codes) == 0:
        return empty
    base: dict[str, int] = {}
    kind = np.zeros(len(vocab), dtype=np.int8)  # 1 entry, 2 exit
    sys_code = np.full(len(vocab), -1, dtype=np.int32)
    for i, name in enumerate(vocab):
        for prefix, k in (("syscall_entry_", 1), ("syscall_exit_", 2)):
            if name.startswith(prefix):
                kind[i] = k
                sys_code[i] = base.setdefault(name[len(prefix) :], len(base))
    rows = np.flatnonzero(kind[codes] > 0)
    if len(rows) == 0:
        return empty
    tid = trace.numeric("tid", fill=-1)[rows]
    ts = trace.ts[rows]
    order = np.lexsort((np.arange(len(rows)), tid))  # by thread, then time (rows are time-sorted)
    c = codes[rows][order]
    t = ts[order]
    th = tid[order]
    k = kind[c]
    s = sys_code[c]
    pair = (th[1:] == th[:-1]) & (th[1:] >= 0) & (k[:-1] == 1) & (k[1:] == 2) & (s[1:] == s[:-1])
    # exit after entry, so the difference is non-negative: exact in uint64 even across a > 2**63 ns span
    lat = (t[1:].view(np.uint64) - t[:-1].view(np.uint64))[pair]
    return lat, s[1:][pair], list(base)


def _quantiles(name: str, lat: np.ndarray) -> SyscallLatency:
    q = np.quantile(lat, QUANTILES) if len(lat) else [float("nan")] * 3
    return SyscallLatency(name, int(len(lat)), float(q[0]), float(q[1]), float(q[2]))


def summarize(trace: Trace, top: int = 8, top_syscalls: int = 5) -> WorkloadSummary:
    """The per-workload summary of one trace."""
    n = len(trace)
    dur = trace.duration_ns / 1e9
    counts = trace.event_counts()
    families = {fam: 0 for fam, _ in FAMILIES} | {"other": 0}
    for name, cnt in counts.items():
        fam = next((f for f, prefixes in FAMILIES if name.startswith(prefixes)), "other")
        families[fam] += cnt
    per_s = (lambda x: x / dur) if dur > 0 else (lambda x: float("nan"))
    lat, sys_codes, names = syscall_latencies(trace)
    by_count = np.bincount(sys_codes, minlength=len(names)) if len(names) else np.zeros(0, int)
    top_sys = [_quantiles(names[i], lat[sys_codes == i]) for i in np.argsort(-by_count, kind="stable")[:top_syscalls]]
    n_sys = sum(c for e, c in counts.items() if e.startswith("syscall_entry_"))
    return WorkloadSummary(
        workload=str(trace.metadata.get("workload") or trace.metadata.get("source") or "?"),
        events=n,
        duration_s=dur,
        event_types=len(counts),
        events_per_s=per_s(n),
        top_events=[(e, c, c / max(n, 1)) for e, c in list(counts.items())[:top]],
        families={f: c / max(n, 1) for f, c in families.items()},
        context_switches_per_s=per_s(counts.get("sched_switch", 0)),
        syscalls_per_s=per_s(n_sys),
        syscall_latency=_quantiles("all", lat) if len(lat) else None,
        top_syscall_latency=[s for s in top_sys if s.count],
    )
