"""The discrete-event loop: arrivals and iteration ends on one heap, one scheduler per replica.

Each replica runs one iteration at a time (one per stage of a pipeline, below); when it ends, the scheduler
applies it and picks the next.
Iteration latency comes from any object with ``iteration_latency(batch) -> seconds`` (dooly's Predictor,
or an analytic stand-in in tests). A router (:mod:`dooly.simulator.router`) sends each arriving request to a
replica: round-robin by default, as Vidur's default global scheduler does. The only randomness is the
``random`` router's seeded generator, so a workload, a config and a seed always give the same result.

A replica of M pipeline stages (a :class:`PipelineLatency`: one latency model per stage, each a rank of its stage,
its send or receive of the hidden states included) keeps up to M batches in flight, as vLLM v1's batch queue does
(``EngineCore.step_with_batch_queue``). What is modelled:

* the engine schedules a batch whenever fewer than M are in flight, at the instant the last one left the
  scheduler, an arrival came or a batch completed; the scheduler skips a request whose next token is in flight
  (see :mod:`dooly.simulator.scheduler`);
* a schedule that finds nothing while batches are in flight makes the engine wait for the oldest one (vLLM queues
  the empty step and blocks on the oldest future), so arrivals meanwhile wait for that completion;
* each stage runs one batch at a time, in the order they were scheduled; a batch enters stage s+1 when stage s
  finished it and stage s+1 is free; its latency on each stage is that stage's model at the batch's shape;
* a batch completes (its tokens sampled, its requests' KV released when they finish) when the last stage ends.

Not modelled: the time to hand a batch from one stage's process to the next beyond the send/recv ops priced in
the stages' traces, the sampled tokens' broadcast back to the first stage, and async scheduling.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from dooly.core.batch import Batch
from dooly.core.errors import DoolyError
from dooly.simulator.entities import IterationRecord, Request, ScheduledBatch
from dooly.simulator.events import EventKind, EventQueue
from dooly.simulator.metrics import RequestMetrics, Summary, summarize
from dooly.simulator.router import Router, make_router
from dooly.simulator.scheduler import ReplicaScheduler, SchedulerConfig
from dooly.simulator.workload import Workload


class LatencyModel(Protocol):
    def iteration_latency(self, batch: Batch) -> float: ...


class CachedLatency:
    """Memoises a latency model on the batch shape (order of requests inside a batch does not matter)."""

    def __init__(self, model: LatencyModel) -> None:
        self.model = model
        self._cache: dict[tuple, float] = {}
        self.calls = 0

    def iteration_latency(self, batch: Batch) -> float:
        return self._lookup(tuple(sorted(batch.prefill)), tuple(sorted(batch.decode)))

    def scheduled_latency(self, batch: ScheduledBatch) -> float:
        """Latency of a scheduled iteration without building a Batch unless the shape is new (hot path)."""
        return self.pending_latency(batch, {})

    def pending_latency(self, batch: ScheduledBatch, ahead: Mapping[int, int]) -> float:
        """As :meth:`scheduled_latency`, with ``ahead``: tokens of each request still in a pipeline, which its
        prefill chunk comes after."""
        prefill = tuple(sorted((n, r.computed + ahead.get(r.id, 0)) for r, n in batch.prefill))
        return self._lookup(prefill, tuple(sorted(r.computed for r in batch.decode)))

    def _lookup(self, prefill: tuple, decode: tuple) -> float:
        key = (prefill, decode)
        hit = self._cache.get(key)
        if hit is None:
            self.calls += 1
            shape = Batch(prefill=prefill, decode=decode)
            hit = float(self.model.iteration_latency(shape))
            if not hit >= 0:
                raise ValueError(f"latency model returned {hit} s for {shape}")
            self._cache[key] = hit
        return hit


class PipelineLatency:
    """A replica of pipeline stages: each stage's iteration latency from its own model (one rank of the stage)."""

    def __init__(self, stages: Sequence[LatencyModel]) -> None:
        if not stages:
            raise DoolyError("a pipeline needs at least one stage")
        cached: dict[int, CachedLatency] = {}  # one cache per model: stages that share a model share its cache
        for s in stages:
            if id(s) not in cached:
                cached[id(s)] = s if isinstance(s, CachedLatency) else CachedLatency(s)
        self.stages = [cached[id(s)] for s in stages]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_latencies(self, batch: Batch) -> list[float]:
        """Seconds each stage takes over ``batch``."""
        return [s.iteration_latency(batch) for s in self.stages]

    def iteration_latency(self, batch: Batch) -> float:
        """One batch alone through every stage (no other batch in the pipeline)."""
        return sum(self.stage_latencies(batch))


