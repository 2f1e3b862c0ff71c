"""Constraint-guided decoding: a running kernel state that masks a token sampler's choices, so a raw
sample cannot break the kernel invariants `tracesynth.constraints` checks (sched.consistency,
sched.one_cpu, syscall.pairing, ret.errno; time never decreases anyway: every gap is >= 0).

The sampler draws an event's channels cpu -> tid -> event -> ... and asks `allowed(channel, drawn)`
which tokens may come next, given the state of its chain:

- per CPU: its current thread, or free (after a switch; every CPU at the start of a chain);
- per thread (a chain-global label): the CPU where it is current, and its open syscall.

Then: on a CPU with a current thread the tid is that thread; on a free CPU it is a thread current
nowhere or a new one; a thread inside call X may neither enter a call nor exit any but X, one with
no open call may not exit; a syscall exit's return is never the "below -MAX_ERRNO" bucket. The sampler
draws each channel freely and redraws within the mask only where its draw is refused, except that an event
refused because its thread is inside a call becomes that call's exit, or, inside exit_group (a call that never
returns), the thread's last event; such a thread is not run again (`instead`, `_dead`).

Chains are drawn in parallel, so a chain cannot know which thread the chain before it leaves on each
CPU. `join_chains` concatenates them and, where a chain first runs a thread on a CPU that the chains
before left to another, inserts the sched_switch that hands the CPU over, as the kernel would have
logged it. (Forcing that switch as the chain's first event on the CPU instead, with the model seeing a
thread-less switch, derailed the chains into idle-CPU timer loops: the event mix of the shipped model's
guided scimark2 sample was 0.49 (total variation) from its unguided one, 0.16 with the switches inserted.)

The guide also keeps each window's thread labels (per-window, first-seen order, as the model saw in
training) bound to the chain-global ones, so a thread current on a CPU keeps its identity even
after it left the window's overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tracesynth.channels import N_POS_BINS, ChannelCodec
from tracesynth.events import SCHED_PROCESS_EXIT, SCHED_SWITCH, SYSCALL_ENTRY, SYSCALL_EXIT
from tracesynth.trace import Trace

GUIDES = ("kernel", "none")
NEVER, CLOSED = -2, -1  # a thread's syscall state besides an open call's id


@dataclass
class KernelFacts:
    """What the data decides about the invariants (as mined by tracesynth.constraints.mine_rules)."""

    convention: str = "prev"  # "prev": a sched_switch is the outgoing thread's and closes its stay
    unpaired_calls: list[str] = field(default_factory=list)  # calls that never return

    @classmethod
    def mine(cls, traces: Sequence[Trace]) -> KernelFacts:
        from tracesynth.constraints import mine_rules

        # only the invariants are read: skip the learned rules' block calibration
        inv = mine_rules(list(traces), {"calibration_blocks": 0}).doc["invariants"]
        return cls(str(inv["sched_consistency"].get("convention", "prev")),
                   sorted(inv["syscall_pairing"].get("unpaired_calls", [])))

    @classmethod
    def from_json(cls, d: Mapping | None) -> KernelFacts:
        d = dict(d or {})
        conv = d.get("convention", "prev")
        calls = d.get("unpaired_calls", [])
        if conv not in ("prev", "next") or not isinstance(calls, list) or not all(isinstance(c, str) for c in calls):
            raise ValueError(f"bad kernel facts {str(d)[:60]}")
        return cls(conv, list(calls))


@dataclass(frozen=True)
class EventTables:
    """Per event type of a vocabulary, what the kernel invariants need to know of it."""

    is_entry: np.ndarray  # a paired syscall's entry (calls that never return are not paired)
    is_exit: np.ndarray
    call_of: np.ndarray  # the call id of an entry or exit, else -1
    exit_of_call: np.ndarray  # per call id, its exit's event (-1: none seen)
    switch: int  # sched_switch's event (-1: not in the vocabulary)
    closes: np.ndarray  # events that end their thread's stay on the CPU (a switch; under "prev" also an exit)

    @classmethod
    def of(cls, names: Sequence[str], facts: KernelFacts) -> EventTables:
        V = len(names)
        unpaired = set(facts.unpaired_calls)
        is_entry, is_exit = np.zeros(V, bool), np.zeros(V, bool)
        call_of = np.full(V, -1, np.int64)
        calls: dict[str, int] = {}
        for i, n in enumerate(names):
            for prefix, flag in ((SYSCALL_ENTRY, is_entry), (SYSCALL_EXIT, is_exit)):
                if n.startswith(prefix) and n[len(prefix):] not in unpaired:
                    flag[i] = True
                    call_of[i] = calls.setdefault(n[len(prefix):], len(calls))
        exit_of_call = np.full(len(calls) + 1, -1, np.int64)
        exit_of_call[call_of[is_exit]] = np.flatnonzero(is_exit)
        switch = list(names).index(SCHED_SWITCH) if SCHED_SWITCH in names else -1
        closes = np.zeros(V, bool)
        if switch >= 0:
            closes[switch] = True
            if facts.convention == "prev" and SCHED_PROCESS_EXIT in names:
                closes[list(names).index(SCHED_PROCESS_EXIT)] = True
        return cls(is_entry, is_exit, call_of, exit_of_call, switch, closes)


class KernelGuide:
    """Per-chain kernel state over a token sampler's chains ([b] arrays, one step per event)."""

    def __init__(self, codec: ChannelCodec, facts: KernelFacts, chains: int, window: int):
        names = codec.events
        V = len(names)
        self.prev = facts.convention == "prev"
        ev = EventTables.of(names, facts)
        self.is_entry, self.is_exit, self.call_of = ev.is_entry, ev.is_exit, ev.call_of
        self.exit_of_call = ev.exit_of_call
        self.switch, self.closes = ev.switch, ev.closes
        # what a thread inside a call that never returns (exit_group) does last; its tid is not seen again
        self.last_event = names.index(SCHED_PROCESS_EXIT) if SCHED_PROCESS_EXIT in names else (
            ev.switch if self.prev else -1)  # fmt: skip
        self.is_sys_exit = np.array([n.startswith(SYSCALL_EXIT) for n in names])
        self.bad_ret = 2 + len(codec.errnos) + N_POS_BINS  # decodes below -MAX_ERRNO
        self.n_ret = codec.vocab_sizes["ret"]
        self.V = V
        self.T = codec.max_tids
        self.n_cpu = codec.vocab_sizes["cpu"]
        b = chains
        self.b = b
        self.rows = np.arange(b)
        self.lab2glob = np.zeros((b, self.T + 1), np.int64)  # window label -> chain-global label (0: none)
        self.next_glob = np.ones(b, np.int64)
        self.owner = np.zeros((b, self.n_cpu), np.int64)  # chain-global label, 0 free
        self.where = np.zeros((b, 64), np.int64)  # per global label: cpu token where current (0: none)
        self.open = np.full((b, 64), NEVER, np.int64)
        self.glob = np.zeros((b, window), np.int64)  # chain-global label of each position of the window

    # -- windows ----------------------------------------------------------------------------------
    def start_window(self, tail_labels: np.ndarray | None, tail_glob: np.ndarray | None) -> None:
        """A new window: bind its labels to the global ones of the overlap it starts with (if any)."""
        self.lab2glob[:] = 0
        self.glob[:] = 0
        if tail_labels is None:
            return
        k = tail_labels.shape[1]
        self.glob[:, :k] = tail_glob
        for j in range(k):
            lab, g = tail_labels[:, j], tail_glob[:, j]
            ok = (lab > 0) & (g > 0)
            self.lab2glob[self.rows[ok], lab[ok]] = g[ok]

    def _new_glob(self, rows: np.ndarray) -> np.ndarray:
        g = self.next_glob[rows].copy()
        self.next_glob[rows] += 1
        if self.next_glob.max() >= self.where.shape[1]:  # grow the per-thread state
            extra = self.where.shape[1]
            self.where = np.concatenate([self.where, np.zeros((self.b, extra), np.int64)], axis=1)
            self.open = np.concatenate([self.open, np.full((self.b, extra), NEVER, np.int64)], axis=1)
        return g

    def _free_label(self) -> np.ndarray:
        """Per chain, the label a new thread gets: the first unbound one (the last label if all are)."""
        unbound = self.lab2glob[:, 1:] == 0
        return np.where(unbound.any(1), unbound.argmax(1) + 1, self.T)

    # -- masks --------------------------------------------------------------------------------------
    def allowed(self, channel: str, drawn: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """[b, vocab] bool: the tokens of `channel` the invariants allow after the channels `drawn`."""
        if channel == "tid":
            return torch.from_numpy(self._tid_mask(drawn["cpu"].numpy()))
        if channel == "event":
            return torch.from_numpy(self._event_mask(drawn["tid"].numpy()))
        if channel == "ret":
            m = np.ones((self.b, self.n_ret), bool)
            m[self.is_sys_exit[drawn["event"].numpy()], self.bad_ret] = False
            return torch.from_numpy(m)
        return None

    def instead(self, channel: str, drawn: Mapping[str, torch.Tensor]) -> np.ndarray | None:
        """[b] per chain, the token to take where the sampler's own draw of `channel` is refused (-1: a draw
        within the mask), or None. For the event: the exit of the thread's open call, or, for a call that never
        returns (exit_group), the thread's last event (`last_event`). The model refused there
        drew another syscall as if the open one had returned; taking its exit keeps the model on its course,
        where a draw within the mask pushed it elsewhere (the shipped model's guided scimark2 sample: 3-gram JSD
        to the held-out block 0.122 / 0.062 for seeds 0 / 1 with redraws, 0.052 / 0.046 with the exit taken,
        0.073 / 0.035 unguided)."""
        if channel != "event":
            return None
        state = self._open_call(drawn["tid"].numpy())
        exit_ = np.where(state >= 0, self.exit_of_call[np.maximum(state, 0)], -1)
        return np.where((state >= 0) & (exit_ < 0), self.last_event, exit_)

    def _dead(self, g: np.ndarray) -> np.ndarray:
        """[b, k] global labels: whether each one's thread is inside a call with no exit (exit_group): it ends
        there."""
        state = self.open[self.rows[:, None], g]
        return (g > 0) & (state >= 0) & (self.exit_of_call[np.maximum(state, 0)] < 0)

    def _tid_mask(self, cpu: np.ndarray) -> np.ndarray:
        m = np.zeros((self.b, self.T + 1), bool)
        m[:, 0] = True  # a thread-less event breaks no invariant
        real = cpu >= 2
        own = np.where(real, self.owner[self.rows, np.where(real, cpu, 0)], 0)
        # a free CPU (or no CPU): a bound thread current nowhere else, or the next new label
        cur = self.where[self.rows[:, None], self.lab2glob]  # [b, T+1]
        free_ok = (self.lab2glob > 0) & ((cur == 0) | ~real[:, None]) & ~self._dead(self.lab2glob)
        m[:, 1:] = free_ok[:, 1:]
        m[self.rows, self._free_label()] = True
        # a CPU with a current thread: that thread, under its label (bound now if it left the window)
        busy = np.flatnonzero(own > 0)
        if len(busy):
            g = own[busy]
            has = self.lab2glob[busy] == g[:, None]
            lab = np.where(has.any(1), has.argmax(1), self._free_label()[busy])
            self.lab2glob[busy, lab] = g
            m[busy] = False
            m[busy, lab] = True
        return m

    def _glob_of(self, tid: np.ndarray) -> np.ndarray:
        """Global label of drawn window labels (0: none yet, a new thread; or no thread)."""
        return np.where(tid > 0, self.lab2glob[self.rows, tid], 0)

    def _open_call(self, tid: np.ndarray) -> np.ndarray:
        """Per chain, the call the drawn thread is inside (its id), else CLOSED or NEVER."""
        g = self._glob_of(tid)
        return np.where(g > 0, self.open[self.rows, g], NEVER)

    def _event_mask(self, tid: np.ndarray) -> np.ndarray:
        m = np.ones((self.b, self.V), bool)
        state = self._open_call(tid)
        inside = state >= 0
        m[inside] &= ~(self.is_entry | self.is_exit)[None]
        # its exit, if the model knows one (as the checker, a call with no exit token seen is still open)
        rows = np.flatnonzero(inside)
        ex = self.exit_of_call[state[rows]]
        m[rows[ex >= 0], ex[ex >= 0]] = True
        m[state == CLOSED] &= ~self.is_exit[None]
        return m

    # -- state ----------------------------------------------------------------------------------------
    def commit(self, j: int, drawn: Mapping[str, torch.Tensor]) -> None:
        """Event j of the window is drawn: bind a new thread's label, update CPUs and open calls."""
        cpu, tid, ev = (drawn[c].numpy() for c in ("cpu", "tid", "event"))
        r = self.rows
        real = cpu >= 2
        c = np.where(real, cpu, 0)
        was = self.owner[r, c]
        g = self._glob_of(tid)
        new = (tid > 0) & ((g == 0) | (real & (self.where[r, g] > 0) & (self.where[r, g] != cpu)))
        if new.any():  # a new thread (or the last label reused by one, when all labels are bound)
            g[new] = self._new_glob(r[new])
            self.lab2glob[r[new], tid[new]] = g[new]
        self.glob[:, j] = g
        has = g > 0
        closes = real & self.closes[ev]
        if self.switch >= 0:
            if self.prev:  # a switch / exit ends the stay of the CPU's thread; any other event claims the CPU
                stay = real & ~closes & has
                old = np.where(closes & (was > 0), was, 0)
                self.where[r[old > 0], old[old > 0]] = 0
                self.owner[r[closes], c[closes]] = 0
                self.where[r[closes & has], g[closes & has]] = 0
            else:  # a switch hands the CPU to its thread
                old = np.where(closes & (was > 0), was, 0)
                self.where[r[old > 0], old[old > 0]] = 0
                self.owner[r[closes], c[closes]] = np.maximum(g[closes], 0)
                stay = real & ~closes & has
                stay |= closes & has
            self.owner[r[stay], c[stay]] = g[stay]
            self.where[r[stay], g[stay]] = cpu[stay]
        entry, leave = has & self.is_entry[ev], has & self.is_exit[ev]
        self.open[r[entry], g[entry]] = self.call_of[ev[entry]]
        self.open[r[leave], g[leave]] = CLOSED

    def replay(self, tokens: Mapping[str, torch.Tensor], k: int) -> np.ndarray:
        """Take the window's first k events (tokens [b, >= k] per channel, e.g. real events a chain continues) as
        drawn, one at a time: the state is then the one they leave (who runs on each CPU, which calls are open).
        Returns [b, k] bool: whether each event was within the masks the sampler would have used."""
        ok = np.ones((self.b, k), bool)
        for j in range(k):
            drawn = {c: tokens[c][:, j] for c in ("cpu", "tid", "event")}
            tid, ev = drawn["tid"].numpy(), drawn["event"].numpy()
            ok[:, j] = self.allowed("tid", drawn).numpy()[self.rows, tid]  # also binds a current thread's label
            ok[:, j] &= self.allowed("event", drawn).numpy()[self.rows, ev]
            self.commit(j, drawn)
        return ok

    def join_chains(self, seqs: Mapping[str, np.ndarray], ends: np.ndarray) -> dict[str, np.ndarray]:
        """The chains' first `ends[b]` events concatenated ({channel: [b, n]} tokens, chain-global thread ids),
        with a sched_switch inserted where a chain first runs a thread on a CPU that the chains before left to
        another: the switch that hands the CPU over ("prev": the leaving thread's, "next": the coming one's)."""
        carry = np.zeros(self.n_cpu, np.int64)  # the thread current on each CPU after the chains so far
        carry_comm = np.zeros(self.n_cpu, np.int64)  # its command token
        parts: dict[str, list[np.ndarray]] = {c: [] for c in seqs}
        for b in range(self.b):
            n = int(ends[b])
            ch = {c: v[b, :n] for c, v in seqs.items()}
            cpu, tid, comms, closes = ch["cpu"], ch["tid"], ch["comm"], self.closes[ch["event"]]
            pos = np.flatnonzero((cpu >= 2) & ((tid > 0) | closes))  # events that tell who runs on their CPU
            first, last = np.full(self.n_cpu, n), np.full(self.n_cpu, -1)
            np.minimum.at(first, cpu[pos], pos)
            np.maximum.at(last, cpu[pos], pos)
            on = last >= 0
            joined = ch
            if self.switch >= 0 and len(pos):
                at = np.minimum(first, n - 1)
                if self.prev:  # the thread left there switches out before this chain's first one runs
                    need, who, comm = on & (carry > 0), carry, carry_comm
                else:  # unless this chain's first event there is a switch, one hands the CPU to its thread
                    need, who, comm = on & (carry > 0) & ~closes[at], tid[at], comms[at]
                cpus = np.flatnonzero(need)
                add = {c: np.zeros(len(cpus), np.int64) for c in ch}
                add.update(event=np.full(len(cpus), self.switch), cpu=cpus, tid=who[cpus], comm=comm[cpus],
                           dt=ch["dt"][first[cpus]])  # the gap bucket of the event it precedes (0 broke dt.event)
                joined = {c: np.insert(v, first[cpus], add[c]) for c, v in ch.items()}
            for c, v in joined.items():
                parts[c].append(v)
            if len(pos):  # a CPU runs the thread of its last such event ("prev": none after a switch or exit)
                carry = np.where(on, np.where(closes[last] & self.prev, 0, tid[last]), carry)
                carry_comm = np.where(on, comms[last], carry_comm)
        return {c: np.concatenate(v) for c, v in parts.items()}
