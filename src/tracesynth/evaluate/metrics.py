"""Fidelity and privacy metrics between a real trace and a synthetic one (all vectorised).

- event-type and n-gram Jensen-Shannon divergence (base 2: 0 = same distribution, 1 = disjoint);
- per-event-type dt Wasserstein distance on log10(1 + dt/ns) (scale-free, so workloads compare);
- syscall latency (entry to the next exit on the same thread) distributions, same distance;
- constraint violation rate (tracesynth.constraints.check_trace, where rules are given);
- memorisation: the longest run of event types shared exactly with the training data, and the share
  of synthetic windows that copy a training window event for event.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from scipy.stats import wasserstein_distance

from tracesynth.constraints import check_trace
from tracesynth.divergence import jsd, jsd_terms
from tracesynth.trace import Trace
from tracesynth.vocab import Vocab

__all__ = ["fidelity", "jsd", "memorisation", "ngram_jsd", "ngram_jsd_terms", "violation_rate"]


def _joint_codes(a: Trace, b: Trace) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Event codes of both traces in one shared vocabulary."""
    (ca, va), (cb, vb) = a.codes("event"), b.codes("event")
    vocab = Vocab(sorted(set(va) | set(vb)))
    return vocab.lookup(ca, va), vocab.lookup(cb, vb), vocab.values


