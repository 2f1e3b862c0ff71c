"""Serving metrics: per request (TTFT, TPOT, end-to-end) and a run summary (percentiles, throughput,
batch sizes, KV-cache usage over time).

TTFT is first token time minus arrival; TPOT is (finish - first token) / (output tokens - 1), undefined for
one-token outputs; end-to-end is finish minus arrival.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from atomicio import atomic_path
from dooly.simulator.entities import IterationRecord, Request

PERCENTILES = (50, 90, 99)


@dataclass
class RequestMetrics:
    """Aligned per-request arrays (ids in arrival order)."""

    id: np.ndarray
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray  # NaN where output == 1
    e2e: np.ndarray
    preemptions: np.ndarray

    @classmethod
    def from_requests(cls, requests: list[Request]) -> RequestMetrics:
        reqs = sorted(requests, key=lambda r: r.id)
        if any(r.first_token is None or r.finished is None for r in reqs):
            raise ValueError("every request must have finished before its metrics are taken")
        arrival = np.array([r.arrival for r in reqs])
        first = np.array([r.first_token for r in reqs], dtype=np.float64)
        fin = np.array([r.finished for r in reqs], dtype=np.float64)
        out = np.array([r.output_tokens for r in reqs], dtype=np.int64)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(out > 1, (fin - first) / np.maximum(out - 1, 1), np.nan)
        return cls(
            id=np.array([r.id for r in reqs]),
            arrival=arrival,
            prompt=np.array([r.prompt_tokens for r in reqs]),
            output=out,
            ttft=first - arrival,
            tpot=tpot,
            e2e=fin - arrival,
            preemptions=np.array([r.preemptions for r in reqs]),
        )

    def save_csv(self, path: str | Path) -> Path:
        path = Path(path)
        cols = ["id", "arrival", "prompt", "output", "ttft", "tpot", "e2e", "preemptions"]
        with atomic_path(path) as tmp, tmp.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(cols)
            for row in zip(*(getattr(self, c) for c in cols), strict=True):
                w.writerow([f"{v:.6f}" if isinstance(v, float | np.floating) else int(v) for v in row])
        return path


def _stats(x: np.ndarray) -> dict[str, float]:
    x = x[np.isfinite(x)]
    if len(x) == 0:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    return {"mean": float(x.mean()), **{f"p{p}": float(np.percentile(x, p)) for p in PERCENTILES}}


@dataclass
class Summary:
    """What an ML-infrastructure engineer reads first."""

    requests: int
    duration: float  # first arrival to last finish, seconds
    ttft: dict[str, float]
    tpot: dict[str, float]
    e2e: dict[str, float]
    throughput_tokens: float  # output tokens / s
    throughput_requests: float
    mean_batch_size: float
    max_batch_size: int
    mean_batch_tokens: float
    peak_kv_usage: float  # fraction of blocks
    preemptions: int
    iterations: int
    extra: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, float]:
        """Flat dict for tables/CSV."""
        out: dict[str, float] = {"requests": self.requests, "duration_s": self.duration}
        for name in ("ttft", "tpot", "e2e"):
            for k, v in getattr(self, name).items():
                out[f"{name}_{k}"] = v
        out.update(
            throughput_tok_s=self.throughput_tokens,
            throughput_req_s=self.throughput_requests,
            mean_batch_size=self.mean_batch_size,
            max_batch_size=self.max_batch_size,
            peak_kv_usage=self.peak_kv_usage,
            preemptions=self.preemptions,
            iterations=self.iterations,
        )
        return out


def summarize(metrics: RequestMetrics, iterations: list[IterationRecord]) -> Summary:
    duration = float((metrics.arrival + metrics.e2e).max() - metrics.arrival.min())
    duration = max(duration, 1e-12)
    sizes = np.array([it.num_prefill + it.num_decode for it in iterations]) if iterations else np.zeros(1)
    tokens = np.array([it.prefill_tokens + it.num_decode for it in iterations]) if iterations else np.zeros(1)
    kv = [it.kv_blocks_used / it.kv_blocks_total for it in iterations] or [0.0]
    return Summary(
        requests=len(metrics.id),
        duration=duration,
        ttft=_stats(metrics.ttft),
        tpot=_stats(metrics.tpot),
        e2e=_stats(metrics.e2e),
        throughput_tokens=float(metrics.output.sum() / duration),
        throughput_requests=float(len(metrics.id) / duration),
        mean_batch_size=float(sizes.mean()),
        max_batch_size=int(sizes.max()),
        mean_batch_tokens=float(tokens.mean()),
        peak_kv_usage=float(max(kv)),
        preemptions=int(metrics.preemptions.sum()),
        iterations=len(iterations),
    )
