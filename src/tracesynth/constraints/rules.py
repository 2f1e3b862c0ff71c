"""The Rules document: constraints mined from real traces, as one readable, diffable JSON file.

Every rule keeps the counts it was mined from, so a reader can see why a rule is enforced (or
why it was left open). The document is plain data; `compile_rules` turns it into numpy arrays
aligned to one trace's vocabulary for the vectorised checker and the repairer.

Layout (keys sorted on save):

    format, version, params           the support thresholds used when mining (see mine.py)
    source                            how many traces / events it was mined from, and their workloads
    events, comms                     the vocabularies the rules speak about
    transitions.global / .thread      per predecessor: n, n1 (successors seen once), missing_mass,
                                      enforced, next {successor: count}
    dt.event / dt.transition          gap to the previous event (ns): n, quantiles, lo, hi, enforced
    cpu.comm / cpu.tid                per command / thread: runs per CPU, missing_mass, enforced
    values.ret / values.comm          per event type: symbol counts, allowed set, enforced
    invariants                        syscall_pairing, sched_consistency, one_cpu, monotonic_time
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from atomicio import atomic_path
from tracesynth.errors import TraceSynthError

FORMAT = "tracesynth-rules"
VERSION = 1

# Event naming shared by every reader (lttng-modules names; perf and strace map onto them).
SYSCALL_ENTRY = "syscall_entry_"
SYSCALL_EXIT = "syscall_exit_"
SCHED_SWITCH = "sched_switch"

# Return-value symbols: 0, each errno exactly (-4095..-1), other values by log2 magnitude.
MAX_ERRNO = 4095
_POS_BASE = 5000  # symbol code of bucket k for positive values is _POS_BASE + k, [2^k, 2^(k+1))


def ret_symbols(ret: np.ndarray) -> np.ndarray:
    """Integer symbol per return value: 0, the errno itself, or +-(_POS_BASE + log2 bucket)."""
    ret = np.asarray(ret, dtype=np.int64)
    out = ret.copy()
    mag = np.abs(ret.astype(np.float64))
    k = np.floor(np.log2(np.maximum(mag, 1.0))).astype(np.int64)
    pos = ret > 0
    out[pos] = _POS_BASE + k[pos]
    big_neg = ret < -MAX_ERRNO
    out[big_neg] = -(_POS_BASE + k[big_neg])
    return out


def symbol_name(sym: int) -> str:
    """Readable name of a return-value symbol: '0', '-11', '2^5' ([32, 64)), '-2^40'."""
    if sym >= _POS_BASE:
        return f"2^{sym - _POS_BASE}"
    if sym <= -_POS_BASE:
        return f"-2^{-sym - _POS_BASE}"
    return str(sym)


def symbol_from_name(name: str) -> int:
    if name.startswith("-2^"):
        return -(_POS_BASE + int(name[3:]))
    if name.startswith("2^"):
        return _POS_BASE + int(name[2:])
    return int(name)


def sample_ret(symbols: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A concrete return value for each symbol (uniform inside a log2 bucket)."""
    symbols = np.asarray(symbols, dtype=np.int64)
    out = symbols.copy()
    for sign, mask in ((1, symbols >= _POS_BASE), (-1, symbols <= -_POS_BASE)):
        if mask.any():
            k = np.minimum(np.abs(symbols[mask]) - _POS_BASE, 62)
            base = np.left_shift(np.int64(1), k)
            out[mask] = sign * (base + (rng.random(int(mask.sum())) * base).astype(np.int64))
    return out


