"""The Rules document: constraints mined from real traces, as one readable, diffable JSON file.

Two kinds of rule, stored and reported apart:

* **invariants** hold on every correct kernel trace (per-thread syscall entry/exit pairing with
  matching names, one thread current per CPU between two sched_switch, a thread current on one
  CPU at a time, non-decreasing time, syscall errors inside the errno range). They are always
  enforced; the data only settles details (which calls never return, which thread a reader puts
  a sched_switch on) and how often they were broken in training and in the calibration blocks.
* **learned** rules (transitions, time bounds, CPU affinity, value sets) describe one workload.
  Each entry keeps the counts it was mined from and its calibration: cut in time into blocks,
  each block held out in turn and checked against the rule mined from the other blocks.

Each learned entry is in one of three states: *enforced* (flagged as a violation), *advisory*
(enough data for a set or a bound, but not confirmed in every block that exercised it: guidance
that samplers and repair may prefer, never a violation) or open (too little data). An enforced
transition is also weak where it says least: it forbids an unseen successor only where that
successor is common enough that the context would have shown it (n * share >= min_expected,
params.transition_min_expected); the unseen rare successors are advisory.

The document is plain data; `compile_rules` turns it into numpy arrays aligned to one trace's
vocabulary for the vectorised checker and the repairer (view "enforced", or "advisory").

Layout (keys sorted on save):

    format, version, params           the thresholds used when mining (see mine.py)
    source                            how many traces / events it was mined from, and their workloads
    events, comms                     the vocabularies the rules speak about
    transitions.global / .thread      per predecessor: n, n1, missing_mass, next {successor: count}
    dt.event / dt.transition          gap to the previous event (ns): n, quantiles, lo, hi
    cpu.comm / cpu.tid                per command / thread: runs per CPU, p_unpinned (pinning evidence)
    values.ret / values.comm          per event type: symbol counts, allowed set / issuing commands
    invariants                        syscall_pairing, sched_consistency, one_cpu, monotonic_time, ret_errno
    rules                             per rule: kind, enforced / advisory entries, calibration, blocks

Every learned entry also has supported (enough data), calibration {applies, violations, fp_rate,
blocks, blocks_broken} (blocks: held-out blocks that exercised it), enforced and advisory.
Version 2 documents (one later calibration block, no advisory state) still load and check as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from atomicio import atomic_path
from tracesynth.errors import TraceSynthError
from tracesynth.events import IDLE_TID, MAX_ERRNO
from tracesynth.kernel import EventTables, KernelFacts

FORMAT = "tracesynth-rules"
VERSION = 3
READABLE_VERSIONS = (2, 3)  # version 2: no advisory entries, every unseen successor judged
VIEWS = ("enforced", "advisory")

# learned rule -> its section of the document; invariant -> its key under "invariants"
LEARNED = {
    "transition.global": ("transitions", "global"),
    "transition.thread": ("transitions", "thread"),
    "dt.event": ("dt", "event"),
    "dt.transition": ("dt", "transition"),
    "cpu.comm": ("cpu", "comm"),
    "cpu.tid": ("cpu", "tid"),
    "ret.value": ("values", "ret"),
    "comm.value": ("values", "comm"),
}
INVARIANTS = {
    "syscall.pairing": "syscall_pairing",
    "sched.consistency": "sched_consistency",
    "sched.one_cpu": "one_cpu",
    "time.monotonic": "monotonic_time",
    "ret.errno": "ret_errno",
}
RULES = (*LEARNED, *INVARIANTS)


def kind_of(rule: str) -> str:
    return "invariant" if rule in INVARIANTS else "learned"


# Return-value symbols: 0, each errno exactly (-4095..-1), other values by log2 magnitude.
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

    def entries(self, rule: str) -> dict[str, Any]:
        """The entries of a learned rule (context -> entry)."""
        section, sub = LEARNED[rule]
        return self.doc[section][sub]

    def summary(self) -> dict[str, int]:
        """How many entries of each rule are enforced (an invariant counts 1)."""
        out = {r: sum(bool(e.get("enforced", False)) for e in self.entries(r).values()) for r in LEARNED}
        out.update({r: 1 for r in INVARIANTS})
        return out

    def rule_table(self) -> dict[str, dict[str, Any]]:
        """Per rule: kind, enforced entries, and the calibration (events it applied to on the
        held-out block, violations there, false-positive rate; None where nothing was calibrated)."""
        return self.doc["rules"]

    def __repr__(self) -> str:
        s = self.summary()
        return f"Rules({sum(s.values())} enforced over {len(self.doc['events'])} event types)"


_REQUIRED: dict[str, tuple[str, ...]] = {}
for _section, _sub in LEARNED.values():
    _REQUIRED.setdefault(_section, ())
    _REQUIRED[_section] += (_sub,)


def _validate_doc(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return "top level is not an object"
    if doc.get("format") != FORMAT:
        return f"format is {doc.get('format')!r}, expected {FORMAT!r}"
    if doc.get("version") not in READABLE_VERSIONS:
        return f"version {doc.get('version')!r} is not supported (expected one of {list(READABLE_VERSIONS)})"
    for key in ("params", "source", "events", "comms", "rules"):
        if key not in doc:
            return f"missing key {key!r}"
    for key, subs in _REQUIRED.items():
        if not isinstance(doc.get(key), dict):
            return f"missing section {key!r}"
        for sub in subs:
            if not isinstance(doc[key].get(sub), dict):
                return f"missing section {key}.{sub}"
    if not isinstance(doc.get("invariants"), dict) or set(INVARIANTS.values()) - set(doc["invariants"]):
        return "missing or incomplete section 'invariants'"
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
    g_forbid: np.ndarray  # [V, V] bool: what the checker flags (in this view)
    t_allowed: np.ndarray
    t_enforced: np.ndarray
    t_weight: np.ndarray
    t_forbid: np.ndarray
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
    kernel: EventTables  # the kernel's rules over this vocabulary (tracesynth.kernel)
    one_cpu_exempt: np.ndarray  # sorted tids (the idle task's 0 always)
    view: str = "enforced"  # "advisory": the *_enforced flags and forbid matrices are the advisory ones


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


def compile_rules(rules: Rules, trace_events: list[str], trace_comms: list[str], view: str = "enforced") -> Compiled:
    """Arrays of the rules, over the rules' vocabulary extended by the trace's unknown names. The
    "advisory" view holds the advisory entries where the default holds the enforced ones."""
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    d = rules.doc
    names, index = _extend_vocab(d["events"], trace_events)
    comms, cindex = _extend_vocab(d["comms"], trace_comms)
    V, C = len(names), max(1, len(comms))
    min_expected = float(d["params"].get("transition_min_expected", 0.0))  # version 2: 0, all judged
    g_allowed, g_enforced, g_weight, g_forbid = _compile_graph(d["transitions"]["global"], index, V, view, min_expected)
    t_allowed, t_enforced, t_weight, t_forbid = _compile_graph(d["transitions"]["thread"], index, V, view, min_expected)
    n_cpus = int(d["cpu"].get("n_cpus", 0))
    cpu_comm = _compile_cpu_comm(d["cpu"]["comm"], cindex, C, n_cpus, view)
    cpu_comm_allowed, cpu_comm_enforced, cpu_comm_weight = cpu_comm
    return Compiled(
        names=names,
        n_known=len(d["events"]),
        comms=comms,
        n_known_comms=len(d["comms"]),
        g_allowed=g_allowed,
        g_enforced=g_enforced,
        g_weight=g_weight,
        g_forbid=g_forbid,
        t_allowed=t_allowed,
        t_enforced=t_enforced,
        t_weight=t_weight,
        t_forbid=t_forbid,
        n_cpus=n_cpus,
        cpu_comm_allowed=cpu_comm_allowed,
        cpu_comm_enforced=cpu_comm_enforced,
        cpu_comm_weight=cpu_comm_weight,
        **_compile_dt(d["dt"], index, V, view),
        **_compile_ret(d["values"]["ret"], index, V, view),
        **_compile_comm(d["values"]["comm"], index, cindex, V, C, view),
        **_compile_cpu_tid(d["cpu"]["tid"], n_cpus, view),
        **_compile_invariants(d, names),
        view=view,
    )


def _on(e: dict[str, Any], view: str) -> bool:
    """Whether an entry takes part in this view (version 2 entries are never advisory)."""
    return bool(e.get(view, False))


def _compile_counts(
    section: dict[str, Any], rows: dict[str, int], cols: dict[str, int], key: str, shape: tuple[int, int], view: str
) -> tuple[np.ndarray, ...]:
    """A section of counted entries {row: {"enforced": .., key: {col: count}}} as (allowed, enforced, weight)."""
    allowed = np.zeros(shape, dtype=bool)
    weight = np.zeros(shape, dtype=np.float64)
    enforced = np.zeros(shape[0], dtype=bool)
    for name, e in section.items():
        r = rows[name]
        enforced[r] = _on(e, view)
        for col, cnt in e[key].items():
            allowed[r, cols[col]] = True
            weight[r, cols[col]] = cnt
    return allowed, enforced, weight


def _compile_graph(
    section: dict[str, Any], index: dict[str, int], V: int, view: str, min_expected: float
) -> tuple[np.ndarray, ...]:
    """(allowed, on, weight, forbid). An enforced predecessor forbids an unseen successor only where
    that successor is common enough (as a successor anywhere) that the predecessor's n observations
    should have shown it min_expected times; the rare unseen ones are advisory. The advisory view
    forbids what advisory predecessors never saw, and the rare unseen successors of enforced ones."""
    allowed, on, weight = _compile_counts(section, index, index, "next", (V, V), view)
    n = weight.sum(axis=1)
    share = weight.sum(axis=0) / max(1.0, float(weight.sum()))
    judged = n[:, None] * share[None, :] >= min_expected if min_expected > 0 else np.ones((V, V), dtype=bool)
    if view == "enforced":
        return allowed, on, weight, on[:, None] & ~allowed & judged
    strict = _compile_counts(section, index, index, "next", (V, V), "enforced")[1]
    forbid = ~allowed & (on[:, None] | (strict[:, None] & ~judged))
    return allowed, on | strict, weight, forbid


def _compile_dt(section: dict[str, Any], index: dict[str, int], V: int, view: str) -> dict[str, np.ndarray]:
    dt_lo = np.zeros(V, dtype=np.int64)
    dt_hi = np.full(V, np.iinfo(np.int64).max, dtype=np.int64)
    for name, e in section["event"].items():
        if _on(e, view):
            dt_lo[index[name]] = e["lo"]
            dt_hi[index[name]] = e["hi"]
    keys, lo, hi = [], [], []
    for pair, e in section["transition"].items():
        if _on(e, view):
            a, b = pair.split(" -> ")
            keys.append(index[a] * V + index[b])
            lo.append(e["lo"])
            hi.append(e["hi"])
    order = np.argsort(np.asarray(keys, dtype=np.int64), kind="stable")
    return {
        "dt_lo": dt_lo,
        "dt_hi": dt_hi,
        "dtt_keys": np.asarray(keys, dtype=np.int64)[order],
        "dtt_lo": np.asarray(lo, dtype=np.int64)[order],
        "dtt_hi": np.asarray(hi, dtype=np.int64)[order],
    }


def _compile_ret(section: dict[str, Any], index: dict[str, int], V: int, view: str) -> dict[str, Any]:
    presence = np.zeros(V, dtype=np.int8)
    enforced = np.zeros(V, dtype=bool)
    rkeys: list[int] = []
    table: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int64), np.zeros(0))] * V
    for name, e in section.items():
        i = index[name]
        # presence (a reader fact: exits carry a value, other events none) is always enforced
        presence[i] = {"free": 0, "present": 1, "null": 2}[e["presence"]] if view == "enforced" else 0
        syms = _syms(list(e["symbols"]))
        counts = np.array(list(e["symbols"].values()), dtype=np.float64)
        if len(syms):
            table[i] = (syms, counts / counts.sum())
        if _on(e, view):
            enforced[i] = True
            rkeys.extend(int(k) for k in ret_keys(np.full(len(e["allowed"]), i), _syms(e["allowed"])))
    return {
        "ret_presence": presence,
        "ret_enforced": enforced,
        "ret_allowed_keys": np.unique(np.asarray(rkeys, dtype=np.int64)),
        "ret_sym_table": table,
    }


def _compile_comm(
    section: dict[str, Any], index: dict[str, int], cindex: dict[str, int], V: int, C: int, view: str
) -> dict[str, np.ndarray]:
    allowed, enforced, weight = _compile_counts(section, index, cindex, "counts", (V, C), view)
    return {"comm_allowed": allowed, "comm_enforced": enforced, "comm_weight": weight}


def _cpu_rows(entries: list[dict[str, Any]], n_cpus: int) -> tuple[np.ndarray, np.ndarray]:
    allowed = np.zeros((len(entries), max(1, n_cpus)), dtype=bool)
    weight = np.zeros((len(entries), max(1, n_cpus)))
    for r, e in enumerate(entries):
        for c, cnt in e["runs"].items():
            allowed[r, int(c)] = True
            weight[r, int(c)] = cnt
    return allowed, weight


def _compile_cpu_comm(
    section: dict[str, Any], cindex: dict[str, int], C: int, n_cpus: int, view: str
) -> tuple[np.ndarray, ...]:
    allowed = np.zeros((C, max(1, n_cpus)), dtype=bool)
    weight = np.zeros((C, max(1, n_cpus)))
    enforced = np.zeros(C, dtype=bool)
    rows = [cindex[comm] for comm in section]
    allowed[rows], weight[rows] = _cpu_rows(list(section.values()), n_cpus)
    enforced[rows] = [_on(e, view) for e in section.values()]
    return allowed, enforced, weight


def _compile_cpu_tid(section: dict[str, Any], n_cpus: int, view: str) -> dict[str, np.ndarray]:
    items = sorted((int(t), e) for t, e in section.items() if _on(e, view))
    allowed, weight = _cpu_rows([e for _, e in items], n_cpus)
    return {
        "cpu_tids": np.array([t for t, _ in items], dtype=np.int64),
        "cpu_tid_allowed": allowed,
        "cpu_tid_weight": weight,
    }


def _compile_invariants(d: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The kernel's tables over the vocabulary (tracesynth.kernel: syscall pairing, sched convention) and the
    threads exempt from sched.one_cpu, as the data decided them; invariants are always enforced."""
    inv = d["invariants"]
    # a sched_switch counts only where the rules know one (not where only the trace shows it)
    k = EventTables.of(names, KernelFacts.from_invariants(inv), n_sched=len(d["events"]))
    exempt = {IDLE_TID} | {int(t) for t in inv["one_cpu"].get("exempt_tids", [])}
    return {
        "kernel": k,
        "one_cpu_exempt": np.array(sorted(exempt), dtype=np.int64),
    }


def _syms(names: list[str]) -> np.ndarray:
    return np.array([symbol_from_name(s) for s in names], dtype=np.int64)