@dataclass
class SimulationResult:
    requests: list[Request]
    iterations: list[IterationRecord]
    metrics: RequestMetrics
    summary: Summary
    config: SchedulerConfig
    num_replicas: int = 1

    def replica_counts(self) -> list[int]:
        """Requests routed to each replica."""
        counts = [0] * self.num_replicas
        for r in self.requests:
            counts[r.replica] += 1
        return counts


def simulate(
    workload: Workload,
    latency: LatencyModel,
    config: SchedulerConfig | None = None,
    num_replicas: int = 1,
    on_iteration: Callable[[IterationRecord], None] | None = None,
    router: str | Router = "round_robin",
    router_seed: int = 0,
) -> SimulationResult:
    """Serve `workload` on `num_replicas` replicas with `config`, each request sent to the replica `router`
    picks (a name from ``dooly.simulator.router.ROUTERS``, seeded by `router_seed`, or a Router object);
    returns per-request and summary metrics."""
    config = config or SchedulerConfig()
    if num_replicas < 1:
        raise DoolyError(f"num_replicas must be >= 1, got {num_replicas}")
    route = make_router(router, router_seed) if isinstance(router, str) else router
    # a replica is a pipeline of stages (one, unless ``latency`` is a PipelineLatency): up to one batch in flight
    # per stage, each stage one batch at a time, in order (see the module docstring)
    if isinstance(latency, PipelineLatency):
        stages = latency.stages
    else:
        stages = [latency if isinstance(latency, CachedLatency) else CachedLatency(latency)]
    depth = len(stages)
    schedulers = [ReplicaScheduler(config) for _ in range(num_replicas)]
    flight: list[deque[tuple[ScheduledBatch, float]]] = [deque() for _ in range(num_replicas)]
    free = [[0.0] * depth for _ in range(num_replicas)]  # when each stage finishes what it was given
    blocked = [False] * num_replicas  # an empty schedule: the engine waits for its oldest batch
    requests = workload.requests()
    iterations: list[IterationRecord] = []
    events = EventQueue()
    for req in requests:
        events.push(req.arrival, EventKind.ARRIVAL, payload=req)

    def fill(rep: int, now: float) -> None:
        sched = schedulers[rep]
        while not blocked[rep] and len(flight[rep]) < depth and sched.has_work:
            batch = sched.schedule()
            if batch.is_empty:
                if not flight[rep]:
                    raise RuntimeError(f"replica {rep} has work but scheduled nothing (scheduler bug)")
                blocked[rep] = True
                return
            for req, _ in batch.prefill:
                if req.first_scheduled is None:
                    req.first_scheduled = now
            t, ends = now, free[rep]
            for s, stage in enumerate(stages):  # priced before dispatch: its own tokens are not ahead of it
                t = ends[s] = max(t, ends[s]) + stage.pending_latency(batch, sched.inflight)
            sched.dispatch(batch)
            flight[rep].append((batch, now))
            events.push(t, EventKind.BATCH_END, replica=rep, payload=batch)

    while events:
        ev = events.pop()
        if ev.kind is EventKind.ARRIVAL:
            req: Request = ev.payload
            req.replica = route.route(req, schedulers)
            schedulers[req.replica].add(req)
        else:
            rep = ev.replica
            batch, start = flight[rep].popleft()
            if batch is not ev.payload:
                raise RuntimeError(f"replica {rep}: batches left the pipeline out of order (simulator bug)")
            sched = schedulers[rep]
            rec = IterationRecord.of(batch, sched.kv, rep, start, ev.time)
            iterations.append(rec)
            if on_iteration is not None:
                on_iteration(rec)
            sched.settle(batch)
            sched.complete(batch, ev.time)
            blocked[rep] = False
        # idle stages start once every event of this instant is in (simultaneous arrivals batch together)
        if not events or events.peek_time() > ev.time:
            for rep in range(num_replicas):
                fill(rep, ev.time)
    metrics = RequestMetrics.from_requests(requests)
    return SimulationResult(requests, iterations, metrics, summarize(metrics, iterations), config, num_replicas)
