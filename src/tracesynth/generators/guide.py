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

The kernel's rules and the chains' state (who runs on each CPU, which call each thread has open) are
`tracesynth.kernel`'s (`EventTables`, `KernelStates`); the guide turns them into masks over tokens.

The guide also keeps each window's thread labels (per-window, first-seen order, as the model saw in
training) bound to the chain-global ones, so a thread current on a CPU keeps its identity even
after it left the window's overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tracesynth.channels import N_POS_BINS, ChannelCodec
from tracesynth.constraints import mine_rules
from tracesynth.kernel import EventTables, KernelFacts, KernelStates
from tracesynth.trace import Trace

GUIDES = ("kernel", "none")


def mine_kernel_facts(traces: Sequence[Trace]) -> KernelFacts:
    """The kernel facts of training traces (only the invariants are mined: no block calibration)."""
    return KernelFacts.from_invariants(mine_rules(list(traces), {"calibration_blocks": 0}).doc["invariants"])


class KernelGuide:
    """Per-chain kernel state over a token sampler's chains ([b] arrays, one step per event)."""

    def __init__(self, codec: ChannelCodec, facts: KernelFacts, chains: int, window: int):
        self.ev = EventTables.of(codec.events, facts)
        self.bad_ret = 2 + len(codec.errnos) + N_POS_BINS  # decodes below -MAX_ERRNO (ret.errno)
        self.n_ret = codec.vocab_sizes["ret"]
        self.V = len(codec.events)
        self.T = codec.max_tids
        self.n_cpu = codec.vocab_sizes["cpu"]
        self.b = chains
        self.rows = np.arange(chains)
        # chain-global thread labels (1, 2, ...) and CPU tokens (>= 2: a real CPU) are the states' threads and CPUs
        self.k = KernelStates(self.ev, chains, self.n_cpu)
        self.lab2glob = np.zeros((chains, self.T + 1), np.int64)  # window label -> chain-global label (0: none)
        self.next_glob = np.ones(chains, np.int64)
        self.glob = np.zeros((chains, window), np.int64)  # chain-global label of each position of the window

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
        self.k.grow(int(self.next_glob.max()))
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
            m[self.ev.is_syscall_exit[drawn["event"].numpy()], self.bad_ret] = False
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
        state = self.k.state(self._glob_of(drawn["tid"].numpy()))
        exit_ = self.ev.expected_exit(state)
        return np.where((state >= 0) & (exit_ < 0), self.ev.last_event, exit_)

    def _dead(self, g: np.ndarray) -> np.ndarray:
        """[b, k] global labels: whether each one's thread is inside a call with no exit (exit_group): it ends
        there."""
        state = self.k.open[self.rows[:, None], g]
        return (g > 0) & (state >= 0) & (self.ev.expected_exit(state) < 0)

    def _tid_mask(self, cpu: np.ndarray) -> np.ndarray:
        m = np.zeros((self.b, self.T + 1), bool)
        m[:, 0] = True  # a thread-less event breaks no invariant
        real = cpu >= 2
        own = np.where(real, self.k.owner[self.rows, np.where(real, cpu, 0)], 0)
        # a free CPU (or no CPU): a bound thread current nowhere else, or the next new label
        cur = self.k.where[self.rows[:, None], self.lab2glob]  # [b, T+1]
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

    def _event_mask(self, tid: np.ndarray) -> np.ndarray:
        # a call with no exit token seen stays open (as the checker reads it)
        return self.ev.pairing[self.k.state(self._glob_of(tid)) + 2]

    # -- state ----------------------------------------------------------------------------------------
    def commit(self, j: int, drawn: Mapping[str, torch.Tensor]) -> None:
        """Event j of the window is drawn: bind a new thread's label, update CPUs and open calls."""
        cpu, tid, ev = (drawn[c].numpy() for c in ("cpu", "tid", "event"))
        r = self.rows
        real = cpu >= 2
        g = self._glob_of(tid)
        at = self.k.where[r, g]
        new = (tid > 0) & ((g == 0) | (real & (at > 0) & (at != cpu)))
        if new.any():  # a new thread (or the last label reused by one, when all labels are bound)
            g[new] = self._new_glob(r[new])
            self.lab2glob[r[new], tid[new]] = g[new]
        self.glob[:, j] = g
        self.k.step(ev, np.where(real, cpu, 0), g)

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
            cpu, tid, comms, closes = ch["cpu"], ch["tid"], ch["comm"], self.ev.closes[ch["event"]]
            pos = np.flatnonzero((cpu >= 2) & ((tid > 0) | closes))  # events that tell who runs on their CPU
            first, last = np.full(self.n_cpu, n), np.full(self.n_cpu, -1)
            np.minimum.at(first, cpu[pos], pos)
            np.maximum.at(last, cpu[pos], pos)
            on = last >= 0
            joined = ch
            if self.ev.switch >= 0 and len(pos):
                at = np.minimum(first, n - 1)
                if self.ev.prev:  # the thread left there switches out before this chain's first one runs
                    need, who, comm = on & (carry > 0), carry, carry_comm
                else:  # unless this chain's first event there is a switch, one hands the CPU to its thread
                    need, who, comm = on & (carry > 0) & ~closes[at], tid[at], comms[at]
                cpus = np.flatnonzero(need)
                add = {c: np.zeros(len(cpus), np.int64) for c in ch}
                add.update(
                    event=np.full(len(cpus), self.ev.switch),
                    cpu=cpus,
                    tid=who[cpus],
                    comm=comm[cpus],
                    dt=ch["dt"][first[cpus]],
                )  # the gap bucket of the event it precedes (0 broke dt.event)
                joined = {c: np.insert(v, first[cpus], add[c]) for c, v in ch.items()}
            for c, v in joined.items():
                parts[c].append(v)
            if len(pos):  # a CPU runs the thread of its last such event ("prev": none after a switch or exit)
                carry = np.where(on, np.where(closes[last] & self.ev.prev, 0, tid[last]), carry)
                carry_comm = np.where(on, comms[last], carry_comm)
        return {c: np.concatenate(v) for c, v in parts.items()}
