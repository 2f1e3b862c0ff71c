"""tracesynth.buckets: the one log2 bucketing reproduces, on edge values, each caller's buckets from before it
was shared (the token models' quarter-octave gaps, the windows' ceil-log2 gap bins, the codec's return bins)."""

from __future__ import annotations

import numpy as np

from tracesynth.buckets import log2_bucket
from tracesynth.channels import N_POS_BINS, _log2_bin
from tracesynth.evaluate.windows import N_DT_BINS, dt_bins
from tracesynth.generators.tokens import DT_PER_OCTAVE, N_DT, dt_bucket
from tracesynth.trace import Trace

INT64_MAX = np.iinfo(np.int64).max
EDGES = np.unique(
    np.array(
        [0, 1, 2, 3, INT64_MAX, INT64_MAX - 1]
        + [v for b in range(1, 63) for v in ((1 << b) - 1, 1 << b, (1 << b) + 1)]
        + [int(round(2 ** (k / 4))) + d for k in range(0, 180) for d in (-1, 0, 1)],
        dtype=np.int64,
    )
)


def _old_dt_bucket(gaps_ns: np.ndarray) -> np.ndarray:  # generators/tokens.py before
    g = np.asarray(gaps_ns, dtype=np.float64)
    b = 1 + np.floor(DT_PER_OCTAVE * np.log2(np.maximum(g, 1.0))).astype(np.int64)
    return np.where(g <= 0, 0, np.clip(b, 1, N_DT - 1))


def _old_dt_bins(dt: np.ndarray) -> np.ndarray:  # evaluate/windows.py before (on the gaps)
    dt = dt.astype(np.float64)
    return np.clip(np.ceil(np.log2(np.maximum(dt, 1.0))).astype(np.int64), 0, N_DT_BINS - 1)


def _old_log2_bin(v: np.ndarray) -> np.ndarray:  # channels.py before
    v = np.asarray(v, dtype=np.int64)
    b = np.clip(np.floor(np.log2(np.maximum(v, 1).astype(np.float64))).astype(np.int64), 0, 62)
    b = np.where((b > 0) & (np.left_shift(np.int64(1), np.clip(b, 0, 62)) > v), b - 1, b)
    b = np.where((b < 62) & (np.left_shift(np.int64(1), np.clip(b + 1, 0, 62)) <= v), b + 1, b)
    return np.clip(b, 0, N_POS_BINS - 1)


def test_each_caller_keeps_its_buckets_on_edge_values() -> None:
    v = np.concatenate([EDGES, -EDGES[EDGES > 0][:8]])
    assert (dt_bucket(v) == _old_dt_bucket(v)).all()
    assert (_log2_bin(v) == _old_log2_bin(v)).all()
    ts = np.concatenate([[0], np.cumsum(EDGES[EDGES < 2**40])])  # gaps between timestamps, as windows cut them
    trace = Trace.from_columns(ts=ts.astype(np.int64), event=np.array(["e"] * len(ts), object))
    assert (dt_bins(trace) == _old_dt_bins(np.diff(ts, prepend=ts[0]))).all()


def test_exact_octaves() -> None:
    v = np.array([0, 1, 2, 3, 4, 5, 2**53, 2**53 + 1, 2**62 - 1, 2**62, INT64_MAX], np.int64)
    assert log2_bucket(v).tolist() == [0, 0, 1, 1, 2, 2, 53, 53, 61, 62, 62]
    assert log2_bucket(v, up=True).tolist() == [0, 0, 1, 2, 2, 3, 53, 54, 62, 62, 63]
    assert log2_bucket(np.array([1, 2, 3, 4]), per_octave=4).tolist() == [0, 4, 6, 8]