@dataclass
class Rules:
    """Mined constraints. `doc` is the JSON document; everything else is derived from it."""

    doc: dict[str, Any]
    path: str | None = field(default=None, compare=False)

    # -- storage --------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the document as sorted, indented JSON, atomically."""
        path = Path(path)
        text = json.dumps(self.doc, sort_keys=True, indent=1, allow_nan=False) + "\n"
        with atomic_path(path) as tmp:
            tmp.write_text(text)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Rules:
        """Read a document written by save(); any problem is one TraceSynthError naming the file."""
        path = Path(path)
        if not path.is_file():
            raise TraceSynthError("no such file" if not path.exists() else "not a file", path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise TraceSynthError(f"cannot read rules ({exc})", path) from None
        except ValueError as exc:
            raise TraceSynthError(f"not a JSON document ({exc})", path) from None
        problem = _validate_doc(doc)
        if problem:
            raise TraceSynthError(f"not a tracesynth rules document ({problem})", path)
        return cls(doc, str(path))

    # -- summary --------------------------------------------------------------------------------
    @property
    def params(self) -> dict[str, Any]:
        return self.doc["params"]

    def summary(self) -> dict[str, int]:
        """How many rules of each kind are enforced."""
        d = self.doc
        out = {
            "transition.global": sum(v["enforced"] for v in d["transitions"]["global"].values()),
            "transition.thread": sum(v["enforced"] for v in d["transitions"]["thread"].values()),
            "dt.event": sum(v["enforced"] for v in d["dt"]["event"].values()),
            "dt.transition": sum(v["enforced"] for v in d["dt"]["transition"].values()),
            "cpu.comm": sum(v["enforced"] for v in d["cpu"]["comm"].values()),
            "cpu.tid": sum(v["enforced"] for v in d["cpu"]["tid"].values()),
            "ret.value": sum(v["enforced"] for v in d["values"]["ret"].values()),
            "comm.value": sum(v["enforced"] for v in d["values"]["comm"].values()),
        }
        for name, inv in d["invariants"].items():
            out[f"invariant.{name}"] = int(inv["enforced"])
        return out

    def __repr__(self) -> str:
        s = self.summary()
        return f"Rules({sum(s.values())} enforced over {len(self.doc['events'])} event types)"


_REQUIRED = {
    "transitions": ("global", "thread"),
    "dt": ("event", "transition"),
    "cpu": ("comm", "tid"),
    "values": ("ret", "comm"),
    "invariants": ("syscall_pairing", "sched_consistency", "one_cpu", "monotonic_time"),
}


def _validate_doc(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return "top level is not an object"
    if doc.get("format") != FORMAT:
        return f"format is {doc.get('format')!r}, expected {FORMAT!r}"
    if doc.get("version") != VERSION:
        return f"version {doc.get('version')!r} is not supported (expected {VERSION})"
    for key in ("params", "source", "events", "comms"):
        if key not in doc:
            return f"missing key {key!r}"
    for key, subs in _REQUIRED.items():
        if not isinstance(doc.get(key), dict):
            return f"missing section {key!r}"
        for sub in subs:
            if not isinstance(doc[key].get(sub), dict):
                return f"missing section {key}.{sub}"
    events = set(doc["events"])
    for prev, entry in doc["transitions"]["global"].items():
        if prev not in events or not set(entry.get("next", {})) <= events:
            return f"transitions.global mentions an event type not in 'events' (near {prev!r})"
    return None


# -- compiled form ------------------------------------------------------------------------------


@dataclass
class Compiled:
    """Numpy arrays of the rules over an extended vocabulary: rule events first, then the trace's
    own unknown names (which no rule allows and no rule is conditioned on)."""

    names: list[str]  # event vocabulary (rules' events + unknown ones)
    n_known: int
    comms: list[str]
    n_known_comms: int
    # transitions
    g_allowed: np.ndarray  # [V, V] bool
    g_enforced: np.ndarray  # [V] bool
    g_weight: np.ndarray  # [V, V] float (counts, for sampling)
    t_allowed: np.ndarray
    t_enforced: np.ndarray
    t_weight: np.ndarray
    # dt
    dt_lo: np.ndarray  # [V] int64 (0 where open)
    dt_hi: np.ndarray  # [V] int64 (int64 max where open)
    dtt_keys: np.ndarray  # sorted prev*V+cur keys of transition bounds
    dtt_lo: np.ndarray
    dtt_hi: np.ndarray
    # return values
    ret_presence: np.ndarray  # [V] int8: 0 free, 1 must be present, 2 must be null
    ret_enforced: np.ndarray  # [V] bool
    ret_allowed_keys: np.ndarray  # sorted event*_SYMSPAN + sym+_SYMOFF
    ret_sym_table: list[tuple[np.ndarray, np.ndarray]]  # per event: (symbols, probabilities)
    # comm values
    comm_allowed: np.ndarray  # [V, C] bool
    comm_enforced: np.ndarray  # [V] bool
    comm_weight: np.ndarray  # [V, C]
    # cpu affinity
    n_cpus: int
    cpu_comm_allowed: np.ndarray  # [C, n_cpus] bool
    cpu_comm_enforced: np.ndarray  # [C] bool
    cpu_comm_weight: np.ndarray
    cpu_tids: np.ndarray  # sorted tids with an enforced rule
    cpu_tid_allowed: np.ndarray  # [len(cpu_tids), n_cpus] bool
    cpu_tid_weight: np.ndarray
    # invariants
    is_entry: np.ndarray  # [V] bool (paired syscall entries only)
    is_exit: np.ndarray
    call_of: np.ndarray  # [V] int call id (-1 for non-syscalls); entry and exit of X share it
    entry_of_call: np.ndarray  # [n_calls] event code of the entry
    exit_of_call: np.ndarray
    switch_code: int  # -1 when the rules know no sched_switch
    pairing: bool
    sched: bool
    sched_convention: str  # "prev": a switch closes its segment; "next": it opens one
    one_cpu: bool
    one_cpu_exempt: np.ndarray  # sorted tids
    monotonic: bool


_SYMOFF = 8192
_SYMSPAN = 16384


def ret_keys(ev: np.ndarray, sym: np.ndarray) -> np.ndarray:
    return ev.astype(np.int64) * _SYMSPAN + (sym + _SYMOFF)


def _extend_vocab(known: list[str], extra: list[str]) -> tuple[list[str], dict[str, int]]:
    """The rules' names followed by the trace's unseen ones, and each name's index."""
    names = list(known)
    index = {n: i for i, n in enumerate(names)}
    for n in extra:
        if n not in index:
            index[n] = len(names)
            names.append(n)
    return names, index


def compile_rules(rules: Rules, trace_events: list[str], trace_comms: list[str]) -> Compiled:
    """Arrays of the rules, over the rules' vocabulary extended by the trace's unknown names."""
    d = rules.doc
    names, index = _extend_vocab(d["events"], trace_events)
    n_known = len(d["events"])
    V = len(names)
    comms, cindex = _extend_vocab(d["comms"], trace_comms)
    n_known_comms = len(d["comms"])
    C = max(1, len(comms))

    def graph(section: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        allowed = np.zeros((V, V), dtype=bool)
        weight = np.zeros((V, V), dtype=np.float64)
        enforced = np.zeros(V, dtype=bool)
        for prev, e in section.items():
            p = index[prev]
            enforced[p] = bool(e["enforced"])
            for nxt, cnt in e["next"].items():
                allowed[p, index[nxt]] = True
                weight[p, index[nxt]] = cnt
        return allowed, enforced, weight

    g_allowed, g_enforced, g_weight = graph(d["transitions"]["global"])
    t_allowed, t_enforced, t_weight = graph(d["transitions"]["thread"])

    big = np.iinfo(np.int64).max
    dt_lo = np.zeros(V, dtype=np.int64)
    dt_hi = np.full(V, big, dtype=np.int64)
    for name, e in d["dt"]["event"].items():
        if e["enforced"]:
            dt_lo[index[name]] = e["lo"]
            dt_hi[index[name]] = e["hi"]
    keys, lo, hi = [], [], []
    for pair, e in d["dt"]["transition"].items():
        if e["enforced"]:
            a, b = pair.split(" -> ")
            keys.append(index[a] * V + index[b])
            lo.append(e["lo"])
            hi.append(e["hi"])
    order = np.argsort(np.asarray(keys, dtype=np.int64), kind="stable")
    dtt_keys = np.asarray(keys, dtype=np.int64)[order]
    dtt_lo = np.asarray(lo, dtype=np.int64)[order]
    dtt_hi = np.asarray(hi, dtype=np.int64)[order]

    ret_presence = np.zeros(V, dtype=np.int8)
    ret_enforced = np.zeros(V, dtype=bool)
    rkeys: list[int] = []
    table: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int64), np.zeros(0))] * V
    for name, e in d["values"]["ret"].items():
        i = index[name]
        ret_presence[i] = {"free": 0, "present": 1, "null": 2}[e["presence"]]
        syms = np.array([symbol_from_name(s) for s in e["symbols"]], dtype=np.int64)
        counts = np.array(list(e["symbols"].values()), dtype=np.float64)
        if len(syms):
            table[i] = (syms, counts / counts.sum())
        if e["enforced"]:
            ret_enforced[i] = True
            rkeys.extend(int(k) for k in ret_keys(np.full(len(e["allowed"]), i), _syms(e["allowed"])))
    ret_allowed_keys = np.unique(np.asarray(rkeys, dtype=np.int64))

    comm_allowed = np.zeros((V, C), dtype=bool)
    comm_weight = np.zeros((V, C))
    comm_enforced = np.zeros(V, dtype=bool)
    for name, e in d["values"]["comm"].items():
        i = index[name]
        comm_enforced[i] = bool(e["enforced"])
        for c, cnt in e["counts"].items():
            comm_allowed[i, cindex[c]] = True
            comm_weight[i, cindex[c]] = cnt

    n_cpus = int(d["cpu"].get("n_cpus", 0))
    cpu_comm_allowed = np.zeros((C, max(1, n_cpus)), dtype=bool)
    cpu_comm_weight = np.zeros((C, max(1, n_cpus)))
    cpu_comm_enforced = np.zeros(C, dtype=bool)
    for comm, e in d["cpu"]["comm"].items():
        j = cindex[comm]
        cpu_comm_enforced[j] = bool(e["enforced"])
        for c, cnt in e["runs"].items():
            cpu_comm_allowed[j, int(c)] = True
            cpu_comm_weight[j, int(c)] = cnt
    tid_items = sorted((int(t), e) for t, e in d["cpu"]["tid"].items() if e["enforced"])
    cpu_tids = np.array([t for t, _ in tid_items], dtype=np.int64)
    cpu_tid_allowed = np.zeros((len(tid_items), max(1, n_cpus)), dtype=bool)
    cpu_tid_weight = np.zeros((len(tid_items), max(1, n_cpus)))
    for r, (_, e) in enumerate(tid_items):
        for c, cnt in e["runs"].items():
            cpu_tid_allowed[r, int(c)] = True
            cpu_tid_weight[r, int(c)] = cnt

    inv = d["invariants"]
    pairing = inv["syscall_pairing"]
    unpaired = set(pairing.get("unpaired_calls", []))
    is_entry = np.zeros(V, dtype=bool)
    is_exit = np.zeros(V, dtype=bool)
    call_of = np.full(V, -1, dtype=np.int64)
    calls: dict[str, int] = {}
    for i, n in enumerate(names):
        for prefix, flag in ((SYSCALL_ENTRY, is_entry), (SYSCALL_EXIT, is_exit)):
            if n.startswith(prefix):
                call = n[len(prefix) :]
                if call in unpaired:
                    continue
                flag[i] = True
                call_of[i] = calls.setdefault(call, len(calls))
    entry_of_call = np.full(len(calls), -1, dtype=np.int64)
    exit_of_call = np.full(len(calls), -1, dtype=np.int64)
    entry_of_call[call_of[is_entry]] = np.flatnonzero(is_entry)
    exit_of_call[call_of[is_exit]] = np.flatnonzero(is_exit)
    sched = inv["sched_consistency"]
    one = inv["one_cpu"]
    return Compiled(
        names=names,
        n_known=n_known,
        comms=comms,
        n_known_comms=n_known_comms,
        g_allowed=g_allowed,
        g_enforced=g_enforced,
        g_weight=g_weight,
        t_allowed=t_allowed,
        t_enforced=t_enforced,
        t_weight=t_weight,
        dt_lo=dt_lo,
        dt_hi=dt_hi,
        dtt_keys=dtt_keys,
        dtt_lo=dtt_lo,
        dtt_hi=dtt_hi,
        ret_presence=ret_presence,
        ret_enforced=ret_enforced,
        ret_allowed_keys=ret_allowed_keys,
        ret_sym_table=table,
        comm_allowed=comm_allowed,
        comm_enforced=comm_enforced,
        comm_weight=comm_weight,
        n_cpus=n_cpus,
        cpu_comm_allowed=cpu_comm_allowed,
        cpu_comm_enforced=cpu_comm_enforced,
        cpu_comm_weight=cpu_comm_weight,
        cpu_tids=cpu_tids,
        cpu_tid_allowed=cpu_tid_allowed,
        cpu_tid_weight=cpu_tid_weight,
        is_entry=is_entry,
        is_exit=is_exit,
        call_of=call_of,
        entry_of_call=entry_of_call,
        exit_of_call=exit_of_call,
        switch_code=index.get(SCHED_SWITCH, -1) if SCHED_SWITCH in d["events"] else -1,
        pairing=bool(pairing["enforced"]),
        sched=bool(sched["enforced"]),
        sched_convention=str(sched.get("convention", "prev")),
        one_cpu=bool(one["enforced"]),
        one_cpu_exempt=np.array(sorted(int(t) for t in one.get("exempt_tids", [])), dtype=np.int64),
        monotonic=bool(inv["monotonic_time"]["enforced"]),
    )


def _syms(names: list[str]) -> np.ndarray:
    return np.array([symbol_from_name(s) for s in names], dtype=np.int64)
