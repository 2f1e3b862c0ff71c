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


#: where a latency distribution is compared: what `vllm bench serve` and users read (median, tails)
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def quantile_error_pct(predicted: np.ndarray, measured: np.ndarray, qs: tuple[float, ...] = QUANTILES) -> float:
    """Distribution error, in percent: |predicted - measured| / measured at each quantile, averaged.

    Unlike per-request MAPE it does not ask which request waited: under queueing a few ms moved between
    two requests swap their TTFTs, which per-request errors count twice and the distribution not at all."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    p, m = p[np.isfinite(p)], m[np.isfinite(m)]
    if not len(p) or not len(m):
        return float("nan")
    qp, qm = np.quantile(p, qs), np.quantile(m, qs)
    ok = qm > 0
    return float(np.mean(np.abs(qp[ok] - qm[ok]) / qm[ok]) * 100) if ok.any() else float("nan")


def quantile_spread_pct(samples: np.ndarray, qs: tuple[float, ...] = QUANTILES) -> float:
    """`spread_pct` of each repeat's quantiles (axis 0: the repeats): the noise floor of `quantile_error_pct`."""
    x = np.asarray(samples, dtype=float)
    if x.ndim != 2 or x.shape[0] < 2:
        return float("nan")
    return spread_pct(
        np.stack([np.quantile(r[np.isfinite(r)], qs) if np.isfinite(r).any() else np.full(len(qs), np.nan) for r in x])
    )


#: the percentiles `vllm bench serve` prints and serving validation headlines
SERVING_PERCENTILES = (50.0, 90.0, 99.0)


def percentile_errors(
    simulated: np.ndarray, runs: list[np.ndarray], ps: tuple[float, ...] = SERVING_PERCENTILES
) -> dict[str, object]:
    """One metric's percentiles, as a load generator reports them: each real run's percentile, the median over
    the runs as the measured figure, the runs' spread as its noise floor, and the simulation's error against it.

    Percentiles do not ask which request waited, so the server's order of admitting near-simultaneous requests
    (which varies from run to run) moves them far less than it moves per-request errors."""

    def pct(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        x = x[np.isfinite(x)]
        return np.percentile(x, ps) if len(x) else np.full(len(ps), np.nan)

    per_run = np.stack([pct(r) for r in runs])
    measured, sim = np.median(per_run, axis=0), pct(simulated)
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(sim - measured) / measured * 100
    spread = [spread_pct(per_run[:, [i]]) for i in range(len(ps))]
    return {
        "percentiles": list(ps),
        "measured": measured.tolist(),
        "simulated": sim.tolist(),
        "error_pct": err.tolist(),
        "spread_pct": spread,
        "mean_error_pct": float(np.nanmean(err)) if np.isfinite(err).any() else float("nan"),
        "mean_spread_pct": float(np.nanmean(spread)) if np.isfinite(spread).any() else float("nan"),
    }
