"""Mine constraints from real traces (nothing hand-written: every rule and its bounds come from data).

What generalises (held-out real data must pass almost cleanly) decides when a rule is enforced:

* **Sets** (successors of an event type, return-value symbols of a type, commands issuing a type,
  CPUs of a command or thread) are enforced only where the data has seen enough of the context
  to be confident that what was never seen is really impossible. The test is the Good-Turing
  estimate of the probability mass of unseen values, smoothed by one:
  ``missing_mass = (n1 + 1) / (n + 1)`` where n is the context's observations and n1 the number of
  values seen exactly once. A set is enforced when n >= min_support and missing_mass <= the
  threshold; the others stay in the document (with their counts) but are not checked.
* **Time bounds** on the gap before an event (per type, and per (previous, event) transition
  with more support) cover every gap seen in training, widened in log space to ``[q_lo / margin,
  q_hi * margin]`` where q_lo, q_hi are the dt_quantile tails.
* **Return values** are symbols: 0, each errno exactly (-4095..-1) and other values by log2
  bucket ([2^k, 2^(k+1))); the allowed set also fills the gaps between the smallest and largest
  bucket seen, so a read of 3000 bytes is fine when 2000 and 5000 were seen.
* **Invariants** (syscall entry/exit pairing per thread, one thread per CPU between two
  sched_switch, a thread current on one CPU at a time, non-decreasing time) are checked on the
  training data itself with the same detectors the checker uses; an invariant is enforced when it
  holds for all but invariant_max_violation of the events it applies to. The data also decides
  the details: which syscalls never return (exit_group), whether the reader puts a sched_switch
  on the outgoing or the incoming thread, which threads (idle, tid 0) are current on many CPUs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np

from tracesynth.constraints.rules import (
    _POS_BASE,
    FORMAT,
    SCHED_SWITCH,
    SYSCALL_ENTRY,
    SYSCALL_EXIT,
    VERSION,
    Rules,
    ret_symbols,
    symbol_name,
)
from tracesynth.errors import TraceSynthError
from tracesynth.trace import Trace

DEFAULT_PARAMS: dict[str, Any] = {
    "min_support": 50,  # observations of a context before its set is enforced
    "max_missing_mass": 0.01,  # Good-Turing (n1+1)/(n+1) above this: the set stays open
    "dt_min_support": 50,  # gaps of an event type before its time bounds are enforced
    "dt_transition_min_support": 500,  # gaps of a (previous, event) pair for its own bounds
    "dt_quantile": 0.001,  # tails used for the bounds (then widened by dt_margin)
    "dt_margin": 4.0,  # bounds are [q_lo / margin, q_hi * margin], always covering what was seen
    "cpu_min_runs": 20,  # runs (stays on one CPU) of a command / thread before its CPU set is enforced
    "cpu_max_missing_mass": 0.05,
    "invariant_max_violation": 0.002,  # an invariant is enforced when it holds this well in training
    "unpaired_min_closed": 0.5,  # a syscall whose entries are closed by its exit less often never returns
}


def _fmt_int(x: float) -> int:
    return int(x)


def mine_rules(traces: Sequence[Trace], params: Mapping[str, Any] | None = None) -> Rules:
    """Learn Rules from real traces (each trace is one contiguous recording)."""
    p = dict(DEFAULT_PARAMS)
    p.update(params or {})
    traces = [t for t in traces if len(t)]
    if not traces:
        raise TraceSynthError("no events to mine rules from")

    # one vocabulary over all traces
    names = sorted({n for t in traces for n in t.codes("event")[1]})
    comms = sorted({n for t in traces for n in t.codes("comm")[1]})
    V = len(names)
    index = {n: i for i, n in enumerate(names)}
    cindex = {n: i for i, n in enumerate(comms)}

    g_keys, t_keys, dts, dt_pairs, ret_ev, ret_sym, ret_all_ev, comm_ev = [], [], [], [], [], [], [], []
    comm_codes_all, run_tid, run_comm, run_cpu, tid_all = [], [], [], [], []
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
        ts = t.ts.astype(np.int64)
        n_cpus = max(n_cpus, int(cpu.max()) + 1 if len(cpu) else 0)

        g_keys.append(ev[:-1] * V + ev[1:])
        prev = _prev_in_group(tid, tid >= 0)
        has = np.flatnonzero(prev >= 0)
        t_keys.append(ev[prev[has]] * V + ev[has])
        dts.append(np.diff(ts))
        dt_pairs.append(ev[:-1] * V + ev[1:])
        ret_all_ev.append(ev)
        ret_ev.append(ev[ret_valid])
        ret_sym.append(ret_symbols(ret[ret_valid]))
        # CPU runs: a thread's stays on one CPU, cut where it moves or is switched out
        m = (tid >= 0) & (cpu >= 0)
        idx = np.flatnonzero(m)
        rp = _prev_in_group(tid[idx], np.ones(len(idx), bool))
        switch = index.get(SCHED_SWITCH, -1)
        pidx = idx[np.maximum(rp, 0)]
        start = (rp < 0) | (cpu[pidx] != cpu[idx]) | (ev[pidx] == switch)
        s = idx[start]
        run_tid.append(tid[s])
        run_comm.append(comm[s])
        run_cpu.append(cpu[s])
        # the run each event belongs to (the index of the run's first event); events come in
        # bursts, so value sets count distinct runs, not events, as their observations
        unit = np.arange(len(ev), dtype=np.int64)
        if len(idx):
            order = np.argsort(tid[idx], kind="stable")
            first = np.maximum.accumulate(np.where(start[order], np.arange(len(order)), 0))
            unit[idx[order]] = idx[order][first]
        no_cpu = (tid >= 0) & (cpu < 0)
        unit[no_cpu] = -1 - tid[no_cpu]  # without CPUs a thread is one unit
        cm = comm >= 0
        u, keep = np.unique(np.stack([ev[cm], comm[cm], unit[cm]], axis=1), axis=0, return_index=True)
        del keep
        comm_ev.append(u[:, 0])
        comm_codes_all.append(u[:, 1])
        tid_all.append(tid)

    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "params": p,
        "source": {
            "traces": len(traces),
            "events": int(sum(len(t) for t in traces)),
            "workloads": sorted({str(t.metadata.get("workload", "")) for t in traces} - {""}),
            "mined_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
        "events": names,
        "comms": comms,
    }
    doc["transitions"] = {
        "global": _graph(np.concatenate(g_keys), names, p),
        "thread": _graph(np.concatenate(t_keys), names, p),
    }
    doc["dt"] = _dt(np.concatenate(dts), np.concatenate(dt_pairs), names, p)
    doc["values"] = {
        "ret": _ret(np.concatenate(ret_all_ev), np.concatenate(ret_ev), np.concatenate(ret_sym), names, p),
        "comm": _sets(np.concatenate(comm_ev), np.concatenate(comm_codes_all), names, comms, p, "counts"),
    }
    rt, rc, rcpu = np.concatenate(run_tid), np.concatenate(run_comm), np.concatenate(run_cpu)
    doc["cpu"] = {
        "n_cpus": n_cpus,
        "comm": _cpu_sets(rc[rc >= 0], rcpu[rc >= 0], comms, n_cpus, p),
        "tid": _cpu_sets(rt, rcpu, None, n_cpus, p),
    }
    doc["invariants"] = _invariants(traces, doc, names, p)
    return Rules(doc)


def _prev_in_group(keys: np.ndarray, valid: np.ndarray) -> np.ndarray:
    from tracesynth.constraints.check import _prev_in_group as impl

    return impl(keys, valid)


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
            "enforced": bool(n[a] >= p["min_support"] and mm[a] <= p["max_missing_mass"]),
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
        b["enforced"] = bool(b["n"] >= p["dt_min_support"])
        per_event[names[grp_ev[0]]] = b
        if b["enforced"]:
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
            b["enforced"] = bool(b["lo"] <= b["hi"] and (b["lo"] > elo or b["hi"] < ehi))
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
            "enforced": bool(npres >= p["min_support"] and mm <= p["max_missing_mass"]),
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
            "enforced": bool(n >= p["min_support"] and mm <= p["max_missing_mass"]),
            key: {vals[v]: int(k) for v, k in zip(v_of[sel], cnt[sel], strict=True)},
        }
    return out


def _cpu_sets(ctx: np.ndarray, cpu: np.ndarray, vals: list[str] | None, n_cpus: int, p: Mapping[str, Any]) -> dict:
    out: dict[str, Any] = {}
    if not len(ctx):
        return out
    uniq_ctx, inv = np.unique(ctx, return_inverse=True)
    W = max(1, n_cpus)
    uniq, cnt = np.unique(inv * W + cpu, return_counts=True)
    c_of, cpu_of = uniq // W, uniq % W
    for c in np.unique(c_of):
        sel = c_of == c
        runs, n1 = int(cnt[sel].sum()), int((cnt[sel] == 1).sum())
        mm = float(_missing(np.array(runs), np.array(n1)))
        name = vals[uniq_ctx[c]] if vals is not None else str(int(uniq_ctx[c]))
        out[name] = {
            "runs": {str(int(k)): int(v) for k, v in zip(cpu_of[sel], cnt[sel], strict=True)},
            "n": runs,
            "n1": n1,
            "missing_mass": round(mm, 6),
            "enforced": bool(runs >= p["cpu_min_runs"] and mm <= p["cpu_max_missing_mass"] and int(sel.sum()) < n_cpus),
        }
    return out


def _invariants(traces: Sequence[Trace], doc: dict[str, Any], names: list[str], p: Mapping[str, Any]) -> dict:
    """Check each structural invariant on the training data itself with the checker's detectors."""
    from tracesynth.constraints.check import DETECTORS, TraceArrays

    eps = float(p["invariant_max_violation"])
    # syscalls that never return (their entry is rarely closed by their exit on the thread)
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
    unpaired = sorted(
        c for c in entries if c not in exits or (opened[c] and closed[c] / opened[c] < p["unpaired_min_closed"])
    )
    inv: dict[str, Any] = {
        "syscall_pairing": {"unpaired_calls": unpaired, "enforced": True},
        "sched_consistency": {"convention": "prev", "enforced": True},
        "one_cpu": {"exempt_tids": [], "enforced": True},
        "monotonic_time": {"enforced": True},
    }
    doc["invariants"] = inv

    def run(rule: str) -> tuple[int, int, list[Any]]:
        rules = Rules(doc)
        bad, applies, per = 0, 0, []
        for t in traces:
            a = TraceArrays(t, rules)
            f = DETECTORS[rule](a)
            bad += len(f.idx)
            per.append((a, f))
            if rule == "syscall.pairing":
                applies += int(((a.c.is_entry | a.c.is_exit)[a.ev] & (a.tid >= 0)).sum())
            elif rule == "sched.consistency":
                applies += int(((a.cpu >= 0) & (a.tid >= 0)).sum())
            elif rule == "sched.one_cpu":
                prev = a.thread_prev
                i = np.flatnonzero(prev >= 0)
                applies += int(((a.cpu[i] >= 0) & (a.cpu[prev[i]] >= 0) & (a.cpu[i] != a.cpu[prev[i]])).sum())
            else:
                applies += a.n
        return bad, applies, per

    def settle(name: str, rule: str) -> None:
        bad, applies, _ = run(rule)
        inv[name].update(
            violations=bad,
            applies_to=applies,
            enforced=bool(bad <= eps * applies),  # vacuous where it never applied
        )

    settle("syscall_pairing", "syscall.pairing")
    has_switch = SCHED_SWITCH in names
    if has_switch:
        scores = {}
        for conv in ("prev", "next"):
            inv["sched_consistency"]["convention"] = conv
            scores[conv] = run("sched.consistency")[0]
        inv["sched_consistency"]["convention"] = min(scores, key=lambda k: (scores[k], k != "prev"))
        inv["sched_consistency"]["violations_by_convention"] = scores
        settle("sched_consistency", "sched.consistency")
        # threads current on several CPUs at once in real data (the per-CPU idle threads) are exempt
        _, _, per = run("sched.one_cpu")
        bad_by_tid: Counter[int] = Counter()
        events_by_tid: Counter[int] = Counter()
        for a, f in per:
            bad_by_tid.update(a.tid[f.idx].tolist())
            u, c = np.unique(a.tid[a.tid >= 0], return_counts=True)
            events_by_tid.update(dict(zip(u.tolist(), c.tolist(), strict=True)))
        inv["one_cpu"]["exempt_tids"] = sorted(t for t, b in bad_by_tid.items() if b > max(1.0, eps * events_by_tid[t]))
        settle("one_cpu", "sched.one_cpu")
    else:
        for name in ("sched_consistency", "one_cpu"):
            inv[name].update(violations=0, applies_to=0, enforced=False)
    settle("monotonic_time", "time.monotonic")
    return inv
