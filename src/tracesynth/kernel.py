"""The kernel's rules in one place: what a trace's events say about who runs where and which call is open.

The state of a trace (or of one generated chain), event by event:

- per CPU: its current thread, or free (every CPU at the start);
- per thread: the CPU where it is current, and its syscall state: NEVER (no syscall event yet), CLOSED (its
  last one was an exit) or the id of the call it is inside.

The transitions, per event (ev, cpu, tid):

- syscalls: an entry opens its call, an exit closes it (`EventTables.state_after`). Inside call X a thread may
  neither enter a call nor exit any but X; after an exit it may not exit; before its first syscall event it may
  do anything (`EventTables.pairing`, one row per state). A call that never returns (exit_group,
  `KernelFacts.unpaired_calls`) is no syscall here: it is never paired.
- scheduling, by the sched_switch convention the data shows (`KernelFacts.convention`):
  "prev": a switch is the outgoing thread's last event on its CPU; it ends the thread's stay there, and so does
  a sched_process_exit (`EventTables.closes`); any other event of a thread makes it current on its CPU.
  "next": a switch is the incoming thread's first event: it hands the CPU over to it.
  A thread current on one CPU is on no other (sched.one_cpu; the idle task, tid 0, is every CPU's and exempt),
  and between two ends of a stay a CPU's events are one thread's (sched.consistency).
- a syscall exit's negative return is an errno, -MAX_ERRNO..-1 (ret.errno).

Who steps through them:

- `KernelState`: one chain, event by event, in Python dicts (the guided Markov chain: a few microseconds an
  event);
- `KernelStates`: b chains at once, in numpy arrays (the token models' guide, tracesynth.generators.guide);
- the checker (tracesynth.constraints.check) reads the same tables over a whole trace at once, vectorised:
  `pairing` at each syscall event, indexed by the state its thread's previous one left, and
  `segment_starts` over the events sorted by CPU; the repairer inserts switches carried by `switch_carrier`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tracesynth.events import IDLE_TID, MAX_ERRNO, SCHED_PROCESS_EXIT, SCHED_SWITCH, SYSCALL_ENTRY, SYSCALL_EXIT

NEVER, CLOSED = -2, -1  # a thread's syscall state besides an open call's id
CONVENTIONS = ("prev", "next")


@dataclass
class KernelFacts:
    """What the data decides about the invariants (as tracesynth.constraints.mine_rules mines them)."""

    convention: str = "prev"  # "prev": a sched_switch is the outgoing thread's and closes its stay
    unpaired_calls: list[str] = field(default_factory=list)  # calls that never return

    @classmethod
    def from_invariants(cls, inv: Mapping) -> KernelFacts:
        """From the invariants section of mined rules."""
        return cls(
            str(inv["sched_consistency"].get("convention", "prev")),
            sorted(inv["syscall_pairing"].get("unpaired_calls", [])),
        )

    @classmethod
    def from_json(cls, d: Mapping | None) -> KernelFacts:
        d = dict(d or {})
        conv = d.get("convention", "prev")
        calls = d.get("unpaired_calls", [])
        if conv not in CONVENTIONS or not isinstance(calls, list) or not all(isinstance(c, str) for c in calls):
            raise ValueError(f"bad kernel facts {str(d)[:60]}")
        return cls(conv, list(calls))


@dataclass(frozen=True)
class EventTables:
    """Per event type of a vocabulary, what the kernel rules need to know of it (codes are vocabulary indices)."""

    is_entry: np.ndarray  # a paired syscall's entry (calls that never return are not paired)
    is_exit: np.ndarray
    is_syscall: np.ndarray  # a paired syscall's entry or exit
    is_syscall_exit: np.ndarray  # every syscall exit, paired or not (its return is an errno or >= 0)
    call_of: np.ndarray  # the call id of an entry or exit, else -1
    entry_of_call: np.ndarray  # per call id, its entry's event (-1: none seen)
    exit_of_call: np.ndarray  # per call id, its exit's event (-1: none seen); one more -1 at the end
    state_after: np.ndarray  # the syscall state an event leaves its thread in (NEVER: unchanged)
    pairing: np.ndarray  # [state + 2, event]: whether a thread in that syscall state may do the event
    switch: int  # sched_switch's event (-1: not in the vocabulary)
    process_exit: int  # sched_process_exit's (-1: none)
    closes: np.ndarray  # "prev": events that end their thread's stay (a switch, an exit); "next": the switch
    prev: bool  # the convention is "prev"

    @classmethod
    def of(cls, names: Sequence[str], facts: KernelFacts, n_sched: int | None = None) -> EventTables:
        """The tables of a vocabulary; sched_switch / sched_process_exit are looked for among its first n_sched
        names only (the rules' own vocabulary: a trace's unknown names are not theirs)."""
        names = list(names)
        V = len(names)
        unpaired = set(facts.unpaired_calls)
        is_entry, is_exit = np.zeros(V, bool), np.zeros(V, bool)
        call_of = np.full(V, -1, np.int64)
        calls: dict[str, int] = {}
        for i, n in enumerate(names):
            for prefix, flag in ((SYSCALL_ENTRY, is_entry), (SYSCALL_EXIT, is_exit)):
                if n.startswith(prefix) and n[len(prefix) :] not in unpaired:
                    flag[i] = True
                    call_of[i] = calls.setdefault(n[len(prefix) :], len(calls))
        entry_of_call = np.full(len(calls), -1, np.int64)
        exit_of_call = np.full(len(calls) + 1, -1, np.int64)
        entry_of_call[call_of[is_entry]] = np.flatnonzero(is_entry)
        exit_of_call[call_of[is_exit]] = np.flatnonzero(is_exit)
        state_after = np.where(is_entry, call_of, np.where(is_exit, CLOSED, NEVER))
        sched = names[: V if n_sched is None else n_sched]
        switch = sched.index(SCHED_SWITCH) if SCHED_SWITCH in sched else -1
        process_exit = sched.index(SCHED_PROCESS_EXIT) if SCHED_PROCESS_EXIT in sched else -1
        prev = facts.convention == "prev"
        closes = np.zeros(V, bool)
        if switch >= 0:
            closes[switch] = True
        if prev and process_exit >= 0:  # the dead task's last switch may be missing
            closes[process_exit] = True
        is_any_exit = np.array([n.startswith(SYSCALL_EXIT) for n in names], bool)
        pairing = _pairing(is_entry, is_exit, exit_of_call[:-1])
        return cls(
            is_entry,
            is_exit,
            is_entry | is_exit,
            is_any_exit,
            call_of,
            entry_of_call,
            exit_of_call,
            state_after,
            pairing,
            switch,
            process_exit,
            closes,
            prev,
        )

    @property
    def last_event(self) -> int:
        """What a thread inside a call that never returns (exit_group) does last (-1: nothing known)."""
        return self.process_exit if self.process_exit >= 0 else (self.switch if self.prev else -1)

    def allows(self, state: np.ndarray | int, ev: np.ndarray | int) -> np.ndarray:
        """Whether a thread in syscall state `state` may do `ev` (syscall pairing)."""
        return self.pairing[np.asarray(state) + 2, ev]

    def state_before(self, prev_ev: np.ndarray, has_prev: np.ndarray) -> np.ndarray:
        """The syscall state of a thread whose previous paired syscall event is prev_ev (where it has one)."""
        return np.where(has_prev, self.state_after[np.where(has_prev, prev_ev, 0)], NEVER)

    def expected_exit(self, state: np.ndarray) -> np.ndarray:
        """The exit a thread inside a call (state >= 0) may do (-1: none, or no call open)."""
        return np.where(state >= 0, self.exit_of_call[np.maximum(state, 0)], -1)

    def segment_starts(self, ev: np.ndarray, new_cpu: np.ndarray) -> np.ndarray:
        """For events sorted by (cpu, time), where a thread's stay on the CPU starts: on a new CPU, after an
        event that ends a stay ("prev"), at a switch ("next")."""
        start = new_cpu.copy()
        ends = self.closes[ev]
        if self.prev:
            start[1:] |= ends[:-1]
        else:
            start |= ends
        return start

    def switch_carrier(self, outgoing: np.ndarray, incoming: np.ndarray) -> np.ndarray:
        """The thread a sched_switch between the two carries: the outgoing one ("prev") or the incoming one."""
        return outgoing if self.prev else incoming

    def bad_return(self, ev: np.ndarray, has_ret: np.ndarray, ret: np.ndarray) -> np.ndarray:
        """Events whose return breaks ret.errno (a syscall exit below -MAX_ERRNO)."""
        return self.is_syscall_exit[ev] & has_ret & (ret < -MAX_ERRNO)


def _pairing(is_entry: np.ndarray, is_exit: np.ndarray, exit_of_call: np.ndarray) -> np.ndarray:
    """[n_calls + 2, V]: the events a thread may do in each syscall state (row state + 2)."""
    m = np.ones((len(exit_of_call) + 2, len(is_entry)), bool)
    m[CLOSED + 2] = ~is_exit
    m[2:] = ~(is_entry | is_exit)
    seen = np.flatnonzero(exit_of_call >= 0)  # a call whose exit was never seen stays open
    m[seen + 2, exit_of_call[seen]] = True
    return m


class KernelState:
    """One chain's kernel state, stepped event by event (dicts: cheap for one event at a time).

    owner: cpu -> its current thread, in the order the CPUs were taken (a drawn order depends on it);
    where: thread -> the CPU where it is current (the idle task is never entered: it is every CPU's);
    open_call: thread -> its syscall state (absent: NEVER). An event with no thread or no CPU leaves the
    CPUs as they are."""

    def __init__(self, tables: EventTables):
        self.tables = tables
        self.owner: dict[int, int] = {}
        self.where: dict[int, int] = {}
        self.open_call: dict[int, int] = {}
        self._after = tables.state_after.tolist()
        # without a sched_switch in the vocabulary no stay ever ends (the chain knows no schedule)
        self._closes = (tables.closes & tables.prev & (tables.switch >= 0)).tolist()

    def state(self, tid: int) -> int:
        return self.open_call.get(tid, NEVER)

    def allowed(self, tid: int) -> np.ndarray:
        """[V] bool: the events thread tid may do next."""
        return self.tables.pairing[self.state(tid) + 2]

    def may(self, tid: int, ev: int) -> bool:
        return bool(self.tables.pairing[self.state(tid) + 2, ev])

    def step(self, ev: int, cpu: int, tid: int) -> None:
        if tid < 0:
            return
        s = self._after[ev]
        if s != NEVER:
            self.open_call[tid] = s
        if cpu < 0:
            return
        if self._closes[ev]:  # the stay of the CPU's thread ends (and the event's, if another's)
            self.where.pop(self.owner.pop(cpu, -1), None)
            self.where.pop(tid, None)
            return
        if ev == self.tables.switch:  # "next": the switch hands the CPU to its thread
            self.where.pop(self.owner.get(cpu, -1), None)
        self.owner[cpu] = tid
        if tid != IDLE_TID:
            self.where[tid] = cpu


class KernelStates:
    """b chains' kernel states, stepped together (numpy arrays [b, ...]).

    Threads are labels 1, 2, ... (0: no thread; the token models never see the idle task) and CPUs slots
    1..n_cpu - 1 (0: none). owner[b, cpu]: the current thread (0: free); where[b, thread]: its CPU (0: none);
    open[b, thread]: its syscall state. Unlike `KernelState`, an event with no thread that ends a stay still
    frees its CPU (as the checker reads a thread-less switch)."""

    def __init__(self, tables: EventTables, chains: int, n_cpu: int, threads: int = 64):
        self.tables = tables
        self.rows = np.arange(chains)
        self.owner = np.zeros((chains, n_cpu), np.int64)
        self.where = np.zeros((chains, threads), np.int64)
        self.open = np.full((chains, threads), NEVER, np.int64)

    def grow(self, threads: int) -> None:
        """Room for thread labels below `threads` (doubling)."""
        while self.where.shape[1] <= threads:
            extra = self.where.shape[1]
            b = len(self.rows)
            self.where = np.concatenate([self.where, np.zeros((b, extra), np.int64)], axis=1)
            self.open = np.concatenate([self.open, np.full((b, extra), NEVER, np.int64)], axis=1)

    def state(self, thread: np.ndarray) -> np.ndarray:
        """[b] the syscall state of each chain's thread (NEVER where there is none)."""
        return np.where(thread > 0, self.open[self.rows, thread], NEVER)

    def step(self, ev: np.ndarray, cpu: np.ndarray, thread: np.ndarray) -> None:
        t, r = self.tables, self.rows
        has = thread > 0
        if t.switch >= 0:
            real = cpu > 0
            c = np.where(real, cpu, 0)
            ends = real & t.closes[ev]
            was = self.owner[r, c]
            old = np.where(ends & (was > 0), was, 0)
            self.where[r[old > 0], old[old > 0]] = 0  # a stay ends (or the CPU is handed over)
            if t.prev:
                self.owner[r[ends], c[ends]] = 0
                self.where[r[ends & has], thread[ends & has]] = 0
                stay = real & ~ends & has
            else:
                self.owner[r[ends], c[ends]] = np.maximum(thread[ends], 0)
                stay = real & has
            self.owner[r[stay], c[stay]] = thread[stay]
            self.where[r[stay], thread[stay]] = cpu[stay]
        s = t.state_after[ev]
        moves = has & (s != NEVER)
        self.open[r[moves], thread[moves]] = s[moves]
