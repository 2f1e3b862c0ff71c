"""The data behind the report's plots, computed while the traces are in memory.

Small, JSON-ready summaries of a real trace and each generator's sample (event shares, gap and
syscall-latency histograms, transition matrices); tracesynth.report draws them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tracesynth.evaluate.metrics import log_dt, syscall_latencies
from tracesynth.trace import Trace
from tracesynth.vocab import Vocab

TOP_EVENTS = 15
HEAT_EVENTS = 12
DT_BINS = np.arange(0.0, 10.25, 0.25)  # log10(1 + ns): 1 ns .. 10 s


def _shares(trace: Trace, names: Sequence[str]) -> list[float]:
    counts = trace.event_counts()
    n = max(1, len(trace))
    return [counts.get(k, 0) / n for k in names]


def _hist(values: np.ndarray, bins: np.ndarray) -> list[float]:
    if not len(values):
        return [0.0] * (len(bins) - 1)
    h, _ = np.histogram(np.clip(values, bins[0], bins[-1] - 1e-9), bins=bins)
    return (h / max(1, h.sum())).tolist()


def _transitions(trace: Trace, names: Sequence[str]) -> list[list[float]]:
    c = Vocab(names).lookup(*trace.codes("event"))  # events outside `names` -> -1
    a, b = c[:-1], c[1:]
    ok = (a >= 0) & (b >= 0)
    k = len(names)
    m = np.bincount(a[ok] * k + b[ok], minlength=k * k).reshape(k, k).astype(float)
    return (m / np.maximum(m.sum(1, keepdims=True), 1)).tolist()


def _latencies(t: Trace) -> np.ndarray:
    v = syscall_latencies(t)
    return np.log10(1 + np.concatenate(list(v.values()))) if v else np.zeros(0)


def plot_data(real: Trace, synth: Mapping[str, Trace], repaired: Mapping[str, Trace] | None = None) -> dict[str, Any]:
    """Plot summaries of a real trace and each generator's raw (and repaired) sample."""
    names = list(real.event_counts())[:TOP_EVENTS]
    heat = names[:HEAT_EVENTS]
    sources = {"real": real, **synth}
    for g, t in (repaired or {}).items():
        sources[f"{g} (repaired)"] = t
    return {
        "events": names,
        "shares": {k: _shares(t, names) for k, t in sources.items()},
        "dt_bins": DT_BINS.tolist(),
        "dt_hist": {k: _hist(log_dt(t)[1:], DT_BINS) for k, t in sources.items()},
        "lat_hist": {k: _hist(_latencies(t), DT_BINS) for k, t in sources.items()},
        "heat_events": heat,
        "heat": {k: _transitions(t, heat) for k, t in sources.items() if "(repaired)" not in k},
    }
