"""Serve a workload with a real engine (by default Hugging Face transformers, eager, on the CPU) and measure it.

The loop is the simulator's, with the clock made real: the same :class:`ReplicaScheduler` decides every
iteration (admission, chunks, KV blocks, preemption), then the iteration is *executed* on the model by the
engine's :class:`~dooly.engines.Executor` and timed; requests join at their arrival time on that clock (wall
time, or the serving thread's CPU time on a shared machine: see :func:`serve`). So measured and simulated
runs differ only in where an iteration's latency comes from, which is what validation must isolate. How an
iteration runs on HF eager is described in :mod:`dooly.engines.hf_serving`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dooly.core import stats
from dooly.core.errors import DoolyError
from dooly.engines import Engine
from dooly.simulator.entities import IterationRecord, Request, ScheduledBatch
from dooly.simulator.metrics import RequestMetrics, Summary, summarize
from dooly.simulator.scheduler import ReplicaScheduler, SchedulerConfig
from dooly.simulator.workload import Workload


@dataclass
class ServingResult:
    requests: list[Request]
    iterations: list[IterationRecord]
    metrics: RequestMetrics
    summary: Summary
    config: SchedulerConfig
    batches: list[ScheduledBatch]


def serve(
    workload: Workload,
    model: torch.nn.Module,
    config: SchedulerConfig,
    engine: Engine,
    threads: int | None = None,
    warmup: bool = True,
    on_iteration: Callable[[IterationRecord], None] | None = None,
    clock: str = "wall",
) -> ServingResult:
    """Serve `workload` on `model` (built by `engine`) with `config`'s scheduling; per-request metrics on the
    engine's clock.

    ``clock="wall"``: requests arrive in real time and latencies are ``perf_counter`` differences, so other
    processes on the machine show up in them. ``clock="thread"``: each iteration is timed with the serving
    thread's CPU time (exact for a one-thread engine, where every kernel runs on that thread) and the run
    follows a virtual clock advanced by those durations, jumping over idle gaps to the next arrival: the
    timeline the engine would have on a core of its own. It matches profiles taken with the thread clock.
    """
    if clock not in ("wall", "thread"):
        raise DoolyError(f"unknown clock {clock!r} (wall or thread)")
    if threads is not None:
        torch.set_num_threads(threads)
    max_len = int((workload.prompt + workload.output).max()) + 1
    if warmup:  # first calls allocate and pick kernels; keep them out of the measurement
        _warm(engine, model, config, max_len)
    executor = engine.executor(model, config.max_num_seqs, max_len)
    sched = ReplicaScheduler(config)
    requests = workload.requests()
    pending = list(reversed(requests))  # pop() yields the earliest arrival
    iterations: list[IterationRecord] = []
    batches: list[ScheduledBatch] = []
    t0 = time.perf_counter()
    virtual = 0.0
    while pending or sched.has_work:
        now = time.perf_counter() - t0 if clock == "wall" else virtual
        while pending and pending[-1].arrival <= now:
            sched.add(pending.pop())
        if not sched.has_work:
            if clock == "wall":
                time.sleep(max(0.0, pending[-1].arrival - now))
            else:
                virtual = pending[-1].arrival
            continue
        batch = sched.schedule()
        for req in batch.preempted:
            executor.release(req)
        for req, _ in batch.prefill:
            if req.first_scheduled is None:
                req.first_scheduled = now
        c0 = time.thread_time()
        executor.run(batch)
        if clock == "wall":
            end = time.perf_counter() - t0
        else:
            virtual = end = now + (time.thread_time() - c0)
        rec = IterationRecord.of(batch, sched.kv, 0, now, end)
        iterations.append(rec)
        batches.append(_snapshot(batch))
        if on_iteration is not None:
            on_iteration(rec)
        for req in sched.complete(batch, end):
            executor.release(req)
    metrics = RequestMetrics.from_requests(requests)
    return ServingResult(requests, iterations, metrics, summarize(metrics, iterations), config, batches)


def _snapshot(batch: ScheduledBatch) -> ScheduledBatch:
    """Freeze what the predictor would see for this iteration (requests keep mutating afterwards)."""

    def copy(r: Request) -> Request:
        return Request(r.id, r.arrival, r.prompt_tokens, r.output_tokens, computed=r.computed)

    return ScheduledBatch(prefill=[(copy(r), n) for r, n in batch.prefill], decode=[copy(r) for r in batch.decode])


def _warm(engine: Engine, model: torch.nn.Module, config: SchedulerConfig, max_len: int) -> None:
    w = Workload(np.zeros(2), np.array([min(32, max_len - 4)] * 2), np.array([3, 3]), name="warmup")
    ex = engine.executor(model, max(2, config.max_num_seqs), max_len)
    sched = ReplicaScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4 * max_len))
    for r in w.requests():
        sched.add(r)
    while sched.has_work:
        b = sched.schedule()
        ex.run(b)
        for r in sched.complete(b, 0.0):
            ex.release(r)


def average_runs(runs: list[ServingResult]) -> ServingResult:
    """The first run, with each request's TTFT, TPOT and end-to-end latency the median over all runs.

    Runs of one workload schedule the same requests; what moves between them is the machine's speed, which
    a single run would leave in the measurement the simulator is scored against.
    """
    import dataclasses

    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    med = {k: np.median(np.stack([getattr(r.metrics, k) for r in runs]), axis=0) for k in ("ttft", "tpot", "e2e")}
    return dataclasses.replace(first, metrics=dataclasses.replace(first.metrics, **med))


def request_spread(runs: list[ServingResult]) -> dict[str, float]:
    """Per-request spread (%) of TTFT and TPOT between real runs of the same workload: the noise floor.

    For each request, (max - min) / mean over the runs, averaged over requests; with two runs this is the
    symmetric percentage difference. NaN with one run. `ttft_quantiles` / `tpot_quantiles`: the same over the
    runs' p10-p90 (`stats.QUANTILES`), the floor of `request_rows`' `quantile_err_pct`.
    """
    out = {}
    for k in ("ttft", "tpot"):
        x = np.stack([getattr(r.metrics, k) for r in runs])
        out[k] = stats.spread_pct(x)
        out[f"{k}_quantiles"] = stats.quantile_spread_pct(x)  # the noise floor of the distribution error
    return out


def pooled_itl(requests: list[Request]) -> np.ndarray:
    """Every gap between consecutive tokens of every request: the pool `vllm bench serve` takes its ITL
    percentiles over."""
    gaps = [np.diff(np.asarray(r.token_times, dtype=np.float64)) for r in requests]
    return np.concatenate(gaps) if gaps else np.zeros(0)


#: the metrics serving validation headlines, as `vllm bench serve` prints them
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile_scores(
    runs: list[tuple[RequestMetrics, np.ndarray]], simulated: RequestMetrics, simulated_itl: np.ndarray
) -> dict[str, dict]:
    """Per metric, the simulation's p50/p90/p99 against the real runs' (``runs``: each run's per-request
    metrics and pooled inter-token gaps), with the runs' spread at each percentile (the noise floor)."""
    out = {}
    for m in PERCENTILE_METRICS:
        measured = [itl if m == "itl" else getattr(met, m) for met, itl in runs]
        out[m] = stats.percentile_errors(simulated_itl if m == "itl" else getattr(simulated, m), measured)
    return out


