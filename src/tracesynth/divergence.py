"""Jensen-Shannon divergence between two count vectors: the one copy every score uses."""

from __future__ import annotations

import numpy as np


def jsd(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits (0 = same distribution, 1 = disjoint) of two count or
    probability vectors on the same support.

    NaN when either side has no mass: an empty sample has no distribution to compare, and scoring it
    0.5 (half of "disjoint"), as dividing by a tiny epsilon would, reads as a real measurement.
    """
    if np.sum(p) <= 0 or np.sum(q) <= 0:  # (an empty support too, where jsd_terms has no element to be NaN)
        return float("nan")
    return float(np.clip(jsd_terms(p, q).sum(), 0.0, 1.0))


def jsd_terms(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Each support element's share of `jsd(p, q)` in bits (they sum to it, before its clip to [0, 1]): which
    elements carry a divergence. All NaN when either side has no mass."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return np.full(p.shape, np.nan)
    p, q = p / p.sum(), q / q.sum()
    m = 0.5 * (p + q)
    with np.errstate(divide="ignore", invalid="ignore"):
        return 0.5 * np.where(p > 0, p * np.log2(p / m), 0.0) + 0.5 * np.where(q > 0, q * np.log2(q / m), 0.0)
