"""Constraint-guided repair: fix each violation with the smallest edit the rules allow.

Only events that break a rule are edited (a transition is broken by its pair, so either side may
change); a clean trace comes back unchanged. The report gives the edit rate: events modified,
inserted or deleted / events in (`RepairReport.touched` lists the input rows modified or deleted).
One round applies, in order (each step re-detects on the current arrays, all vectorised):

0. an exit with no open entry on its thread, while another thread still current on its CPU has
   that call open, goes to that thread (one edit instead of dropping it and closing the other);
1. threads on CPUs: an event on a CPU its pinned thread / command never uses moves to one it
   does; a thread showing up on a CPU while still current on another gets one sched_switch on
   the old CPU that ends its stay there (without that convention it walks back, a bounded
   number of passes per round); a CPU scheduling segment holding several threads is
   split by one inserted sched_switch per change of thread where that is fewer edits than
   retagging the other threads' events (their tid and command take the segment owner's);
2. syscall pairing: step 0 again, then a wrong exit becomes the exit of the open call; an entry
   while a call is open gets that call's exit inserted just before it; an exit with no open
   entry is dropped;
3. impossible successors (global and per thread): where some type may sit between the
   predecessor and the event (a dropped event), it is inserted (never a syscall event on a
   thread: that would undo step 2, which would insert again, round after round); otherwise the
   event type is resampled from the successors of its predecessor (weighted by the mined
   counts), restricted to what the thread's previous event allows and to types the next event
   may follow (a correctly paired syscall event keeps its type and its predecessor is resampled
   instead; an event no allowed type can replace is dropped);
4. return values resampled from the valid symbols of the event type (null where it has none),
   commands resampled from those seen issuing the event type;
5. time: each gap is clamped into the intersection of its event and transition bounds and the
   timestamps are recomputed from the gaps (so time stays non-decreasing; later events keep
   their gaps, so only the clamped event counts as changed).

Inserted rows take the previous row's time, so the gap before the next original event is kept.
Rounds repeat until nothing is violated (a fix may create a new violation: a resampled event
type may not pair). After max_rounds the remaining violators are dropped (a call left open goes
by its entry; a gap the time fix could not clamp goes too), round by round, with only fixes that
relabel or clamp in between (no inserted switch, no walk); the trace shrinks each time, so repair
always terminates with zero violations. Every step is a fixed number of whole-column passes and
the number of rounds does not grow with the trace (82-96 on stream's badly broken samples in
bench/bench_constraints.py at 10,000 to 100,000 events), so repair time grows about linearly.
`RepairReport.edits` says which step made the edits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from tracesynth.constraints.check import (
    DETECTORS,
    RULES,
    Found,
    TraceArrays,
    detect_all,
    dt_bounds,
    thread_current_until,
    tid_rule_rows,
)
from tracesynth.constraints.rules import Compiled, Rules, sample_ret
from tracesynth.trace import SCHEMA, Trace

_COLS = ("ev", "cpu", "tid", "comm", "ret", "has_ret", "ts", "origin", "dt_changed")
_CHUNK = 4096
_WALK_PASSES = 8  # per round, of the one-CPU walk (see _fix_cpus)


@dataclass
class RepairReport:
    """How much repair changed: per rule (fixes applied) and per column (events whose value changed)."""

    events_in: int
    events_out: int
    rounds: int
    fixes: dict[str, int]
    columns: dict[str, int]
    inserted: int
    deleted: int
    modified: int
    dropped_in_fallback: int = 0
    # events changed by each fix (the same count as `changed`, split by the step that made it; a
    # later step undoing an earlier one's edit counts negative there)
    edits: dict[str, int] = field(default_factory=dict)
    violations_before: int = 0
    violations_after: int = 0
    notes: list[str] = field(default_factory=list)
    # input rows modified or deleted (indices into the trace given to repair)
    touched: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False, compare=False)

    @property
    def changed(self) -> int:
        """Events inserted, deleted or with any column changed (a shifted timestamp alone does not count;
        a clamped gap does)."""
        return self.modified + self.inserted + self.deleted

    @property
    def edit_rate(self) -> float:
        """Events changed (modified, inserted or deleted) / events in."""
        return self.fraction_changed

    @property
    def fraction_changed(self) -> float:
        return self.changed / self.events_in if self.events_in else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "events_in": self.events_in,
            "events_out": self.events_out,
            "rounds": self.rounds,
            "fixes": dict(self.fixes),
            "columns": dict(self.columns),
            "inserted": self.inserted,
            "deleted": self.deleted,
            "modified": self.modified,
            "changed": self.changed,
            "fraction_changed": self.fraction_changed,
            "edit_rate": self.edit_rate,
            "dropped_in_fallback": self.dropped_in_fallback,
            "edits": dict(self.edits),
            "violations_before": self.violations_before,
            "violations_after": self.violations_after,
        }


class _State:
    """The trace being repaired as numpy columns, with each row's original index (-1: inserted)."""

    def __init__(self, a: TraceArrays):
        self.c: Compiled = a.c
        self.ev, self.cpu, self.tid, self.comm = a.ev.copy(), a.cpu.copy(), a.tid.copy(), a.comm.copy()
        self.ret, self.has_ret, self.ts = a.ret.copy(), a.has_ret.copy(), a.ts.copy()
        self.origin = np.arange(a.n, dtype=np.int64)
        self.dt_changed = np.zeros(a.n, dtype=bool)

    @property
    def n(self) -> int:
        return len(self.ev)

    def arrays(self) -> TraceArrays:
        return TraceArrays.from_arrays(
            self.c,
            ev=self.ev,
            cpu=self.cpu,
            tid=self.tid,
            comm=self.comm,
            ret=self.ret,
            has_ret=self.has_ret,
            ts=self.ts,
        )

    def edit(self, insert_before: np.ndarray, rows: dict[str, np.ndarray], delete: np.ndarray) -> None:
        """Insert rows before the given indices and delete others (indices refer to the current rows)."""
        order = np.argsort(insert_before, kind="stable")
        pos = insert_before[order]
        gone = np.unique(delete)
        # where each deleted row sits once the insertions are in
        gone_after = gone + np.searchsorted(pos, gone, side="right")
        mask = np.ones(self.n + len(pos), dtype=bool)
        mask[gone_after] = False
        for name in _COLS:
            col = getattr(self, name)
            if len(pos):
                col = np.insert(col, pos, rows[name][order])
            setattr(self, name, col[mask])


