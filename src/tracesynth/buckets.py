"""Log-scale buckets of non-negative quantities (gaps, return values): one function, its resolution a parameter."""

from __future__ import annotations

import numpy as np


def log2_bucket(x: np.ndarray, per_octave: int = 1, up: bool = False) -> np.ndarray:
    """floor(per_octave * log2(x)) of each x (the ceiling with `up`); x below 1 counts as 1 (bucket 0).

    One bucket per octave is exact over all of int64 (float64 log2 rounds near powers of two above 2**53);
    finer buckets go through float64 log2 of the values as given."""
    if per_octave != 1:
        scaled = per_octave * np.log2(np.maximum(np.asarray(x, dtype=np.float64), 1.0))
        return (np.ceil(scaled) if up else np.floor(scaled)).astype(np.int64)
    v = np.maximum(np.asarray(x, dtype=np.int64), 1)
    if up:  # ceil(log2 v) = floor(log2(v - 1)) + 1 for v >= 2
        return np.where(v > 1, _floor_log2(np.maximum(v - 1, 1)) + 1, 0)
    return _floor_log2(v)


def _floor_log2(v: np.ndarray) -> np.ndarray:
    """floor(log2(v)) of int64 values >= 1, exactly: the float estimate, corrected by one either way."""
    b = np.clip(np.floor(np.log2(v.astype(np.float64))).astype(np.int64), 0, 62)  # int64 < 2**63
    b = np.where((b > 0) & (np.left_shift(np.int64(1), np.clip(b, 0, 62)) > v), b - 1, b)
    return np.where((b < 62) & (np.left_shift(np.int64(1), np.clip(b + 1, 0, 62)) <= v), b + 1, b)
