"""Jensen-Shannon divergence between two count vectors: the one copy every score uses."""

from __future__ import annotations

import numpy as np


def jsd(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits (0 = same distribution, 1 = disjoint) of two count or
    probability vectors on the same support.

    NaN when either side has no mass: an empty sample has no distribution to compare, and scoring it
    0.5 (half of "disjoint"), as dividing by a tiny epsilon would, reads as a real measurement.
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return float("nan")
    p, q = p / p.sum(), q / q.sum()
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    return float(np.clip(0.5 * kl(p) + 0.5 * kl(q), 0.0, 1.0))