def ngram_counts(codes: np.ndarray, n: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Unique n-gram keys (base-`base` digits) and their counts."""
    if len(codes) < n:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    key = np.zeros(len(codes) - n + 1, dtype=np.int64)
    for j in range(n):
        key = key * base + codes[j : len(codes) - n + 1 + j]
    return np.unique(key, return_counts=True)


def counts_jsd(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """JSD of two (keys, counts) tables (`ngram_counts`'s, or counts pooled over several sequences)."""
    return jsd(*_aligned(a, b)[1:])


def _aligned(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
    """The keys of either (keys, counts) table and both tables' counts on them (0 where a table lacks a key)."""
    (ka, ca), (kb, cb) = a, b
    keys = np.union1d(ka, kb)
    p = np.zeros(len(keys))
    q = np.zeros(len(keys))
    p[np.searchsorted(keys, ka)] = ca
    q[np.searchsorted(keys, kb)] = cb
    return keys, p, q


def _ngram_distributions(real: Trace, synth: Trace, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """The n-gram keys seen in either trace (base-V digits of event codes), their counts in each, and the vocabulary."""
    a, b, names = _joint_codes(real, synth)
    return (*_aligned(ngram_counts(a, n, len(names)), ngram_counts(b, n, len(names))), names)


def pieces_ngram_jsd(trace: Trace, pieces: int, length: int, n: int, rng: np.random.Generator) -> float:
    """ngram_jsd between a trace and `pieces` runs of `length` of its own events from random places, joined: what
    real data scores when cut the way a sampler's parallel chains are (a trace's phases are long, so a few pieces
    sample them unevenly, and real data itself then sits well above 0)."""
    codes, names = trace.codes("event")
    starts = rng.integers(0, max(1, len(codes) - length), pieces)
    joined = np.concatenate([codes[s : s + length] for s in starts])
    base = max(len(names), 1)
    return counts_jsd(ngram_counts(codes, n, base), ngram_counts(joined, n, base))


def ngram_jsd(real: Trace, synth: Trace, n: int = 1) -> float:
    """JSD between the n-gram distributions of event types (n=1: the event-type distribution)."""
    _, p, q, _ = _ngram_distributions(real, synth, n)
    return jsd(p, q)


def ngram_jsd_terms(real: Trace, synth: Trace, n: int = 3, top: int = 8) -> list[dict[str, Any]]:
    """The `top` n-grams of event types that carry most of `ngram_jsd(real, synth, n)`: each one's events, its
    share of the divergence (bits) and its frequency in each trace, largest share first."""
    keys, p, q, names = _ngram_distributions(real, synth, n)
    terms = jsd_terms(p, q)
    if np.isnan(terms).any():
        return []
    V = len(names)
    p, q = p / p.sum(), q / q.sum()
    out = []
    for i in np.argsort(-terms, kind="stable")[:top]:
        digits = [(int(keys[i]) // V**j) % V for j in range(n - 1, -1, -1)]  # the oldest event is the top digit
        out.append(
            {"ngram": [names[d] for d in digits], "bits": float(terms[i]), "real": float(p[i]), "synth": float(q[i])}
        )
    return out


def log_dt(trace: Trace) -> np.ndarray:
    ts = trace.ts
    if not len(ts):
        return np.zeros(0)
    return np.log10(1.0 + np.diff(ts, prepend=ts[0]).astype(np.float64))


def dt_wasserstein(real: Trace, synth: Trace, min_count: int = 20) -> dict[str, Any]:
    """Per-event-type Wasserstein distance between log10(1+dt) distributions; mean weighted by real frequency."""
    ra, sa, names = _joint_codes(real, synth)
    rdt, sdt = log_dt(real), log_dt(synth)
    per: dict[str, float] = {}
    weights: dict[str, int] = {}
    r_order, s_order = np.argsort(ra, kind="stable"), np.argsort(sa, kind="stable")
    r_bounds = np.searchsorted(ra[r_order], np.arange(len(names) + 1))
    s_bounds = np.searchsorted(sa[s_order], np.arange(len(names) + 1))
    for i, name in enumerate(names):
        r = rdt[r_order[r_bounds[i] : r_bounds[i + 1]]]
        s = sdt[s_order[s_bounds[i] : s_bounds[i + 1]]]
        if len(r) >= min_count and len(s) >= min_count:
            per[name] = float(wasserstein_distance(r, s))
            weights[name] = len(r)
    total = sum(weights.values())
    mean = sum(per[k] * weights[k] for k in per) / total if total else float("nan")
    everything = float(wasserstein_distance(rdt, sdt)) if len(rdt) and len(sdt) else float("nan")
    return {"mean": mean, "per_event": per, "all": everything}


_ENTRY = re.compile(r"(syscall_entry_|sys_enter_|sys_enter|syscalls:sys_enter_)")
_EXIT = re.compile(r"(syscall_exit_|sys_exit_|sys_exit|syscalls:sys_exit_)")


def syscall_latencies(trace: Trace) -> dict[str, np.ndarray]:
    """Syscall name -> latencies (ns): each entry paired with the next event on the same thread if it is the exit."""
    codes, voc = trace.codes("event")
    if not len(codes) or not voc:
        return {}
    kind = np.zeros(len(voc), dtype=np.int8)  # 1 entry, 2 exit
    name = []
    for i, v in enumerate(voc):
        if _ENTRY.search(v):
            kind[i] = 1
            name.append(_ENTRY.sub("", v))
        elif _EXIT.search(v):
            kind[i] = 2
            name.append(_EXIT.sub("", v))
        else:
            name.append("")
    tid = trace.numeric("tid")
    ts = trace.ts
    order = np.lexsort((np.arange(len(ts)), tid))  # by thread, then time order
    c, t, s = codes[order], tid[order], ts[order]
    k = kind[c]
    pair = (k[:-1] == 1) & (k[1:] == 2) & (t[:-1] == t[1:]) & (t[:-1] >= 0)
    names = np.asarray(name, dtype=object)
    same = names[c[:-1]] == names[c[1:]]
    pair &= same
    idx = np.flatnonzero(pair)
    lat = (s[idx + 1] - s[idx]).astype(np.int64)
    who = c[idx]
    out: dict[str, np.ndarray] = {}
    for code in np.unique(who):
        out[str(names[code])] = lat[who == code]
    return out


def latency_wasserstein(real: Trace, synth: Trace, min_count: int = 20) -> dict[str, Any]:
    """Per-syscall Wasserstein distance on log10(1 + latency/ns), mean weighted by real count."""
    lr, ls = syscall_latencies(real), syscall_latencies(synth)
    per = {}
    w = {}
    for k, r in lr.items():
        s = ls.get(k)
        if s is not None and len(r) >= min_count and len(s) >= min_count:
            per[k] = float(wasserstein_distance(np.log10(1 + r), np.log10(1 + s)))
            w[k] = len(r)
    total = sum(w.values())
    mean = sum(per[k] * w[k] for k in per) / total if total else float("nan")
    n_real = sum(len(v) for v in lr.values())
    n_synth = sum(len(v) for v in ls.values())
    return {"mean": mean, "per_syscall": per, "pairs_real": n_real, "pairs_synth": n_synth}


def violation_rate(trace: Trace, rules: Any) -> float | None:
    """Share of events that break a mined rule (None when there are no rules)."""
    if rules is None:
        return None
    return float(check_trace(trace, rules).rate)


# -- memorisation ---------------------------------------------------------------------------------
# Rolling hash of every run of `length` codes, fully vectorised: P[i] = sum_{j<i} x[j] B^j (mod 2**64,
# numpy's uint64 wrap-around); run(i, L) = (P[i+L] - P[i]) * B^-i. B is odd, so B^-1 exists mod 2**64.
_B = 1_000_003
_B_INV = pow(_B, -1, 2**64)


def _prefix_hash(codes: np.ndarray) -> np.ndarray:
    x = codes.astype(np.uint64) + np.uint64(1)
    j = np.arange(len(x), dtype=np.uint64)
    h = np.zeros(len(x) + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h[1:] = np.cumsum(x * np.power(np.uint64(_B), j), dtype=np.uint64)
    return h


def _gram_hashes(codes: np.ndarray, length: int, h: np.ndarray | None = None) -> np.ndarray:
    """Hash of every run of `length` consecutive codes."""
    if len(codes) < length or length <= 0:
        return np.zeros(0, dtype=np.uint64)
    h = _prefix_hash(codes) if h is None else h
    i = np.arange(len(codes) - length + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (h[length:] - h[: len(h) - length]) * np.power(np.uint64(_B_INV), i)


def longest_shared_run(synth: np.ndarray, train: np.ndarray, cap: int = 100_000) -> int:
    """Length of the longest run of event codes that occurs exactly in both sequences (binary search on hashes)."""
    hs, ht = _prefix_hash(synth), _prefix_hash(train)

    def shared(length: int) -> bool:
        return bool(np.isin(_gram_hashes(synth, length, hs), _gram_hashes(train, length, ht)).any())

    lo, hi = 0, min(len(synth), len(train), cap)
    while lo < hi:  # invariant: a run of lo is shared; find the largest
        mid = (lo + hi + 1) // 2
        if shared(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def copied_window_share(synth: np.ndarray, train: np.ndarray, window: int = 128) -> float:
    """Share of synthetic windows (every position) whose `window` event types appear verbatim in training."""
    gs = _gram_hashes(synth, window)
    if not len(gs):
        return float("nan")
    return float(np.isin(gs, _gram_hashes(train, window)).mean())


def copied_within(codes: np.ndarray, start: int, n: int, window: int = 128) -> float:
    """Share of the `window`-event windows of codes[start:start+n] found verbatim in the rest of `codes` (windows
    that do not overlap that slice): how often a workload repeats itself within one period. The reference for
    a sample's `copied_window_share` against that period, where the held-out block may be another phase."""
    rest = np.concatenate([_gram_hashes(codes[:start], window), _gram_hashes(codes[start + n :], window)])
    gs = _gram_hashes(codes[start : start + n], window)
    return float(np.isin(gs, rest).mean()) if len(gs) else float("nan")


def memorisation(synth: Trace, train: Trace, window: int = 128) -> dict[str, float]:
    a, b, _ = _joint_codes(synth, train)
    return {"longest_shared_run": longest_shared_run(a, b), "copied_window_share": copied_window_share(a, b, window)}


def fidelity(real: Trace, synth: Trace) -> dict[str, float]:
    """The headline fidelity numbers in one flat dict (lower is better for all)."""
    return {
        "jsd_event": ngram_jsd(real, synth, 1),
        "jsd_2gram": ngram_jsd(real, synth, 2),
        "jsd_3gram": ngram_jsd(real, synth, 3),
        "dt_wasserstein": dt_wasserstein(real, synth)["mean"],
        "latency_wasserstein": latency_wasserstein(real, synth)["mean"],
    }
