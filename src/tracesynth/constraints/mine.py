"""Mine constraints from real traces (nothing hand-written: every learned rule and its bounds come from data).

Learned rules are candidates first, then calibrated:

* **Sets** (successors of an event type, return-value symbols of a type, commands issuing a type)
  are *supported* where the data has seen enough of the context to be confident that what was
  never seen is really impossible. The test is the Good-Turing estimate of the probability mass
  of unseen values, smoothed by one: ``missing_mass = (n1 + 1) / (n + 1)`` where n is the
  context's observations and n1 the number of values seen exactly once. Commands are counted by
  thread (a thread is one observation however many events it issues), so a few processes never
  make a closed set.
* **CPU affinity** is supported only where the data shows pinning: over all threads, a reschedule
  moves to another CPU with probability p_move; a thread rescheduled r times that stayed inside
  s of the n CPUs would do so unpinned with probability (1 - p_move (n - s) / (n - 1))^r. Below
  pin_alpha it is pinned (per-CPU kernel threads); a thread that merely stayed is not.
* **Time bounds** on the gap before an event (per type, and per (previous, event) transition
  with more support) cover every gap seen in training, widened in log space to ``[q_lo / margin,
  q_hi * margin]`` where q_lo, q_hi are the dt_quantile tails.
* **Return values** are symbols: 0, each errno exactly (-4095..-1) and other values by log2
  bucket ([2^k, 2^(k+1))); the allowed set also fills the gaps between the smallest and largest
  bucket seen, so a read of 3000 bytes is fine when 2000 and 5000 were seen.
* **Calibration across time blocks**: each training trace is cut in time into calibration_blocks
  blocks; each block is held out in turn and every candidate mined from the other blocks is
  checked there, per context (blocked cross-validation in time: a phase that only some blocks
  hold shows up as a block where the rule breaks). An entry is enforced when it is supported,
  was exercised by at least calibration_min_blocks held-out blocks, holds in every block that
  exercised it (violations <= max_fp_rate * applies there) and its pooled false-positive rate,
  counted with one more error than seen ((violations + 1) / (applies + 1)), is at most
  max_fp_rate: a rule must have applied about 1 / max_fp_rate times without error to show it
  errs that rarely. A supported entry that falls short is *advisory*: kept as guidance (its counts
  weight sampling and repair), never flagged. The stored sets and bounds are then mined from all
  of the training data.
* **Weak transitions**: an enforced transition forbids an unseen successor only where that
  successor is common enough (its share of all successors) that the predecessor's n observations
  should have shown it transition_min_expected times; the rare unseen successors (and event types
  never seen at all) are advisory (see rules.py).
* **Invariants** (syscall entry/exit pairing per thread, one thread per CPU between two
  sched_switch, a thread current on one CPU at a time, non-decreasing time, errno range) are
  kernel facts and always enforced. The data decides only the details: which syscalls never
  return (exit_group), whether the reader puts a sched_switch on the outgoing or the incoming
  thread, which threads besides the idle task are current on many CPUs (a reader artefact).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from math import lgamma
from typing import Any

import numpy as np

from tracesynth.constraints.check import DETECTORS, TraceArrays, _prev_in_group, rule_contexts
from tracesynth.constraints.rules import (
    _POS_BASE,
    FORMAT,
    INVARIANTS,
    LEARNED,
    VERSION,
    Rules,
    compile_rules,
    kind_of,
    ret_symbols,
    symbol_name,
)
from tracesynth.errors import TraceSynthError
from tracesynth.events import IDLE_TID, SCHED_SWITCH, SYSCALL_ENTRY, SYSCALL_EXIT
from tracesynth.trace import Trace

DEFAULT_PARAMS: dict[str, Any] = {
    "min_support": 50,  # observations of a context before its set is supported
    "max_missing_mass": 0.01,  # Good-Turing (n1+1)/(n+1) above this: the set stays open
    "dt_min_support": 50,  # gaps of an event type before its time bounds are supported
    "dt_transition_min_support": 500,  # gaps of a (previous, event) pair for its own bounds
    "dt_quantile": 0.001,  # tails used for the bounds (then widened by dt_margin)
    "dt_margin": 4.0,  # bounds are [q_lo / margin, q_hi * margin], always covering what was seen
    "pin_alpha": 0.001,  # CPU set enforced when an unpinned thread would stay inside it this rarely
    "calibration_blocks": 5,  # time blocks of each training trace, each held out in turn (< 2: none)
    "calibration_min_events": 500,  # a trace is cut into fewer blocks if they would be shorter
    "calibration_min_blocks": 2,  # held-out blocks that must exercise an entry before it is enforced
    "max_fp_rate": 0.001,  # a learned entry is enforced when it errs at most this often there
    "transition_min_expected": 10.0,  # an unseen successor is forbidden only if this many were expected
    "unpaired_min_closed": 0.5,  # a syscall whose entries are closed by its exit less often never returns
}


def mine_rules(traces: Sequence[Trace], params: Mapping[str, Any] | None = None) -> Rules:
    """Learn Rules from real traces (each trace is one contiguous recording, in time order)."""
    p = _params(params)
    traces = [t for t in traces if len(t)]
    if not traces:
        raise TraceSynthError("no events to mine rules from")
    names = sorted({n for t in traces for n in t.codes("event")[1]})
    comms = sorted({n for t in traces for n in t.codes("comm")[1]})
    doc = _mine_doc(traces, names, comms, p)
    folds, held_events = [], 0
    for fit, held in _folds(traces, p):
        candidate = _mine_doc(fit, names, comms, p, invariants=doc["invariants"])
        folds.append((candidate, _calibrate(candidate, held)))
        held_events += sum(len(t) for t in held)
    doc["rules"] = _settle(doc, folds, p)
    doc["source"]["calibration_events"] = int(held_events)
    doc["source"]["calibration_blocks"] = len(folds)
    return Rules(doc)


def _params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The defaults updated by `params`; an old calibration_fraction f asks for about 1 / f blocks
    (0: no calibration). calibration_fraction is stored as the share of one held-out block."""
    p = dict(DEFAULT_PARAMS)
    p.update(params or {})
    if params and "calibration_fraction" in params and "calibration_blocks" not in params:
        f = float(params["calibration_fraction"])
        p["calibration_blocks"] = round(1 / f) if 0 < f < 1 else 0
    k = int(p["calibration_blocks"])
    p["calibration_fraction"] = round(1 / k, 6) if k >= 2 else 0.0
    return p


