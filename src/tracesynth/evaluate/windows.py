"""Windows of events for the downstream tasks: encoding, cutting, de-duplication, time-block splits.

A window is the previous `context` events (event type + log-binned dt) and the label is the type of
the next event. Windows are cut inside one block of a time split and never across two, so no test
window (nor any overlap of one) reaches training or a generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tracesynth.buckets import log2_bucket
from tracesynth.errors import TraceSynthError
from tracesynth.splits import split_by_time
from tracesynth.trace import Trace
from tracesynth.vocab import Vocab as StringVocab

N_DT_BINS = 16  # log2-spaced gap bins: 0 ns, then <2, <4, ... ns up to >= 2**29 ns (~0.5 s)


@dataclass
class Windows:
    """Event windows (n, context) with dt bins (n, context) and the next event's type (n,)."""

    events: np.ndarray
    dts: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, idx: np.ndarray) -> Windows:
        return Windows(self.events[idx], self.dts[idx], self.labels[idx])

    @staticmethod
    def concat(parts: Sequence[Windows]) -> Windows:
        parts = [p for p in parts if len(p)]
        if not parts:
            raise TraceSynthError("no windows to concatenate")
        return Windows(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("events", "dts", "labels")))


class Vocab(StringVocab):
    """Event-type vocabulary fixed on the real training data; unseen types map to UNK (id 0)."""

    def __init__(self, names: Sequence[str]):
        super().__init__(["<unk>", *sorted(set(names))])

    @property
    def names(self) -> list[str]:
        return self.values

    @classmethod
    def from_traces(cls, traces: Sequence[Trace]) -> Vocab:
        return cls([v for t in traces for v in t.codes("event")[1]])

    def encode(self, trace: Trace) -> np.ndarray:
        return self.lookup(*trace.codes("event"), default=0)


def dt_bins(trace: Trace) -> np.ndarray:
    """Gap to the previous event, binned by powers of two (scale-free, so workloads compare)."""
    ts = trace.ts
    if not len(ts):
        return np.zeros(0, dtype=np.int64)
    return np.clip(log2_bucket(np.diff(ts, prepend=ts[0]), up=True), 0, N_DT_BINS - 1)


def make_windows(trace: Trace, vocab: Vocab, context: int = 128, stride: int = 1) -> Windows:
    """All windows of `context` events (step `stride`) with the next event's type as label."""
    ev = vocab.encode(trace)
    dtb = dt_bins(trace)
    n = len(ev) - context
    if n <= 0:
        return Windows(np.zeros((0, context), np.int64), np.zeros((0, context), np.int64), np.zeros(0, np.int64))
    ew = sliding_window_view(ev[:-1], context)[::stride]
    dw = sliding_window_view(dtb[:-1], context)[::stride]
    labels = ev[context:][::stride]
    return Windows(np.ascontiguousarray(ew), np.ascontiguousarray(dw), labels.copy())


def window_hashes(w: Windows) -> np.ndarray:
    """One 64-bit hash per window (events, dt bins and label): exact duplicates collide, others almost never."""
    x = np.concatenate([w.events, w.dts + 1_000_003, w.labels[:, None]], axis=1).astype(np.uint64)
    h = np.full(len(x), np.uint64(1469598103934665603))
    prime = np.uint64(1099511628211)
    with np.errstate(over="ignore"):
        for j in range(x.shape[1]):
            h = (h ^ x[:, j]) * prime
    return h


def dedup(w: Windows, exclude: Windows | None = None) -> Windows:
    """Drop repeated windows, and any window identical to one in `exclude` (e.g. the test set)."""
    if not len(w):
        return w
    h = window_hashes(w)
    _, first = np.unique(h, return_index=True)
    keep = np.zeros(len(w), dtype=bool)
    keep[first] = True
    if exclude is not None and len(exclude):
        keep &= ~np.isin(h, window_hashes(exclude))
    return w.take(np.flatnonzero(keep))


@dataclass
class Split:
    """A real trace cut by time: train (for generators and classifiers), val, test (held out)."""

    train: Trace
    val: Trace
    test: Trace


def split_trace(trace: Trace, fractions: Sequence[float] = (0.8, 0.1, 0.1)) -> Split:
    """Time-block split (tracesynth.splits.split_by_time); the test block is the most recent one."""
    if len(trace) < 3 * 130:
        raise TraceSynthError(f"trace too short to split for evaluation ({len(trace)} events)")
    train, val, test = split_by_time(trace, fractions)
    return Split(train, val, test)


def recent(trace: Trace, fraction: float) -> Trace:
    """The most recent `fraction` of a training block (the scarce-data budgets)."""
    n = max(1, int(round(len(trace) * fraction)))
    return trace.slice(len(trace) - n)


def subsample(w: Windows, n: int, rng: np.random.Generator) -> Windows:
    """At most n windows, drawn without replacement."""
    if len(w) <= n:
        return w
    return w.take(np.sort(rng.choice(len(w), n, replace=False)))
