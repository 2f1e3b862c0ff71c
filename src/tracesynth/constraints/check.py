"""Vectorised checking of a Trace against mined Rules.

Each detector works on whole numpy columns: per-thread and per-CPU order come from one stable
argsort each, never from a Python loop over events. A detector returns the violating event
indices with what was found and what the rules expected there (as codes); `check_trace`
counts them and renders the first few as text.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from rich.table import Table

from tracesynth.constraints.rules import (
    LEARNED,
    RULES,
    Compiled,
    Rules,
    compile_rules,
    kind_of,
    ret_keys,
    ret_symbols,
    symbol_name,
)
from tracesynth.events import MAX_ERRNO
from tracesynth.kernel import CLOSED
from tracesynth.trace import Trace

DESCRIPTIONS = {
    "transition.global": "event type may follow the previous event (any thread)",
    "transition.thread": "event type may follow the thread's previous event",
    "dt.event": "gap to the previous event within the bounds of its event type",
    "dt.transition": "gap within the bounds of its (previous, event) transition",
    "cpu.comm": "command runs on a CPU it was seen on",
    "cpu.tid": "thread runs on a CPU it was seen on",
    "ret.value": "return value in the valid set of its event type",
    "comm.value": "command seen issuing this event type",
    "syscall.pairing": "syscall exit follows the entry of the same call on the same thread",
    "sched.consistency": "between two sched_switch on a CPU, its events belong to one thread",
    "sched.one_cpu": "a thread is current on one CPU at a time",
    "time.monotonic": "time does not decrease",
    "ret.errno": f"a syscall's negative return is an errno (-{MAX_ERRNO}..-1)",
}
N_EXAMPLES = 5
_NONE = -1


@dataclass
class Found:
    """Violations of one rule: event indices, with found / expected codes (meaning per rule)."""

    rule: str
    idx: np.ndarray
    found: np.ndarray
    expected: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)


class TraceArrays:
    """A trace as int64 numpy columns in the rules' extended vocabulary, plus derived orders."""

    def __init__(self, trace: Trace, rules: Rules, compiled: Compiled | None = None):
        ev_codes, ev_vocab = trace.codes("event")
        comm_codes, comm_vocab = trace.codes("comm")
        self.c = compiled or compile_rules(rules, ev_vocab, comm_vocab)
        ev_map = np.array([self.c.names.index(n) for n in ev_vocab] or [0], dtype=np.int64)
        comm_lookup = {n: i for i, n in enumerate(self.c.comms)}
        comm_map = np.array([comm_lookup[n] for n in comm_vocab] + [-1], dtype=np.int64)
        self.n = len(trace)
        self.ev = ev_map[ev_codes] if self.n else np.zeros(0, np.int64)
        self.comm = comm_map[comm_codes]  # null (-1) indexes the trailing -1
        self.ts = trace.ts.astype(np.int64, copy=False)
        self.cpu = trace.numeric("cpu", -1)
        self.tid = trace.numeric("tid", -1)
        self.has_ret = trace.table["ret"].is_valid().to_numpy(zero_copy_only=False)
        self.ret = trace.numeric("ret", 0)

    @classmethod
    def from_arrays(cls, c: Compiled, **cols: np.ndarray) -> TraceArrays:
        self = cls.__new__(cls)
        self.c = c
        for k, v in cols.items():
            setattr(self, k, v)
        self.n = len(self.ev)
        return self

    # -- derived orders (computed once, on demand) ----------------------------------------------
    @cached_property
    def dt(self) -> np.ndarray:
        return np.diff(self.ts)  # dt[i-1] is the gap before event i

    @cached_property
    def thread_prev(self) -> np.ndarray:
        """Index of the previous event of the same thread (-1: none or tid unknown)."""
        return _prev_in_group(self.tid, self.tid >= 0)

    @cached_property
    def cpu_segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order, seg, next_switch): events with a CPU sorted by (cpu, index); segment id of each
        sorted position; original index of the switch that ends the segment (n if none)."""
        c = self.c
        k = c.kernel
        valid = self.cpu >= 0
        idx = np.flatnonzero(valid)
        order = idx[np.argsort(_small_codes(self.cpu[idx]), kind="stable")]
        cpu_s = self.cpu[order]
        sw = k.closes[self.ev[order]]  # the events that end a stay ("prev") or hand the CPU over ("next")
        new_cpu = np.ones(len(order), dtype=bool)
        new_cpu[1:] = cpu_s[1:] != cpu_s[:-1]
        seg = np.cumsum(k.segment_starts(self.ev[order], new_cpu)) - 1
        # original index of the next switch at-or-after ("prev") / after ("next") each position,
        # within the same CPU: reverse running minimum of keys offset by the CPU's rank
        n = self.n
        rank = np.cumsum(new_cpu) - 1
        if k.prev:
            val = np.where(sw, order, n)
        else:
            nxt = np.full(len(order), n, dtype=np.int64)
            nxt[:-1] = np.where(sw[1:] & ~new_cpu[1:], order[1:], n)
            val = nxt
        key = rank.astype(np.int64) * (n + 1) + val
        end = np.minimum.accumulate(key[::-1])[::-1] - rank * (n + 1)
        return order, seg, end

    @cached_property
    def syscall_prev(self) -> tuple[np.ndarray, np.ndarray]:
        """Indices of paired syscall events with a thread, and each one's previous such event."""
        c = self.c
        m = c.kernel.is_syscall[self.ev] & (self.tid >= 0)
        idx = np.flatnonzero(m)
        prev = _prev_in_group(self.tid[idx], np.ones(len(idx), bool))
        return idx, np.where(prev >= 0, idx[np.maximum(prev, 0)], -1)