@dataclass
class Validation:
    """Simulated vs measured serving of one workload, plus the predictor's error on the measured iterations."""

    measured: ServingResult
    simulated: object  # SimulationResult
    rows: list[dict[str, float | str]]  # one per metric: measured/simulated p50 and mean, per-request MAPE
    iteration_mape: float  # predictor vs measured latency of the very iterations that ran

    def table(self) -> list[dict[str, float | str]]:
        return self.rows


def request_rows(measured: RequestMetrics, simulated: RequestMetrics) -> list[dict[str, float | str]]:
    """Measured vs simulated per-request TTFT and TPOT (same request ids): p50, mean, per-request MAPE and the
    distribution's error (p10-p90, `stats.quantile_error_pct`)."""
    rows: list[dict[str, float | str]] = []
    for name in ("ttft", "tpot"):
        m = getattr(measured, name)
        s = getattr(simulated, name)
        ok = np.isfinite(m) & np.isfinite(s)
        rows.append(
            {
                "metric": name.upper(),
                "measured_p50": float(np.median(m[ok])) if ok.any() else float("nan"),
                "simulated_p50": float(np.median(s[ok])) if ok.any() else float("nan"),
                "measured_mean": float(m[ok].mean()) if ok.any() else float("nan"),
                "simulated_mean": float(s[ok].mean()) if ok.any() else float("nan"),
                "mape_pct": stats.mape(s, m),
                "quantile_err_pct": stats.quantile_error_pct(s, m),
            }
        )
    for row in rows:
        row["p50_err_pct"] = abs(row["simulated_p50"] - row["measured_p50"]) / row["measured_p50"] * 100
        row["mean_err_pct"] = abs(row["simulated_mean"] - row["measured_mean"]) / row["measured_mean"] * 100
    return rows


def compare(measured: ServingResult, simulated, latency) -> Validation:
    """Line up measured and simulated per-request TTFT and TPOT (same request ids) and score them."""
    rows = request_rows(measured.metrics, simulated.metrics)
    pred = np.array([latency.iteration_latency(b.to_batch()) for b in measured.batches])
    meas = np.array([it.end - it.start for it in measured.iterations])
    return Validation(measured, simulated, rows, stats.mape(pred, meas))