def _sample_rows(weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One column index per row, with probability proportional to the row's weights (rows > 0)."""
    cum = np.cumsum(weights, axis=1)
    u = rng.random(len(weights)) * cum[:, -1]
    return np.minimum((cum <= u[:, None]).sum(axis=1), weights.shape[1] - 1)


def _fix_pairing(s: _State, fixes: Counter[str], rng: np.random.Generator, insert: bool = True) -> None:
    f = DETECTORS["syscall.pairing"](s.arrays())
    if not len(f.idx):
        return
    c = s.c
    if _hand_over_orphans(s, f):
        f = DETECTORS["syscall.pairing"](s.arrays())
    kind = f.extra["kind"]
    wrong_exit = (kind == 0) & c.kernel.is_exit[f.found]
    reentry = (kind == 0) & ~c.kernel.is_exit[f.found]
    orphan = kind == 1
    # a wrong exit becomes the exit of the call that is open
    i = f.idx[wrong_exit]
    s.ev[i] = f.expected[wrong_exit]
    _resample_ret(s, i, rng)
    if not insert:  # the fallback only shrinks the trace: drop the stale open entry instead
        idx, prev = s.arrays().syscall_prev
        stale = prev[np.searchsorted(idx, f.idx[reentry])]
        s.edit(np.zeros(0, np.int64), {}, np.concatenate([f.idx[orphan], stale]))
        fixes["syscall.pairing"] += len(f.idx)
        return
    # an entry while a call is open: close that call just before it
    at = f.idx[reentry]
    rows = {
        "ev": f.expected[reentry],
        "cpu": s.cpu[at],
        "tid": s.tid[at],
        "comm": s.comm[at],
        "ret": np.zeros(len(at), np.int64),
        "has_ret": np.zeros(len(at), bool),
        "ts": s.ts[np.maximum(at - 1, 0)],  # the previous row's time: the gap before `at` is kept
        "origin": np.full(len(at), -1, np.int64),
        "dt_changed": np.zeros(len(at), bool),
    }
    rows["ret"], rows["has_ret"] = _sample_ret_for(c, rows["ev"], rng)
    s.edit(at, rows, f.idx[orphan])
    fixes["syscall.pairing"] += len(f.idx)


def _hand_over(s: _State, fixes: Counter[str]) -> None:
    """Orphan exits handed to the thread with the call open, before the CPU fixes end that
    thread's stay with a switch (see _hand_over_orphans)."""
    f = DETECTORS["syscall.pairing"](s.arrays())
    if len(f.idx):
        fixes["syscall.pairing"] += _hand_over_orphans(s, f)


def _hand_over_orphans(s: _State, f: Found, look_back: int = 8) -> int:
    """An exit with no open entry on its thread, while another thread has that very call open (a
    sample that switched threads in the middle of a call), is that thread's exit: it takes the
    thread (tid, command and the CPU the thread is current on). One edit closes the open call and
    removes the orphan, where dropping it and closing the other call would be two. Only a thread
    whose call stays open past the exit (its next syscall event is not an exit) and that is still
    current on its CPU there qualifies; among those the latest entry (up to look_back back) wins,
    and each open call takes one exit (a thread switched out in the call is left out: giving it
    the exit would break the schedule of the exit's CPU, and the CPU fix would give it back).
    Returns the number of exits handed over."""
    orphan = f.idx[f.extra["kind"] == 1]
    if not len(orphan):
        return 0
    c = s.c
    a = s.arrays()
    idx, prev = a.syscall_prev
    nxt = np.full(s.n, s.n, dtype=np.int64)  # each syscall event's thread's next syscall event
    has = prev >= 0
    nxt[prev[has]] = idx[has]
    entries = idx[c.kernel.is_entry[s.ev[idx]]]
    closes = nxt[entries]
    entries = entries[(closes == s.n) | ~c.kernel.is_exit[s.ev[np.minimum(closes, s.n - 1)]]]
    if not len(entries):
        return 0
    # entries grouped by call, in time order inside each call
    key_e = c.kernel.call_of[s.ev[entries]] * (s.n + 1) + entries
    srt = np.argsort(key_e)
    key_e, entries = key_e[srt], entries[srt]
    # each thread's events in time order, to find a thread's last event before a given index
    with_tid = np.flatnonzero(s.tid >= 0)
    tid_codes, tid_of = np.unique(s.tid[with_tid], return_inverse=True)
    key_t = np.sort(tid_of * (s.n + 1) + with_tid)
    until = thread_current_until(a)
    call = c.kernel.call_of[s.ev[orphan]]
    pos = np.searchsorted(key_e, call * (s.n + 1) + orphan)  # first entry of the call at/after the orphan
    pick = np.full(len(orphan), -1, dtype=np.int64)
    last = np.full(len(orphan), -1, dtype=np.int64)
    for back in range(1, look_back + 1):
        p = pos - back
        ok = (pick < 0) & (p >= 0)
        j = entries[np.maximum(p, 0)]
        ok &= (key_e[np.maximum(p, 0)] // (s.n + 1) == call) & (nxt[j] > orphan) & (s.tid[j] != s.tid[orphan])
        # the entry's thread is current on the CPU of its last event before the orphan
        t = np.searchsorted(tid_codes, s.tid[j])
        q = np.searchsorted(key_t, np.minimum(t, len(tid_codes) - 1) * (s.n + 1) + orphan) - 1
        lj = key_t[np.maximum(q, 0)] % (s.n + 1)
        ok &= (q >= 0) & (s.tid[lj] == s.tid[j]) & (s.cpu[lj] >= 0) & (until[lj] > orphan)
        pick[ok], last[ok] = j[ok], lj[ok]
    found = pick >= 0
    # one exit per open call (the earliest orphan takes it)
    _, first = np.unique(pick[found], return_index=True)
    take = np.flatnonzero(found)[first]
    i, j, lj = orphan[take], pick[take], last[take]
    s.tid[i], s.comm[i], s.cpu[i] = s.tid[j], s.comm[j], s.cpu[lj]
    return len(i)


def _sample_ret_for(c: Compiled, ev: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    ret = np.zeros(len(ev), dtype=np.int64)
    has = np.zeros(len(ev), dtype=bool)
    for e in np.unique(ev):
        syms, prob = c.ret_sym_table[e]
        if not len(syms) or c.ret_presence[e] == 2:
            continue
        m = ev == e
        picked = syms[
            np.minimum(np.searchsorted(np.cumsum(prob), rng.random(int(m.sum())), side="right"), len(syms) - 1)
        ]
        ret[m] = sample_ret(picked, rng)
        has[m] = True
    return ret, has


def _resample_ret(s: _State, idx: np.ndarray, rng: np.random.Generator) -> None:
    if len(idx):
        s.ret[idx], s.has_ret[idx] = _sample_ret_for(s.c, s.ev[idx], rng)


def _transition_violations(s: _State) -> tuple[TraceArrays, Found, Found, np.ndarray]:
    """The state's arrays, the global and per-thread transition findings, and their union of indices."""
    a = s.arrays()
    fg, ft = DETECTORS["transition.global"](a), DETECTORS["transition.thread"](a)
    return a, fg, ft, np.union1d(fg.idx, ft.idx)


def _fix_transitions(s: _State, fixes: Counter[str], rng: np.random.Generator) -> None:
    a, fg, ft, bad = _transition_violations(s)
    if not len(bad):
        return
    c = s.c
    fixes["transition.global"] += len(fg.idx)
    fixes["transition.thread"] += len(ft.idx)
    tprev = a.thread_prev
    # a switch between two threads' runs that no type can replace is kept and what precedes it dropped (dropping
    # the switch merged the runs, and the CPU fix inserted a switch back, in a loop)
    separates = _separates_threads(a)
    # a syscall event that pairs correctly is the skeleton the pairing fix built: resample its
    # predecessor instead when that one is free to change
    sys_ev = c.kernel.is_syscall[s.ev] & (s.tid >= 0)
    pred = np.full(s.n, -1, dtype=np.int64)
    pred[fg.idx] = fg.idx - 1
    only_t = np.setdiff1d(ft.idx, fg.idx)
    pred[only_t] = tprev[only_t]
    swap = sys_ev[bad] & (pred[bad] >= 0) & ~sys_ev[np.maximum(pred[bad], 0)]
    # a swapped predecessor must be one the thread's next event may follow
    non_sys = ~c.kernel.is_syscall
    t_follow = np.full(s.n, -1, dtype=np.int64)
    t_follow[pred[bad][swap]] = s.ev[bad[swap]]
    bad = np.unique(np.where(swap, pred[bad], bad))
    new = s.ev.copy()
    drop: list[np.ndarray] = [np.zeros(0, np.int64)]
    for lo in range(0, len(bad), _CHUNK):
        i = bad[lo : lo + _CHUNK]
        gp = np.where(i > 0, s.ev[np.maximum(i - 1, 0)], -1)
        tp = np.where(tprev[i] >= 0, s.ev[np.maximum(tprev[i], 0)], -1)
        nxt = np.where(i + 1 < s.n, s.ev[np.minimum(i + 1, s.n - 1)], -1)
        g_on = (gp >= 0) & c.g_enforced[np.maximum(gp, 0)]
        t_on = (tp >= 0) & c.t_enforced[np.maximum(tp, 0)]
        base = np.where(g_on[:, None], c.g_weight[np.maximum(gp, 0)], c.t_weight[np.maximum(tp, 0)])
        none = base.sum(axis=1) == 0
        base[none] = c.g_weight.sum(axis=0)  # no context: the overall event mix
        base[:, c.n_known :] = 0
        mask_g = np.where(g_on[:, None], c.g_allowed[np.maximum(gp, 0)], True)
        mask_t = np.where(t_on[:, None], c.t_allowed[np.maximum(tp, 0)], True)
        follow = np.where(
            (nxt >= 0)[:, None], (~c.g_enforced[None, :]) | c.g_allowed[:, np.maximum(nxt, 0)].T, True
        )  # [k, V]: the next event may follow the candidate
        tf = t_follow[i]
        follow &= np.where((tf >= 0)[:, None], (~c.t_enforced[None, :]) | c.t_allowed[:, np.maximum(tf, 0)].T, True)
        # an event outside the syscall skeleton stays outside it, so pairing is never broken here
        keep_out = ~sys_ev[i] & (s.tid[i] >= 0)
        base = base * np.where(keep_out[:, None], non_sys[None, :], True)
        w = base * mask_g * mask_t
        full = w * follow
        # an event outside the skeleton that no allowed type can replace is dropped; a syscall
        # event relaxes what cannot be met (next-compatibility, then the thread) and the pairing
        # fix settles the rest
        fits = full.sum(axis=1) > 0
        stuck = ~fits & keep_out
        before_switch = stuck & separates[i] & (pred[i] >= 0)
        drop.append(i[stuck & ~before_switch])
        drop.append(pred[i[before_switch]])
        use = np.where(fits[:, None], full, w)
        use = np.where((use.sum(axis=1) > 0)[:, None], use, base * mask_g)
        use = np.where((use.sum(axis=1) > 0)[:, None], use, base)
        ok = (use.sum(axis=1) > 0) & (fits | ~keep_out)
        new[i[ok]] = _sample_rows(use[ok], rng)
    changed = bad[new[bad] != s.ev[bad]]
    s.ev[changed] = new[changed]
    # the new type keeps the value contract of its kind
    _resample_ret(s, changed[(c.ret_presence[s.ev[changed]] != 0) | s.has_ret[changed]], rng)
    gone = np.concatenate(drop)
    if len(gone):
        s.edit(np.zeros(0, np.int64), {}, gone)


def _insert_missing(s: _State, fixes: Counter[str], rng: np.random.Generator) -> None:
    """Where an event may not follow its predecessor but some type x may sit between them (the
    predecessor allows x and x allows the event, globally and on the thread), insert x: the
    repair of a dropped event, which resampling cannot make without shifting everything after."""
    a, fg, ft, bad = _transition_violations(s)
    if not len(bad):
        return
    c = s.c
    tprev = a.thread_prev
    chosen = np.full(len(bad), -1, dtype=np.int64)
    for lo in range(0, len(bad), _CHUNK):
        i = bad[lo : lo + _CHUNK]
        e = s.ev[i]
        gp = np.where(i > 0, s.ev[np.maximum(i - 1, 0)], 0)
        tp = np.where(tprev[i] >= 0, s.ev[np.maximum(tprev[i], 0)], 0)
        has_g = i > 0
        has_t = tprev[i] >= 0
        g_before = np.where((has_g & c.g_enforced[gp])[:, None], c.g_allowed[gp], True)
        t_before = np.where((has_t & c.t_enforced[tp])[:, None], c.t_allowed[tp], True)
        g_after = (~c.g_enforced[None, :]) | c.g_allowed[:, e].T
        t_after = np.where((s.tid[i] >= 0)[:, None], (~c.t_enforced[None, :]) | c.t_allowed[:, e].T, True)
        ok = g_before & t_before & g_after & t_after
        ok[:, c.n_known :] = False
        # an inserted syscall event on a thread would break the pairing the pairing fix just built
        # (and that fix would insert again: the two would grow the trace round after round)
        ok &= np.where((s.tid[i] >= 0)[:, None], ~c.kernel.is_syscall[None, :], True)
        w = (
            ok
            * (np.where(has_t[:, None], c.t_weight[tp], c.g_weight[gp]) + 1e-9)
            * (np.where((s.tid[i] >= 0)[:, None], c.t_weight[:, e].T, c.g_weight[:, e].T) + 1e-9)
        )
        fits = ok.any(axis=1)
        if fits.any():
            chosen[lo : lo + _CHUNK][fits] = _sample_rows(w[fits], rng)
    at = bad[chosen >= 0]
    x = chosen[chosen >= 0]
    if not len(at):
        return
    fixes["transition.global"] += int(np.isin(at, fg.idx).sum())
    fixes["transition.thread"] += int(np.isin(at, ft.idx).sum())
    ret, has_ret = _sample_ret_for(c, x, rng)
    rows = {
        "ev": x,
        "cpu": s.cpu[at],
        "tid": s.tid[at],
        "comm": s.comm[at],
        "ret": ret,
        "has_ret": has_ret,
        "ts": s.ts[np.maximum(at - 1, 0)],  # the previous row's time: the gap before `at` is kept
        "origin": np.full(len(at), -1, np.int64),
        "dt_changed": np.zeros(len(at), bool),
    }
    s.edit(at, rows, np.zeros(0, np.int64))


def _fix_values(s: _State, fixes: Counter[str], rng: np.random.Generator) -> None:
    a = s.arrays()
    fr = DETECTORS["ret.value"](a)
    if len(fr.idx):
        fixes["ret.value"] += len(fr.idx)
        unexpected = fr.extra["kind"] == 2
        s.has_ret[fr.idx[unexpected]] = False
        s.ret[fr.idx[unexpected]] = 0
        _resample_ret(s, fr.idx[~unexpected], rng)
    fc = DETECTORS["comm.value"](a)
    if len(fc.idx):
        fixes["comm.value"] += len(fc.idx)
        c = s.c
        for lo in range(0, len(fc.idx), _CHUNK):
            i = fc.idx[lo : lo + _CHUNK]
            w = c.comm_weight[s.ev[i]]
            s.comm[i] = _sample_rows(w, rng)


def _fix_cpus(s: _State, fixes: Counter[str], rng: np.random.Generator, insert: bool = True) -> None:
    """insert=False (the fallback): only relabel cpu / tid / comm, so the trace never grows."""
    c = s.c
    a = s.arrays()
    ft, fc = DETECTORS["cpu.tid"](a), DETECTORS["cpu.comm"](a)
    bad = np.union1d(ft.idx, fc.idx)
    if len(bad):
        fixes["cpu.tid"] += len(ft.idx)
        fixes["cpu.comm"] += len(fc.idx)
        rows = tid_rule_rows(a)[bad]
        k = c.cpu_comm_weight.shape[1]
        w = np.ones((len(bad), k))
        has_t = rows >= 0
        w[has_t] *= c.cpu_tid_weight[rows[has_t]]
        cm = s.comm[bad]
        has_c = (cm >= 0) & (cm < len(c.cpu_comm_enforced))
        has_c[has_c] &= c.cpu_comm_enforced[cm[has_c]]
        wc = w.copy()
        wc[has_c] *= c.cpu_comm_weight[cm[has_c]]
        w = np.where((wc.sum(axis=1) > 0)[:, None], wc, w)
        s.cpu[bad] = _sample_rows(w, rng)
    # a thread that shows up on a CPU while still current on another: with switches carried by
    # the outgoing thread, one inserted sched_switch on the old CPU ends its stay there (one edit);
    # otherwise it moves back there, walking along its events until the old segment ends
    f1 = DETECTORS["sched.one_cpu"](s.arrays())
    if insert and len(f1.idx) and c.kernel.prev and c.kernel.switch >= 0:
        fixes["sched.one_cpu"] += len(f1.idx)
        _insert_switches(s, f1.idx, f1.idx, rng, cpu=f1.expected)
    # (a bounded walk: what is left goes to the next round; the fallback drops such events instead)
    for _ in range(_WALK_PASSES if insert else 0):
        f1 = DETECTORS["sched.one_cpu"](s.arrays())
        if not len(f1.idx):
            break
        fixes["sched.one_cpu"] += len(f1.idx)
        s.cpu[f1.idx] = f1.expected
    a = s.arrays()
    fs = DETECTORS["sched.consistency"](a)
    if len(fs.idx):
        fixes["sched.consistency"] += len(fs.idx)
        split_at, split_from, retag = _cheaper_splits(a, fs) if insert else (None, None, np.ones(len(fs.idx), bool))
        fs = Found(fs.rule, fs.idx[retag], fs.found[retag], fs.expected[retag])
        s.tid[fs.idx] = fs.expected
        # the thread's command: the one its other events carry
        known = (s.tid >= 0) & (s.comm >= 0)
        u, first = np.unique(s.tid[known], return_index=True)
        comm_of = s.comm[known][first]
        pos = np.minimum(np.searchsorted(u, fs.expected), max(0, len(u) - 1))
        hit = (len(u) > 0) & (u[pos] == fs.expected) if len(u) else np.zeros(len(fs.idx), bool)
        s.comm[fs.idx[hit]] = comm_of[pos[hit]]
        if split_at is not None and len(split_at):
            _insert_switches(s, split_at, split_from, rng)


def _cheaper_splits(a: TraceArrays, fs: Found) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where a CPU's scheduling segment holds several threads, one inserted sched_switch per change
    of thread fixes every event after it; where that is fewer edits than retagging the segment's
    other threads' events, split instead. Returns (events to insert a switch before, the event
    whose thread switches out there, mask of violations left to retagging)."""
    c = a.c
    none = np.zeros(0, np.int64)
    if c.kernel.switch < 0:
        return none, none, np.ones(len(fs.idx), bool)
    order, seg, _ = a.cpu_segments
    valid = a.tid[order] >= 0
    o, sg = order[valid], seg[valid]
    t = a.tid[o]
    change = np.zeros(len(o), bool)
    change[1:] = (sg[1:] == sg[:-1]) & (t[1:] != t[:-1])
    n_seg = int(seg.max()) + 1 if len(seg) else 0
    changes = np.bincount(sg[change], minlength=n_seg)
    seg_of = np.full(a.n, -1, dtype=np.int64)
    seg_of[order] = seg
    bad = np.bincount(seg_of[fs.idx], minlength=n_seg)
    split = changes < bad
    at = np.flatnonzero(change & split[sg])
    return o[at], o[at - 1], ~split[seg_of[fs.idx]]


def _insert_switches(
    s: _State, before: np.ndarray, outgoing: np.ndarray, rng: np.random.Generator, cpu: np.ndarray | None = None
) -> None:
    """Insert a sched_switch before each event in `before`, at the previous row's time, on the
    event's CPU (or `cpu`), carried by the thread the convention puts on it (the outgoing one for
    "prev", the incoming one for "next")."""
    c = s.c
    owner = c.kernel.switch_carrier(outgoing, before)
    ev = np.full(len(before), c.kernel.switch, dtype=np.int64)
    ret, has_ret = _sample_ret_for(c, ev, rng)
    rows = {
        "ev": ev,
        "cpu": s.cpu[before] if cpu is None else cpu,
        "tid": s.tid[owner],
        "comm": s.comm[owner],
        "ret": ret,
        "has_ret": has_ret,
        "ts": s.ts[np.maximum(before - 1, 0)],
        "origin": np.full(len(before), -1, np.int64),
        "dt_changed": np.zeros(len(before), bool),
    }
    s.edit(before, rows, np.zeros(0, np.int64))


def _fix_time(s: _State, fixes: Counter[str]) -> None:
    if s.n < 2:
        return
    a = s.arrays()
    lo, hi, _ = dt_bounds(a)
    dt = np.diff(s.ts)
    new = np.clip(np.maximum(dt, 0), lo, hi)
    moved = new != dt
    if moved.any():
        fe, ft = DETECTORS["dt.event"](a), DETECTORS["dt.transition"](a)
        fixes["dt.event"] += len(fe.idx)
        fixes["dt.transition"] += len(ft.idx)
        fixes["time.monotonic"] += int((dt < 0).sum())
        s.dt_changed[1:] |= moved
        s.ts = np.concatenate([s.ts[:1], s.ts[0] + np.cumsum(new)])


def _violations(s: _State) -> int:
    found = detect_all(s.arrays())
    return sum(len(f.idx) for f in found.values())


def repair_trace(
    trace: Trace, rules: Rules, seed: int = 0, max_rounds: int = 16, keep_inserted_ts: bool = True
) -> tuple[Trace, RepairReport]:
    """Repair a trace so that check_trace reports zero violations; deterministic for a seed."""
    del keep_inserted_ts
    rng = np.random.default_rng(seed)
    a0 = TraceArrays(trace, rules)
    before = sum(len(f.idx) for f in detect_all(a0).values())
    s = _State(a0)
    fixes: Counter[str] = Counter()
    edits: Counter[str] = Counter()
    done = [0]  # events changed so far

    def step(name: str, fix: Callable[[], None]) -> None:
        fix()
        now = _changed(a0, s)
        edits[name] += now - done[0]
        done[0] = now

    rounds = 0
    remaining = before
    while remaining and rounds < max_rounds:
        rounds += 1
        step("pairing", lambda: _hand_over(s, fixes))
        step("cpus", lambda: _fix_cpus(s, fixes, rng))
        step("pairing", lambda: _fix_pairing(s, fixes, rng))
        step("insert_missing", lambda: _insert_missing(s, fixes, rng))
        step("transitions", lambda: _fix_transitions(s, fixes, rng))
        step("values", lambda: _fix_values(s, fixes, rng))
        step("time", lambda: _fix_time(s, fixes))
        remaining = _violations(s)
    dropped = 0
    while remaining:
        # last resort: drop what still violates, then mend the seams with fixes that only relabel
        # or clamp; the trace shrinks every time, so this ends
        rounds += 1
        bad = _fallback_victims(s)
        if not len(bad):  # a guard: every rule names victims, so this should not happen
            bad = np.unique(np.concatenate([f.idx for f in detect_all(s.arrays()).values()]))
        dropped += len(bad)
        step("fallback", lambda bad=bad: s.edit(np.zeros(0, np.int64), {}, bad))
        step("values", lambda: _fix_values(s, fixes, rng))
        step("cpus", lambda: _fix_cpus(s, fixes, rng, insert=False))
        step("time", lambda: _fix_time(s, fixes))
        remaining = _violations(s)
    out = _to_trace(s, trace)
    report = _report(a0, s, fixes, rounds, dropped, before)
    report.edits = {k: v for k, v in edits.items() if v}
    return out, report


def _separates_threads(a: TraceArrays) -> np.ndarray:
    """Per event: a sched_switch whose thread differs from that of the next event on its CPU."""
    out = np.zeros(a.n, dtype=bool)
    if a.c.kernel.switch < 0 or not a.n:
        return out
    order = a.cpu_segments[0]  # events with a CPU by (cpu, index), as the sched rules read them
    same = a.cpu[order][1:] == a.cpu[order][:-1]
    cur, nxt = order[:-1][same], order[1:][same]
    out[cur] = (a.ev[cur] == a.c.kernel.switch) & (a.tid[cur] >= 0) & (a.tid[nxt] >= 0) & (a.tid[cur] != a.tid[nxt])
    return out


def _fallback_victims(s: _State) -> np.ndarray:
    """Events to drop: each violator, except that a call left open is closed by dropping its entry
    (dropping what follows it one event at a time would walk the whole thread)."""
    a = s.arrays()
    c = s.c
    found = detect_all(a)
    parts = [f.idx for r, f in found.items() if r not in _DROP_SPECIAL]
    sys_idx, sys_prev = a.syscall_prev
    open_entry = np.full(s.n, -1, dtype=np.int64)
    has = sys_prev >= 0
    open_entry[sys_idx[has]] = np.where(c.kernel.is_entry[s.ev[sys_prev[has]]], sys_prev[has], -1)
    fp = found["syscall.pairing"]
    stale = open_entry[fp.idx]
    parts.append(np.where(fp.extra.get("kind", np.zeros(0, np.int64)) == 1, fp.idx, stale))
    parts.append(fp.idx[(stale >= 0) & c.kernel.is_exit[s.ev[fp.idx]]])  # a wrong exit goes with its entry
    tprev = a.thread_prev
    separates = _separates_threads(a)
    for rule, pred_of in (("transition.global", lambda i: i - 1), ("transition.thread", lambda i: tprev[i])):
        i = found[rule].idx
        p = pred_of(i)
        # an open call's entry goes rather than what follows it; so does what precedes a switch between two
        # threads' runs (dropping the switch would merge them)
        parts.append(np.where((p >= 0) & (c.kernel.is_entry[s.ev[np.maximum(p, 0)]] | separates[i]), p, i))
    return np.unique(np.concatenate(parts + [np.zeros(0, np.int64)]))


# rules whose violators are not simply dropped (a gap the time fix could not clamp into its
# bounds is: its bounds do not intersect, so the event goes)
_DROP_SPECIAL = (
    "time.monotonic",
    "syscall.pairing",
    "transition.global",
    "transition.thread",
)


def _to_trace(s: _State, like: Trace) -> Trace:
    c = s.c
    ev = pa.DictionaryArray.from_arrays(pa.array(s.ev.astype(np.int32)), pa.array(c.names, pa.string()))
    comm_idx = pa.array(s.comm.astype(np.int32), mask=s.comm < 0)
    comm = pa.DictionaryArray.from_arrays(comm_idx, pa.array(c.comms or [""], pa.string()))
    table = pa.table(
        [
            pa.array(s.ts, pa.int64()),
            ev,
            pa.array(s.cpu.astype(np.int32), mask=s.cpu < 0),
            pa.array(s.tid, mask=s.tid < 0),
            comm,
            pa.array(s.ret, mask=~s.has_ret),
        ],
        schema=SCHEMA,
    )
    meta = dict(like.metadata)
    meta["repaired"] = True
    return Trace(table, meta)


def _changed(a0: TraceArrays, s: _State) -> int:
    """Events changed so far (modified, inserted or deleted), as the report counts them."""
    kept = s.origin >= 0
    modified = np.zeros(int(kept.sum()), dtype=bool)
    for v in _changed_columns(a0, s, kept).values():
        modified |= v
    return int(modified.sum()) + int((~kept).sum()) + a0.n - int(kept.sum())


def _changed_columns(a0: TraceArrays, s: _State, kept: np.ndarray) -> dict[str, np.ndarray]:
    """Per column, whether each kept row's value differs from its original row's."""
    o = s.origin[kept]
    return {
        "event": s.ev[kept] != a0.ev[o],
        "cpu": s.cpu[kept] != a0.cpu[o],
        "tid": s.tid[kept] != a0.tid[o],
        "comm": s.comm[kept] != a0.comm[o],
        "ret": (s.has_ret[kept] != a0.has_ret[o]) | (s.has_ret[kept] & (s.ret[kept] != a0.ret[o])),
        "dt": s.dt_changed[kept],
    }


def _report(a0: TraceArrays, s: _State, fixes: Counter[str], rounds: int, dropped: int, before: int) -> RepairReport:
    kept = s.origin >= 0
    o = s.origin[kept]
    cols = _changed_columns(a0, s, kept)
    any_col = np.zeros(int(kept.sum()), dtype=bool)
    for v in cols.values():
        any_col |= v
    inserted = int((~kept).sum())
    deleted = a0.n - int(kept.sum())
    gone = np.ones(a0.n, dtype=bool)
    gone[o] = False
    touched = np.union1d(np.flatnonzero(gone), o[any_col])
    return RepairReport(
        events_in=a0.n,
        events_out=s.n,
        rounds=rounds,
        fixes={r: int(fixes.get(r, 0)) for r in RULES},
        columns={k: int(v.sum()) for k, v in cols.items()},
        inserted=inserted,
        deleted=deleted,
        modified=int(any_col.sum()),
        touched=touched,
        dropped_in_fallback=dropped,
        violations_before=before,
        violations_after=0,
    )