def _folds(traces: Sequence[Trace], p: Mapping[str, Any]) -> list[tuple[list[Trace], list[Trace]]]:
    """Blocked cross-validation in time: fold k holds out block k of every trace long enough to be
    cut into more than k blocks (of at least calibration_min_events each) and fits on the rest
    (the blocks before it and those after it as two contiguous traces, never joined)."""
    k_max = int(p["calibration_blocks"])
    cuts = []
    for t in traces:
        k = min(k_max, len(t) // max(1, int(p["calibration_min_events"])))
        cuts.append(np.round(np.linspace(0, len(t), k + 1)).astype(int) if k >= 2 else None)
    folds = []
    for k in range(k_max if any(c is not None for c in cuts) else 0):
        fit, held = [], []
        for t, c in zip(traces, cuts, strict=True):
            if c is None or k >= len(c) - 1:
                fit.append(t)
                continue
            held.append(t.slice(int(c[k]), int(c[k + 1])))
            fit += [x for x in (t.slice(0, int(c[k])), t.slice(int(c[k + 1]), len(t))) if len(x)]
        if held:
            folds.append((fit, held))
    return folds


_SECTIONS = {section for section, _ in LEARNED.values()}


def _calibrate(candidate: dict[str, Any], held: Sequence[Trace]) -> dict[str, dict[str, tuple[int, int]]]:
    """Check every candidate entry (all enforced, supported or not) on the held-out blocks:
    per rule, context name -> (events it applied to, violations)."""
    forced = {k: (dict(v) if k in _SECTIONS else v) for k, v in candidate.items()}
    for section, sub in LEARNED.values():  # new entry dicts: the candidate itself stays as mined
        forced[section][sub] = {
            k: {**e, "enforced": bool(e.get("valid", True))} for k, e in forced[section][sub].items()
        }
    rules = Rules(forced)
    out: dict[str, dict[str, Counter]] = {r: {"applies": Counter(), "violations": Counter()} for r in DETECTORS}
    for t in held:
        c = compile_rules(rules, t.codes("event")[1], t.codes("comm")[1])
        a = TraceArrays(t, rules, c)
        for rule, det in DETECTORS.items():
            idx, key = rule_contexts(a, rule)
            key_at = np.full(a.n, -1, dtype=np.int64)
            key_at[idx] = key
            f = det(a)
            for what, keys in (("applies", key), ("violations", key_at[f.idx])):
                u, cnt = np.unique(keys, return_counts=True)
                for k, v in zip(u.tolist(), cnt.tolist(), strict=True):
                    out[rule][what][_context_name(rule, k, c)] += v
    return {r: {k: (d["applies"][k], d["violations"][k]) for k in d["applies"]} for r, d in out.items()}


def _context_name(rule: str, key: int, c: Any) -> str:
    """The document key of a rule_contexts key."""
    if rule in INVARIANTS:
        return "*"
    if rule == "dt.transition":
        V = len(c.names)
        return f"{c.names[key // V]} -> {c.names[key % V]}"
    if rule == "cpu.comm":
        return c.comms[key]
    if rule == "cpu.tid":
        return str(key)
    return c.names[key]


Stats = dict[str, dict[str, tuple[int, int]]]  # rule -> context -> (applies, violations)


def _settle(doc: dict[str, Any], folds: Sequence[tuple[dict[str, Any], Stats]], p: Mapping[str, Any]) -> dict:
    """Decide each learned entry (supported, and calibrated across the held-out blocks) as enforced,
    advisory or open, and summarise every rule."""
    table: dict[str, Any] = {}
    for rule, (section, sub) in LEARNED.items():
        tally = Counter()
        blocks = np.zeros(len(folds), dtype=bool)  # blocks where an enforced entry applied
        for ctx, e in doc[section][sub].items():
            per_block = [st[rule].get(ctx, (0, 0)) if ctx in cand[section][sub] else None for cand, st in folds]
            ok = bool(e["supported"]) and bool(e.get("valid", True))
            if folds:
                e["calibration"] = _entry_calibration(per_block)
                ok = ok and _holds(e["calibration"], per_block, p)
            e["enforced"], e["advisory"] = ok, bool(e["supported"]) and bool(e.get("valid", True)) and not ok
            tally["advisory"] += e["advisory"]
            if ok:
                tally["enforced"] += 1
                if folds:
                    tally["applies"] += e["calibration"]["applies"]
                    tally["bad"] += e["calibration"]["violations"]
                    blocks |= [b is not None and b[0] > 0 for b in per_block]
        table[rule] = _row(rule, tally, int(blocks.sum()), len(folds))
    for rule, key in INVARIANTS.items():
        inv = doc["invariants"][key]
        per_block = [st[rule].get("*", (0, 0)) for _, st in folds]
        inv["calibration"] = _entry_calibration(per_block)
        c = inv["calibration"]
        tally = Counter(enforced=1, applies=c["applies"], bad=c["violations"])
        table[rule] = _row(rule, tally, c["blocks"], len(folds))
    return table


def _entry_calibration(per_block: Sequence[tuple[int, int] | None]) -> dict[str, Any]:
    """Pooled over the held-out blocks where the entry had a candidate (None: the context was
    first seen in that block, so nothing mined from the others could be checked there)."""
    seen = [b for b in per_block if b is not None]
    applies, bad = sum(a for a, _ in seen), sum(v for _, v in seen)
    return {
        "applies": applies,
        "violations": bad,
        "fp_rate": _rate(bad, applies),
        "blocks": sum(a > 0 for a, _ in seen),
        "blocks_broken": sum(v > 0 for _, v in seen),
        "blocks_unseen": sum(b is None for b in per_block),
    }


def _holds(cal: Mapping[str, Any], per_block: Sequence[tuple[int, int] | None], p: Mapping[str, Any]) -> bool:
    """Enough blocks exercised it, it held in each (at the tolerated rate) and pooled."""
    every = all(v <= p["max_fp_rate"] * a for a, v in (b for b in per_block if b is not None))
    pooled = cal["violations"] + 1 <= p["max_fp_rate"] * (cal["applies"] + 1)
    return every and pooled and cal["blocks"] >= p["calibration_min_blocks"]


def _row(rule: str, tally: Mapping[str, int], blocks: int, blocks_total: int) -> dict[str, Any]:
    applies, bad = int(tally.get("applies", 0)), int(tally.get("bad", 0))
    row = {
        "kind": kind_of(rule),
        "enforced": int(tally.get("enforced", 0)),
        "calibration_applies": applies,
        "calibration_violations": bad,
        "fp_rate": _rate(bad, applies) if blocks_total and applies else None,  # None: nothing to measure
        "blocks": blocks,  # held-out blocks in which the enforced entries applied
        "blocks_total": blocks_total,
    }
    if kind_of(rule) == "learned":
        row["advisory"] = int(tally.get("advisory", 0))
    return row


def _rate(bad: int, applies: int) -> float:
    return round(bad / applies, 8) if applies else 0.0


def _mine_doc(
    traces: Sequence[Trace],
    names: list[str],
    comms: list[str],
    p: Mapping[str, Any],
    invariants: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The candidate document of some traces over the given vocabularies (no calibration yet).
    A calibration fold passes the invariants of the whole data: they are kernel facts, not
    calibrated, and mining their details is the slow part."""
    V = len(names)
    index = {n: i for i, n in enumerate(names)}
    cindex = {n: i for i, n in enumerate(comms)}
    switch = index.get(SCHED_SWITCH, -1)
    g_keys, t_keys, dts, dt_pairs, ret_ev, ret_sym, ret_all_ev = [], [], [], [], [], [], []
    comm_units, runs = [], []
    n_cpus = 0
    for t in traces:
        codes, vocab = t.codes("event")
        ev = np.array([index[n] for n in vocab], dtype=np.int64)[codes]
        ccodes, cvocab = t.codes("comm")
        comm = np.array([cindex[n] for n in cvocab] + [-1], dtype=np.int64)[ccodes]
        tid = t.numeric("tid", -1)
        cpu = t.numeric("cpu", -1)
        ret_valid = t.table["ret"].is_valid().to_numpy(zero_copy_only=False)
        ret = t.numeric("ret", 0)
        n_cpus = max(n_cpus, int(cpu.max()) + 1 if len(cpu) else 0)
        g_keys.append(ev[:-1] * V + ev[1:])
        prev = _prev_in_group(tid, tid >= 0)
        has = np.flatnonzero(prev >= 0)
        t_keys.append(ev[prev[has]] * V + ev[has])
        dts.append(np.diff(t.ts.astype(np.int64)))
        dt_pairs.append(ev[:-1] * V + ev[1:])
        ret_all_ev.append(ev)
        ret_ev.append(ev[ret_valid])
        ret_sym.append(ret_symbols(ret[ret_valid]))
        runs.append(_runs(ev, tid, cpu, comm, switch))
        # commands issuing each type, one observation per thread (a thread's events are one unit)
        cm = comm >= 0
        comm_units.append(_units(ev[cm], comm[cm], tid[cm], len(comms)))
    units = np.concatenate(comm_units) if comm_units else np.zeros((0, 2), np.int64)
    run_tid, run_comm, run_cpu, run_moved = (np.concatenate(x) for x in zip(*runs, strict=True))
    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "params": dict(p),
        "source": {
            "traces": len(traces),
            "events": int(sum(len(t) for t in traces)),
            "workloads": sorted({str(t.metadata.get("workload", "")) for t in traces} - {""}),
            "mined_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
        "events": names,
        "comms": comms,
        "transitions": {
            "global": _graph(np.concatenate(g_keys), names, p),
            "thread": _graph(np.concatenate(t_keys), names, p),
        },
        "dt": _dt(np.concatenate(dts), np.concatenate(dt_pairs), names, p),
        "values": {
            "ret": _ret(np.concatenate(ret_all_ev), np.concatenate(ret_ev), np.concatenate(ret_sym), names, p),
            "comm": _sets(units[:, 0], units[:, 1], names, comms, p, "counts"),
        },
    }
    keep = run_tid != IDLE_TID  # the idle task is one per CPU: never one thread's affinity
    stay = _migration_model(run_tid[keep], run_moved[keep])
    named = run_comm >= 0
    doc["cpu"] = {
        "n_cpus": n_cpus,
        "migration": stay,
        "comm": _cpu_sets(run_comm[named], run_cpu[named], run_moved[named], comms, n_cpus, stay, p),
        "tid": _cpu_sets(run_tid[keep], run_cpu[keep], run_moved[keep], None, n_cpus, stay, p),
    }
    doc["invariants"] = copy.deepcopy(invariants) if invariants is not None else _invariants(traces, doc, names, p)
    return doc


def _units(ev: np.ndarray, comm: np.ndarray, tid: np.ndarray, n_comms: int) -> np.ndarray:
    """The distinct (event, command, thread) triples as (event, command) rows: one flat int64
    key each (a row-wise unique sorts several times slower)."""
    _, tcode = np.unique(tid, return_inverse=True)
    T, C = max(1, int(tcode.max()) + 1 if len(tcode) else 1), max(1, n_comms)
    key = np.unique((ev * C + comm) * T + tcode.reshape(-1))
    return np.stack([key // T // C, key // T % C], axis=1)


def _migration_model(tid: np.ndarray, moved: np.ndarray, min_resched: int = 10) -> dict[str, float]:
    """How often threads that may move do move at a reschedule, as a Beta(a, b) over threads (fitted
    by moments to each thread's share of reschedules that moved): threads differ a lot (a busy one
    stays on its cache-hot CPU for hundreds of reschedules), so one pooled rate would call a thread
    that merely stayed pinned."""
    r = moved >= 0
    u, inv = np.unique(tid[r], return_inverse=True)
    n = np.bincount(inv, minlength=len(u))
    k = np.bincount(inv, weights=moved[r] == 1, minlength=len(u))
    judged = n >= min_resched
    pooled = float(k.sum() / n.sum()) if n.sum() else 0.0
    x = k[judged] / n[judged]
    m, v = (float(x.mean()), float(x.var())) if len(x) >= 3 else (pooled, 0.0)
    if 0 < m < 1 and 0 < v < m * (1 - m):
        common = m * (1 - m) / v - 1
        return {"a": m * common, "b": (1 - m) * common, "threads": int(judged.sum()), "pooled": pooled}
    return {"a": 0.0, "b": 0.0, "threads": int(judged.sum()), "pooled": pooled}


def _p_unpinned(model: Mapping[str, float], resched: float, leave_share: float) -> float:
    """Chance that a thread free to move stays inside its CPU set for `resched` reschedules, when a
    move leaves the set with probability leave_share: E[(1 - leave_share p)^r] for p ~ Beta(a, b)."""
    a, b = model["a"], model["b"]
    r = resched * leave_share
    if a > 0 and b > 0:
        return float(np.exp(lgamma(a + b) - lgamma(b) + lgamma(b + r) - lgamma(a + b + r)))
    return float((1.0 - model["pooled"] * leave_share) ** resched)


def _runs(ev: np.ndarray, tid: np.ndarray, cpu: np.ndarray, comm: np.ndarray, switch: int) -> tuple[np.ndarray, ...]:
    """A thread's stays on one CPU, cut where it moves or is switched out: (tid, comm, cpu, moved)
    per run, moved = 1 when it left the CPU of its previous run, 0 when it came back to it, -1 for
    the thread's first run."""
    idx = np.flatnonzero((tid >= 0) & (cpu >= 0))
    rp = _prev_in_group(tid[idx], np.ones(len(idx), bool))
    pidx = idx[np.maximum(rp, 0)]
    start = (rp < 0) | (cpu[pidx] != cpu[idx]) | (ev[pidx] == switch)
    s = idx[start]
    first = rp[start] < 0
    moved = np.where(first, -1, (cpu[pidx[start]] != cpu[s]).astype(np.int64))
    return tid[s], comm[s], cpu[s], moved


def _missing(n: np.ndarray, n1: np.ndarray) -> np.ndarray:
    return (n1 + 1.0) / (n + 1.0)


def _graph(keys: np.ndarray, names: list[str], p: Mapping[str, Any]) -> dict[str, Any]:
    V = len(names)
    uniq, cnt = np.unique(keys, return_counts=True)
    prev, nxt = uniq // V, uniq % V
    n = np.bincount(prev, weights=cnt, minlength=V)
    n1 = np.bincount(prev, weights=(cnt == 1), minlength=V)
    mm = _missing(n, n1)
    out: dict[str, Any] = {}
    for a in np.unique(prev):
        sel = prev == a
        out[names[a]] = {
            "n": int(n[a]),
            "n1": int(n1[a]),
            "missing_mass": round(float(mm[a]), 6),
            "supported": bool(n[a] >= p["min_support"] and mm[a] <= p["max_missing_mass"]),
            "next": {names[b]: int(c) for b, c in zip(nxt[sel], cnt[sel], strict=True)},
        }
    return out


def _bounds(x: np.ndarray, p: Mapping[str, Any]) -> dict[str, Any]:
    q = float(p["dt_quantile"])
    qs = np.quantile(x, [0.0, q, 0.5, 1 - q, 1.0])
    lo = min(int(np.floor(qs[1] / p["dt_margin"])), int(qs[0]))
    hi = max(int(np.ceil(qs[3] * p["dt_margin"])), int(qs[4]))
    return {
        "n": int(len(x)),
        "min": int(qs[0]),
        "q_lo": int(qs[1]),
        "median": int(qs[2]),
        "q_hi": int(qs[3]),
        "max": int(qs[4]),
        "lo": max(0, lo),
        "hi": hi,
    }


def _dt(dt: np.ndarray, pairs: np.ndarray, names: list[str], p: Mapping[str, Any]) -> dict[str, Any]:
    V = len(names)
    ev = pairs % V
    order = np.argsort(ev, kind="stable")
    ev_s, dt_s = ev[order], dt[order]
    cuts = np.flatnonzero(np.diff(ev_s)) + 1
    per_event: dict[str, Any] = {}
    bounds_of: dict[int, tuple[int, int]] = {}
    for grp_ev, grp in zip(np.split(ev_s, cuts), np.split(dt_s, cuts), strict=True):
        if not len(grp):
            continue
        b = _bounds(grp, p)
        b["supported"] = bool(b["n"] >= p["dt_min_support"])
        per_event[names[grp_ev[0]]] = b
        if b["supported"]:
            bounds_of[int(grp_ev[0])] = (b["lo"], b["hi"])
    uniq, cnt = np.unique(pairs, return_counts=True)
    big = uniq[cnt >= p["dt_transition_min_support"]]
    per_pair: dict[str, Any] = {}
    if len(big):
        sel = np.isin(pairs, big)
        ps, ds = pairs[sel], dt[sel]
        order = np.argsort(ps, kind="stable")
        ps, ds = ps[order], ds[order]
        cuts = np.flatnonzero(np.diff(ps)) + 1
        for grp_p, grp in zip(np.split(ps, cuts), np.split(ds, cuts), strict=True):
            a, b_ = int(grp_p[0]) // V, int(grp_p[0]) % V
            b = _bounds(grp, p)
            # keep the pair's bounds inside its event's, so the two always intersect
            elo, ehi = bounds_of.get(b_, (0, np.iinfo(np.int64).max))
            b["lo"], b["hi"] = max(b["lo"], elo), min(b["hi"], ehi)
            b["supported"] = True  # it has dt_transition_min_support gaps
            b["valid"] = bool(b["lo"] <= b["hi"] and (b["lo"] > elo or b["hi"] < ehi))  # narrower than its event's
            per_pair[f"{names[a]} -> {names[b_]}"] = b
    return {"event": per_event, "transition": per_pair}


def _ret(all_ev: np.ndarray, ev: np.ndarray, sym: np.ndarray, names: list[str], p: Mapping[str, Any]) -> dict:
    V = len(names)
    total = np.bincount(all_ev, minlength=V)
    present = np.bincount(ev, minlength=V)
    out: dict[str, Any] = {}
    key_ev = np.unique(np.stack([ev, sym], axis=1), axis=0, return_counts=True) if len(ev) else (np.zeros((0, 2)), [])
    pairs, counts = key_ev
    by_ev: dict[int, dict[int, int]] = {}
    for (e, s), c in zip(pairs.tolist(), list(counts), strict=True):
        by_ev.setdefault(int(e), {})[int(s)] = int(c)
    for e in range(V):
        if total[e] == 0:
            continue
        n, npres = int(total[e]), int(present[e])
        presence = "free"
        if n >= p["min_support"] and npres == n:
            presence = "present"
        elif n >= p["min_support"] and npres == 0:
            presence = "null"
        syms = by_ev.get(e, {})
        allowed = set(syms)
        # log2 buckets: fill the range seen and widen it by one bucket each side; 0 is the bucket
        # below [1, 2), so a call seen returning small positive counts may also return 0
        for sign in (1, -1):
            ks = [abs(s) - _POS_BASE for s in syms if (s >= _POS_BASE if sign > 0 else s <= -_POS_BASE)]
            if ks:
                lo, hi = min(ks) - 1, min(62, max(ks) + 1)
                allowed |= {sign * (_POS_BASE + k) for k in range(max(0, lo), hi + 1)}
                if sign > 0 and lo < 0:
                    allowed.add(0)
        n1 = sum(1 for c in syms.values() if c == 1)
        mm = float(_missing(np.array(npres), np.array(n1)))
        out[names[e]] = {
            "n": n,
            "n_present": npres,
            "presence": presence,
            "n1": n1,
            "missing_mass": round(mm, 6),
            "supported": bool(npres >= p["min_support"] and mm <= p["max_missing_mass"]),
            "symbols": {symbol_name(s): c for s, c in sorted(syms.items())},
            "allowed": [symbol_name(s) for s in sorted(allowed)],
        }
    return out


def _sets(ctx: np.ndarray, val: np.ndarray, names: list[str], vals: list[str], p: Mapping[str, Any], key: str) -> dict:
    out: dict[str, Any] = {}
    if not len(ctx):
        return out
    W = max(1, len(vals))
    uniq, cnt = np.unique(ctx * W + val, return_counts=True)
    c_of, v_of = uniq // W, uniq % W
    for c in np.unique(c_of):
        sel = c_of == c
        n, n1 = int(cnt[sel].sum()), int((cnt[sel] == 1).sum())
        mm = float(_missing(np.array(n), np.array(n1)))
        out[names[c]] = {
            "n": n,
            "n1": n1,
            "missing_mass": round(mm, 6),
            "supported": bool(n >= p["min_support"] and mm <= p["max_missing_mass"]),
            key: {vals[v]: int(k) for v, k in zip(v_of[sel], cnt[sel], strict=True)},
        }
    return out


def _cpu_sets(
    ctx: np.ndarray,
    cpu: np.ndarray,
    moved: np.ndarray,
    vals: list[str] | None,
    n_cpus: int,
    stay: Mapping[str, float],
    p: Mapping[str, Any],
) -> dict:
    """CPU set of each command / thread from its runs; supported where staying inside it that long
    would be improbable for a thread the scheduler may move (the data shows pinning)."""
    out: dict[str, Any] = {}
    if not len(ctx):
        return out
    uniq_ctx, inv = np.unique(ctx, return_inverse=True)
    resched = np.bincount(inv, weights=(moved >= 0), minlength=len(uniq_ctx))
    W = max(1, n_cpus)
    uniq, cnt = np.unique(inv * W + cpu, return_counts=True)
    c_of, cpu_of = uniq // W, uniq % W
    for c in np.unique(c_of):
        sel = c_of == c
        s = int(sel.sum())
        p_unpinned = _p_unpinned(stay, float(resched[c]), (n_cpus - s) / (n_cpus - 1)) if n_cpus > 1 else 1.0
        name = vals[uniq_ctx[c]] if vals is not None else str(int(uniq_ctx[c]))
        out[name] = {
            "runs": {str(int(k)): int(v) for k, v in zip(cpu_of[sel], cnt[sel], strict=True)},
            "n": int(cnt[sel].sum()),
            "reschedules": int(resched[c]),
            "p_unpinned": float(f"{p_unpinned:.3g}"),
            "supported": bool(s < n_cpus and p_unpinned < p["pin_alpha"]),
        }
    return out


def _invariants(traces: Sequence[Trace], doc: dict[str, Any], names: list[str], p: Mapping[str, Any]) -> dict:
    """The invariants' data-decided details, and how often training data broke each of them."""
    inv: dict[str, Any] = {
        "syscall_pairing": {"unpaired_calls": _unpaired_calls(traces, names, p)},
        "sched_consistency": {"convention": "prev"},
        "one_cpu": {"exempt_tids": []},
        "monotonic_time": {},
        "ret_errno": {},
    }
    doc["invariants"] = inv

    def run(rule: str) -> list[tuple[TraceArrays, Any]]:
        rules = Rules(doc)
        out = []
        for t in traces:
            a = TraceArrays(t, rules)
            out.append((a, DETECTORS[rule](a)))
        return out

    if SCHED_SWITCH in names:
        scores = {}
        for conv in ("prev", "next"):
            inv["sched_consistency"]["convention"] = conv
            scores[conv] = sum(len(f.idx) for _, f in run("sched.consistency"))
        inv["sched_consistency"]["convention"] = min(scores, key=lambda k: (scores[k], k != "prev"))
        inv["sched_consistency"]["violations_by_convention"] = scores
        # besides the idle task, threads a reader shows current on several CPUs at once are exempt
        bad_by_tid: Counter[int] = Counter()
        events_by_tid: Counter[int] = Counter()
        for a, f in run("sched.one_cpu"):
            bad_by_tid.update(a.tid[f.idx].tolist())
            u, c = np.unique(a.tid[a.tid >= 0], return_counts=True)
            events_by_tid.update(dict(zip(u.tolist(), c.tolist(), strict=True)))
        inv["one_cpu"]["exempt_tids"] = sorted(
            t for t, b in bad_by_tid.items() if b > max(1.0, p["max_fp_rate"] * events_by_tid[t])
        )
    for rule, key in INVARIANTS.items():
        found = run(rule)
        inv[key]["training_violations"] = int(sum(len(f.idx) for _, f in found))
        inv[key]["training_applies"] = int(sum(len(rule_contexts(a, rule)[0]) for a, _ in found))
        inv[key]["enforced"] = True  # a kernel fact: never mined away
    return inv


def _unpaired_calls(traces: Sequence[Trace], names: list[str], p: Mapping[str, Any]) -> list[str]:
    """Syscalls that never return: no exit seen, or their entry is rarely closed by their exit."""
    closed, opened = Counter(), Counter()
    exits = {n[len(SYSCALL_EXIT) :] for n in names if n.startswith(SYSCALL_EXIT)}
    for t in traces:
        codes, vocab = t.codes("event")
        tid = t.numeric("tid", -1)
        is_sys = np.array([n.startswith((SYSCALL_ENTRY, SYSCALL_EXIT)) for n in vocab] or [False])[codes]
        idx = np.flatnonzero(is_sys & (tid >= 0))
        prev = _prev_in_group(tid[idx], np.ones(len(idx), bool))
        has = prev >= 0
        pv, cur = codes[idx[prev[has]]], codes[idx[has]]
        for (a, b), c in Counter(zip(pv.tolist(), cur.tolist(), strict=True)).items():
            na, nb = vocab[a], vocab[b]
            if na.startswith(SYSCALL_ENTRY):
                call = na[len(SYSCALL_ENTRY) :]
                opened[call] += c
                if nb == SYSCALL_EXIT + call:
                    closed[call] += c
    entries = {n[len(SYSCALL_ENTRY) :] for n in names if n.startswith(SYSCALL_ENTRY)}
    return sorted(
        c for c in entries if c not in exits or (opened[c] and closed[c] / opened[c] < p["unpaired_min_closed"])
    )