def _small_codes(keys: np.ndarray) -> np.ndarray:
    """Keys as small unsigned codes in the same order: numpy sorts 16-bit integers stably by radix,
    several times faster than 64-bit ones (tids and CPUs of one trace span a narrow range)."""
    if not len(keys):
        return keys
    lo, hi = int(keys.min()), int(keys.max())
    if hi - lo < 1 << 16:
        return (keys - lo).astype(np.uint16)
    uniq, inv = np.unique(keys, return_inverse=True)
    return inv.astype(np.uint16 if len(uniq) <= 1 << 16 else np.int64)


def _prev_in_group(keys: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """For each position, the previous position with the same key (-1 if none or not valid)."""
    out = np.full(len(keys), -1, dtype=np.int64)
    idx = np.flatnonzero(valid)
    if len(idx) < 2:
        return out
    order = idx[np.argsort(_small_codes(keys[idx]), kind="stable")]
    k = keys[order]
    same = k[1:] == k[:-1]
    out[order[1:][same]] = order[:-1][same]
    return out


# -- detectors ------------------------------------------------------------------------------------


def _transition_global(a: TraceArrays) -> Found:
    c = a.c
    if a.n < 2:
        return _empty("transition.global")
    p, e = a.ev[:-1], a.ev[1:]
    bad = np.flatnonzero(c.g_forbid[p, e]) + 1
    return Found("transition.global", bad, a.ev[bad], a.ev[bad - 1])


def _transition_thread(a: TraceArrays) -> Found:
    c = a.c
    prev = a.thread_prev
    i = np.flatnonzero(prev >= 0)
    p = a.ev[prev[i]]
    bad = i[c.t_forbid[p, a.ev[i]]]
    return Found("transition.thread", bad, a.ev[bad], a.ev[prev[bad]])


def dt_bounds(a: TraceArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, has_transition_rule) per event index >= 1: the intersection of the event and
    transition bounds on the gap before it."""
    c = a.c
    e = a.ev[1:]
    lo = c.dt_lo[e].copy()
    hi = c.dt_hi[e].copy()
    has = np.zeros(len(e), dtype=bool)
    if len(c.dtt_keys):
        key = a.ev[:-1] * len(c.names) + e
        pos = np.minimum(np.searchsorted(c.dtt_keys, key), len(c.dtt_keys) - 1)
        has = c.dtt_keys[pos] == key
        lo[has] = np.maximum(lo[has], c.dtt_lo[pos[has]])
        hi[has] = np.minimum(hi[has], c.dtt_hi[pos[has]])
    return lo, hi, has


def _dt_event(a: TraceArrays) -> Found:
    c = a.c
    if a.n < 2:
        return _empty("dt.event")
    e = a.ev[1:]
    dt = a.dt
    bad = np.flatnonzero((dt < c.dt_lo[e]) | (dt > c.dt_hi[e]))
    return Found("dt.event", bad + 1, dt[bad], np.stack([c.dt_lo[e[bad]], c.dt_hi[e[bad]]], axis=1))


def _dt_transition(a: TraceArrays) -> Found:
    c = a.c
    if a.n < 2 or not len(c.dtt_keys):
        return _empty("dt.transition")
    key = a.ev[:-1] * len(c.names) + a.ev[1:]
    pos = np.minimum(np.searchsorted(c.dtt_keys, key), len(c.dtt_keys) - 1)
    has = c.dtt_keys[pos] == key
    dt = a.dt
    bad = np.flatnonzero(has & ((dt < c.dtt_lo[pos]) | (dt > c.dtt_hi[pos])))
    return Found("dt.transition", bad + 1, dt[bad], np.stack([c.dtt_lo[pos[bad]], c.dtt_hi[pos[bad]]], axis=1))


def _cpu_ok(allowed: np.ndarray, rows: np.ndarray, cpu: np.ndarray) -> np.ndarray:
    inside = (cpu >= 0) & (cpu < allowed.shape[1])
    ok = np.zeros(len(rows), dtype=bool)
    ok[inside] = allowed[rows[inside], cpu[inside]]
    return ok


def _cpu_comm(a: TraceArrays) -> Found:
    c = a.c
    m = (a.cpu >= 0) & (a.comm >= 0)
    i = np.flatnonzero(m)
    i = i[c.cpu_comm_enforced[a.comm[i]]]
    bad = i[~_cpu_ok(c.cpu_comm_allowed, a.comm[i], a.cpu[i])]
    return Found("cpu.comm", bad, a.cpu[bad], a.comm[bad])


def tid_rule_rows(a: TraceArrays) -> np.ndarray:
    """Row of each event's thread in the per-thread CPU rules (-1 where none)."""
    tids = a.c.cpu_tids
    if not len(tids):
        return np.full(a.n, -1, dtype=np.int64)
    pos = np.minimum(np.searchsorted(tids, a.tid), len(tids) - 1)
    return np.where((tids[pos] == a.tid) & (a.tid >= 0), pos, -1)


def _cpu_tid(a: TraceArrays) -> Found:
    c = a.c
    rows = tid_rule_rows(a)
    i = np.flatnonzero((rows >= 0) & (a.cpu >= 0))
    bad = i[~_cpu_ok(c.cpu_tid_allowed, rows[i], a.cpu[i])]
    return Found("cpu.tid", bad, a.cpu[bad], a.tid[bad])


def _ret_value(a: TraceArrays) -> Found:
    c = a.c
    pres = c.ret_presence[a.ev]
    missing = (pres == 1) & ~a.has_ret
    extra = (pres == 2) & a.has_ret
    i = np.flatnonzero(a.has_ret & c.ret_enforced[a.ev])
    sym = ret_symbols(a.ret[i])
    keys = ret_keys(a.ev[i], sym)
    ak = c.ret_allowed_keys
    if len(ak):
        pos = np.minimum(np.searchsorted(ak, keys), len(ak) - 1)
        ok = ak[pos] == keys
    else:
        ok = np.zeros(len(i), dtype=bool)
    bad_val = np.zeros(a.n, dtype=bool)
    bad_val[i[~ok]] = True
    bad = np.flatnonzero(missing | extra | bad_val)
    kind = np.where(missing[bad], 1, np.where(extra[bad], 2, 0))  # 0 value, 1 missing, 2 unexpected
    return Found("ret.value", bad, a.ret[bad], a.ev[bad], {"kind": kind})


def _comm_value(a: TraceArrays) -> Found:
    c = a.c
    # a command the rules never saw is not judged (a new program is no evidence of a violation)
    i = np.flatnonzero((a.comm >= 0) & (a.comm < c.n_known_comms) & c.comm_enforced[a.ev])
    bad = i[~c.comm_allowed[a.ev[i], a.comm[i]]]
    return Found("comm.value", bad, a.comm[bad], a.ev[bad])


def _syscall_pairing(a: TraceArrays) -> Found:
    """found: the event; expected: the exit code of the open call (entry while open, wrong exit),
    or -1 for an exit with no open entry."""
    k = a.c.kernel
    idx, prev = a.syscall_prev
    e = a.ev[idx]
    state = k.state_before(a.ev[np.maximum(prev, 0)], prev >= 0)  # what the thread's previous syscall event left
    bad = ~k.allows(state, e)
    orphan = state == CLOSED
    expected = np.where(orphan, _NONE, k.expected_exit(state))
    return Found("syscall.pairing", idx[bad], e[bad], expected[bad], {"kind": np.where(orphan, 1, 0)[bad]})


def _sched_consistency(a: TraceArrays) -> Found:
    """expected: the thread that owns the CPU segment (its most frequent tid)."""
    c = a.c
    if c.kernel.switch < 0:
        return _empty("sched.consistency")
    order, seg, _ = a.cpu_segments
    tid = a.tid[order]
    v = tid >= 0
    if not v.any():
        return _empty("sched.consistency")
    s, t = seg[v], tid[v]
    owner_of_seg = np.full(int(seg.max()) + 1, -1, dtype=np.int64)
    # most segments hold one thread; only the mixed ones need the most frequent tid
    first = np.ones(len(s), dtype=bool)
    first[1:] = s[1:] != s[:-1]
    owner_of_seg[s[first]] = t[first]
    mixed = np.unique(s[t != owner_of_seg[s]])
    if len(mixed):
        m = np.isin(s, mixed)
        ms, mt = s[m], t[m]
        uniq, inv = np.unique(mt, return_inverse=True)
        keys, counts = np.unique(ms * len(uniq) + inv, return_counts=True)
        kseg = keys // len(uniq)
        pick = np.lexsort((-counts, kseg))  # by segment, most frequent first (ties: smallest tid)
        top = np.ones(len(pick), dtype=bool)
        top[1:] = kseg[pick][1:] != kseg[pick][:-1]
        owner_of_seg[kseg[pick][top]] = uniq[keys[pick][top] % len(uniq)]
    expected = owner_of_seg[s]
    badpos = np.flatnonzero(t != expected)
    idx = order[v][badpos]
    srt = np.argsort(idx)
    return Found("sched.consistency", idx[srt], t[badpos][srt], expected[badpos][srt])


def thread_current_until(a: TraceArrays) -> np.ndarray:
    """For each event with a CPU: the original index of the switch ending its segment (n: none)."""
    order, _, end = a.cpu_segments
    out = np.full(a.n, a.n, dtype=np.int64)
    out[order] = end
    return out


def _one_cpu(a: TraceArrays) -> Found:
    """found: the CPU the thread appears on; expected: the CPU where it is still current."""
    c = a.c
    if c.kernel.switch < 0:  # without sched_switch nothing says when a thread stops being current
        return _empty("sched.one_cpu")
    prev = a.thread_prev
    i = np.flatnonzero(prev >= 0)
    p = prev[i]
    m = (a.cpu[i] >= 0) & (a.cpu[p] >= 0) & (a.cpu[i] != a.cpu[p])
    i, p = i[m], p[m]
    if len(c.one_cpu_exempt):
        i_t = a.tid[i]
        pos = np.minimum(np.searchsorted(c.one_cpu_exempt, i_t), len(c.one_cpu_exempt) - 1)
        keep = c.one_cpu_exempt[pos] != i_t
        i, p = i[keep], p[keep]
    until = thread_current_until(a)
    bad = until[p] > i
    return Found("sched.one_cpu", i[bad], a.cpu[i[bad]], a.cpu[p[bad]])


def _monotonic(a: TraceArrays) -> Found:
    if a.n < 2:
        return _empty("time.monotonic")
    bad = np.flatnonzero(a.dt < 0) + 1
    return Found("time.monotonic", bad, a.ts[bad], a.ts[bad - 1])


def _ret_errno(a: TraceArrays) -> Found:
    bad = np.flatnonzero(a.c.kernel.bad_return(a.ev, a.has_ret, a.ret))
    return Found("ret.errno", bad, a.ret[bad], a.ev[bad])


def _empty(rule: str) -> Found:
    z = np.zeros(0, dtype=np.int64)
    return Found(rule, z, z, z)


DETECTORS: dict[str, Callable[[TraceArrays], Found]] = {
    "transition.global": _transition_global,
    "transition.thread": _transition_thread,
    "dt.event": _dt_event,
    "dt.transition": _dt_transition,
    "cpu.comm": _cpu_comm,
    "cpu.tid": _cpu_tid,
    "ret.value": _ret_value,
    "comm.value": _comm_value,
    "syscall.pairing": _syscall_pairing,
    "sched.consistency": _sched_consistency,
    "sched.one_cpu": _one_cpu,
    "time.monotonic": _monotonic,
    "ret.errno": _ret_errno,
}


def detect_all(a: TraceArrays) -> dict[str, Found]:
    return {name: det(a) for name in RULES for det in (DETECTORS[name],)}


def rule_contexts(a: TraceArrays, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """(event indices a rule applies to, the context key of each): the predecessor's type for
    transitions, the event type for gaps and values, the (previous, event) pair for transition
    gaps, the command / thread for CPU sets; 0 for an invariant. Used to calibrate each entry."""
    c = a.c
    n = a.n
    after_first = np.arange(1, n, dtype=np.int64)
    if rule == "transition.global":
        return after_first, a.ev[:-1]
    if rule == "transition.thread":
        i = np.flatnonzero(a.thread_prev >= 0)
        return i, a.ev[a.thread_prev[i]]
    if rule == "dt.event":
        return after_first, a.ev[1:]
    if rule == "dt.transition":
        return after_first, a.ev[:-1] * len(c.names) + a.ev[1:]
    if rule == "cpu.comm":
        i = np.flatnonzero((a.cpu >= 0) & (a.comm >= 0))
        return i, a.comm[i]
    if rule == "cpu.tid":
        i = np.flatnonzero((a.cpu >= 0) & (a.tid >= 0))
        return i, a.tid[i]
    if rule == "ret.value":
        return np.arange(n, dtype=np.int64), a.ev
    if rule == "comm.value":
        i = np.flatnonzero((a.comm >= 0) & (a.comm < c.n_known_comms))
        return i, a.ev[i]
    if rule == "syscall.pairing":
        i = a.syscall_prev[0]
    elif rule in ("sched.consistency", "sched.one_cpu"):
        i = np.flatnonzero((a.cpu >= 0) & (a.tid >= 0)) if c.kernel.switch >= 0 else np.zeros(0, np.int64)
    elif rule == "ret.errno":
        i = np.flatnonzero(c.kernel.is_syscall_exit[a.ev] & a.has_ret)
    else:
        i = np.arange(n, dtype=np.int64)
    return i, np.zeros(len(i), dtype=np.int64)


# -- report ---------------------------------------------------------------------------------------


def _succ_names(c: Compiled, weight: np.ndarray, prev: int, k: int = 3) -> str:
    row = weight[prev]
    top = np.argsort(-row, kind="stable")[:k]
    names = [c.names[j] for j in top if row[j] > 0]
    more = int((row > 0).sum()) - len(names)
    return "one of " + ", ".join(names) + (f" (+{more} more)" if more > 0 else "")


def _describe(a: TraceArrays, f: Found, j: int) -> tuple[str, str]:
    """(found, expected) text for example j of a Found."""
    c = a.c
    i = int(f.idx[j])
    fv, ev = f.found[j], f.expected[j]
    r = f.rule
    if r == "transition.global":
        return f"{c.names[fv]} after {c.names[ev]}", _succ_names(c, c.g_weight, int(ev))
    if r == "transition.thread":
        return f"{c.names[fv]} after {c.names[ev]} (tid {a.tid[i]})", _succ_names(c, c.t_weight, int(ev))
    if r in ("dt.event", "dt.transition"):
        hi = "inf" if ev[1] == np.iinfo(np.int64).max else f"{int(ev[1]):,}"
        return f"gap {int(fv):,} ns before {c.names[a.ev[i]]}", f"[{int(ev[0]):,}, {hi}] ns"
    if r == "cpu.comm":
        cpus = np.flatnonzero(c.cpu_comm_allowed[ev]).tolist()
        return f"{c.comms[ev]} on CPU {int(fv)}", f"CPU in {cpus}"
    if r == "cpu.tid":
        row = tid_rule_rows(a)[i]
        return f"tid {int(ev)} on CPU {int(fv)}", f"CPU in {np.flatnonzero(c.cpu_tid_allowed[row]).tolist()}"
    if r == "ret.value":
        kind = int(f.extra["kind"][j])
        name = c.names[ev]
        if kind == 1:
            return f"{name} without a return value", "a return value"
        if kind == 2:
            return f"{name} with return value {int(fv)}", "no return value"
        syms, _ = c.ret_sym_table[ev]
        allowed = ", ".join(symbol_name(int(s)) for s in syms[:6]) + (" ..." if len(syms) > 6 else "")
        return f"{name} returned {int(fv)} ({symbol_name(int(ret_symbols(np.array([fv]))[0]))})", f"one of {allowed}"
    if r == "comm.value":
        comms = [c.comms[k] for k in np.flatnonzero(c.comm_allowed[ev])[:4]]
        return f"{c.names[ev]} by {c.comms[fv]}", "by " + ", ".join(comms)
    if r == "syscall.pairing":
        where = f"(tid {a.tid[i]})"
        if int(f.extra["kind"][j]) == 1:
            return f"{c.names[fv]} {where} with no open entry", "an entry of the same call first"
        if c.kernel.is_exit[fv]:
            return f"{c.names[fv]} {where}", c.names[ev]
        return f"{c.names[fv]} {where} while a call is open", f"{c.names[ev]} first"
    if r == "sched.consistency":
        return f"tid {int(fv)} on CPU {a.cpu[i]}", f"tid {int(ev)} (current since the last sched_switch)"
    if r == "sched.one_cpu":
        return f"tid {a.tid[i]} on CPU {int(fv)}", f"CPU {int(ev)} (still current there, no sched_switch yet)"
    if r == "time.monotonic":
        return f"ts {int(fv)}", f">= {int(ev)}"
    if r == "ret.errno":
        return f"{c.names[ev]} returned {int(fv)}", f">= -{MAX_ERRNO} (an errno) or a non-negative value"
    return str(fv), str(ev)


@dataclass
class CheckReport:
    """Violations per rule: counts, first examples, and the share of events that violate any rule.
    Only enforced entries and the invariants count; what advisory entries would have flagged is
    kept apart (advisory, advisory_examples) and never counts in total or rate."""

    events: int
    counts: dict[str, int]
    examples: dict[str, list[dict[str, Any]]]
    violating_events: int
    calibration: dict[str, dict[str, Any]] = field(default_factory=dict)  # Rules.rule_table()
    advisory: dict[str, int] = field(default_factory=dict)  # learned rule -> events an advisory entry flags
    advisory_examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Violations summed over rules (an event may break several)."""
        return sum(self.counts.values())

    @property
    def rate(self) -> float:
        """Violating events / events."""
        return self.violating_events / self.events if self.events else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "total": self.total,
            "violating_events": self.violating_events,
            "rate": self.rate,
            "rules": {r: self._rule_dict(r) for r in RULES},
        }

    def _rule_dict(self, r: str) -> dict[str, Any]:
        cal = self.calibration.get(r, {})
        out = {
            "kind": kind_of(r),
            "calibrated_fp_rate": cal.get("fp_rate"),
            "enforced_entries": cal.get("enforced"),
            "blocks": cal.get("blocks"),
            "blocks_total": cal.get("blocks_total"),
            "violations": self.counts[r],
            "description": DESCRIPTIONS[r],
            "examples": self.examples[r],
        }
        if kind_of(r) == "learned":
            out["advisory_entries"] = cal.get("advisory")
            out["advisory_flags"] = self.advisory.get(r, 0)
            out["advisory_examples"] = self.advisory_examples.get(r, [])
        return out

    def table(self, title: str | None = None) -> Table:
        """A rich table: one row per enforced rule (with the first example), the share of events
        breaking any, then the advisory rules apart (what they would flag; not violations)."""
        t = Table(title=title, show_lines=False)
        for col, just in _COLUMNS:
            t.add_column(col, justify=just)
        for r in RULES:
            n = self.counts[r]
            style = "red" if n else "green"
            cal = self.calibration.get(r, {})
            row = (
                _blocks_text(cal),
                _fp_text(cal.get("fp_rate")),
                f"[{style}]{n:,}[/]",
                f"{n / max(1, self.events):.3%}",
            )
            t.add_row(r, kind_of(r), _entries_text(cal.get("enforced")), *row, _first(self.examples[r]))
        t.add_row(
            "[bold]any[/]",
            "",
            "",
            "",
            "",
            f"[bold]{self.violating_events:,}[/]",
            f"[bold]{self.rate:.3%}[/]",
            f"of {self.events:,} events",
        )
        t.add_section()
        for r in RULES:
            if kind_of(r) != "learned":
                continue
            n = self.advisory.get(r, 0)
            cal = self.calibration.get(r, {})
            t.add_row(
                f"[dim]{r}[/]",
                "advisory",
                _entries_text(cal.get("advisory")),
                "",
                "",
                f"[dim]{n:,}[/]",
                f"[dim]{n / max(1, self.events):.3%}[/]",
                _first(self.advisory_examples.get(r, [])),
            )
        return t


_COLUMNS = (
    ("rule", "left"),
    ("kind", "left"),
    ("entries", "right"),
    ("blocks", "right"),
    ("calibrated FP", "right"),
    ("violations", "right"),
    ("share", "right"),
    ("first example (event: found -> expected)", "left"),
)


def _first(ex: list[dict[str, Any]]) -> str:
    return f"#{ex[0]['index']}: {ex[0]['found']} -> {ex[0]['expected']}" if ex else ""


def _fp_text(fp: float | None) -> str:
    return "n/a" if fp is None else f"{fp:.3%}"


def _entries_text(n: int | None) -> str:
    return "" if n is None else f"{n:,}"


def _blocks_text(cal: dict[str, Any]) -> str:
    """Held-out blocks the rule's enforced entries applied in, of those calibrated (n/a: none)."""
    total = cal.get("blocks_total")
    return "n/a" if not total else f"{cal.get('blocks', 0)}/{total}"


def _examples(a: TraceArrays, found: dict[str, Found], n_examples: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r, f in found.items():
        rows = []
        for j in range(min(n_examples, len(f.idx))):
            fs, es = _describe(a, f, j)
            rows.append({"index": int(f.idx[j]), "found": fs, "expected": es})
        out[r] = rows
    return out


def report_from(
    a: TraceArrays, found: dict[str, Found], n_examples: int = N_EXAMPLES, calibration: dict | None = None
) -> CheckReport:
    counts = {r: int(len(found[r].idx)) for r in RULES}
    examples = _examples(a, {r: found[r] for r in RULES}, n_examples)
    any_bad = np.zeros(a.n, dtype=bool)
    for f in found.values():
        any_bad[f.idx] = True
    return CheckReport(a.n, counts, examples, int(any_bad.sum()), dict(calibration or {}))


def detect_advisory(a: TraceArrays, rules: Rules) -> tuple[TraceArrays, dict[str, Found]]:
    """What the advisory entries of the learned rules flag (the invariants have none), and the
    arrays they were found on: those of `a` (same vocabulary, so the same codes) with the
    advisory view of the rules."""
    adv = copy.copy(a)  # keeps the derived orders already computed (they depend on the trace only)
    adv.c = compile_rules(rules, a.c.names[a.c.n_known :], a.c.comms[a.c.n_known_comms :], view="advisory")
    return adv, {r: DETECTORS[r](adv) for r in LEARNED}


def check_trace(trace: Trace, rules: Rules, advisory: bool = True) -> CheckReport:
    """Count violations of every rule in a trace (vectorised), with the first few examples; with
    advisory, also what the advisory entries would flag (reported apart, never counted)."""
    a = TraceArrays(trace, rules)
    rep = report_from(a, detect_all(a), calibration=rules.rule_table())
    if advisory and rules.doc.get("version", 0) >= 3:
        adv, found = detect_advisory(a, rules)
        rep.advisory = {r: int(len(f.idx)) for r, f in found.items()}
        rep.advisory_examples = _examples(adv, found, N_EXAMPLES)
    return rep
