"""tracesynth.kernel: the kernel's rules, stepped one chain at a time (KernelState, the guided Markov chain's)
or many at once (KernelStates, the token models' guide), agree with each other and with the checker."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from tracesynth.constraints import check_trace, mine_rules
from tracesynth.kernel import CLOSED, NEVER, EventTables, KernelFacts, KernelState, KernelStates
from tracesynth.trace import Trace

NAMES = [
    "sched_switch",
    "sched_process_exit",
    "syscall_entry_read",
    "syscall_exit_read",
    "syscall_entry_write",
    "syscall_exit_write",
    "syscall_entry_exit_group",
    "timer",
]


def _tables(convention: str = "prev") -> EventTables:
    return EventTables.of(NAMES, KernelFacts(convention, ["exit_group"]))


def test_pairing_rows() -> None:
    t = _tables()
    ev = {n: i for i, n in enumerate(NAMES)}
    assert t.allows(NEVER, ev["syscall_exit_read"])  # before its first syscall event: anything
    assert not t.allows(CLOSED, ev["syscall_exit_read"]) and t.allows(CLOSED, ev["syscall_entry_read"])
    read = t.call_of[ev["syscall_entry_read"]]
    inside = [n for n in NAMES if t.allows(read, ev[n])]
    assert inside == ["sched_switch", "sched_process_exit", "syscall_exit_read", "syscall_entry_exit_group", "timer"]
    assert t.state_after[ev["syscall_entry_read"]] == read and t.state_after[ev["syscall_exit_read"]] == CLOSED
    assert t.state_after[ev["timer"]] == NEVER  # unchanged
    assert t.last_event == ev["sched_process_exit"]


@pytest.mark.parametrize("convention", ["prev", "next"])
def test_one_chain_and_many_chains_step_alike(convention: str) -> None:
    """The same random events (threads 1..5 on CPUs 1..3) leave KernelState and KernelStates in one state."""
    t = _tables(convention)
    rng = np.random.default_rng(0)
    one = [KernelState(t) for _ in range(4)]
    many = KernelStates(t, 4, n_cpu=4, threads=8)
    for _ in range(300):
        ev, cpu, tid = rng.integers(0, len(NAMES), 4), rng.integers(1, 4, 4), rng.integers(1, 6, 4)
        for b in range(4):
            one[b].step(int(ev[b]), int(cpu[b]), int(tid[b]))
        many.step(ev, cpu, tid)
        for b in range(4):
            assert {c: o for c, o in enumerate(many.owner[b]) if o} == one[b].owner
            assert {th: c for th, c in enumerate(many.where[b]) if c} == one[b].where
            assert {th: s for th, s in enumerate(many.open[b]) if s != NEVER} == one[b].open_call


def _trace(rows: list[tuple[str, int, int]]) -> Trace:
    names = sorted({r[0] for r in rows})
    return Trace.from_columns(
        ts=np.arange(len(rows), dtype=np.int64),
        event=pa.DictionaryArray.from_arrays(pa.array([names.index(r[0]) for r in rows], pa.int32()), pa.array(names)),
        cpu=pa.array([r[1] for r in rows], pa.int32()),
        tid=pa.array([r[2] for r in rows], pa.int64()),
    )


@pytest.mark.parametrize("convention", ["prev", "next"])
def test_the_checker_flags_what_a_stepped_state_refuses(convention: str) -> None:
    """A trace stepped through KernelState: the events it refuses (pairing) are the checker's violations."""
    rng = np.random.default_rng(1)
    names = ["syscall_entry_read", "syscall_exit_read", "syscall_entry_write", "syscall_exit_write", "timer"]
    rows = [(names[int(rng.integers(0, 5))], int(rng.integers(0, 2)), int(rng.integers(1, 4))) for _ in range(400)]
    rules = mine_rules([_trace([(n, 0, 1) for n in names * 2])])
    rules.doc["invariants"]["sched_consistency"]["convention"] = convention
    t = EventTables.of(names, KernelFacts(convention))
    k = KernelState(t)
    refused = 0
    for n, c, tid in rows:
        refused += not k.may(tid, names.index(n))
        k.step(names.index(n), c, tid)
    assert refused > 0 and check_trace(_trace(rows), rules).counts["syscall.pairing"] == refused
