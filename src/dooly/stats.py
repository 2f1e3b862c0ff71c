"""The two error figures every validation prints: prediction error (MAPE) and the measurements' own spread."""

from __future__ import annotations

import numpy as np


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error, in percent, over finite pairs with a non-zero measurement."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    ok = np.isfinite(p) & np.isfinite(m) & (m != 0)
    if not ok.any():
        return float("nan")
    return float(np.mean(np.abs(p[ok] - m[ok]) / np.abs(m[ok])) * 100)


def spread_pct(samples: np.ndarray) -> float:
    """How far repeated measurements of the same items land apart, in percent: (max - min) / mean per item
    (axis 0: the repeats; with two, the symmetric percentage difference), averaged over items with a finite,
    positive mean. NaN with fewer than two repeats: the noise floor a prediction is judged against."""
    x = np.asarray(samples, dtype=float)
    if x.ndim != 2 or x.shape[0] < 2:
        return float("nan")
    mean = x.mean(axis=0)
    ok = np.isfinite(x).all(axis=0) & (mean > 0)
    return float(((x.max(axis=0) - x.min(axis=0))[ok] / mean[ok]).mean() * 100) if ok.any() else float("nan")
