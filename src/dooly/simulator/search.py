"""Configuration search: simulate a grid of engine settings on one workload and pick the best under an SLO.

The best configuration is the one that meets the SLO (p90 TTFT and p90 TPOT at most the given seconds)
with the highest output-token throughput, ties broken by the lower p90 end-to-end latency. Configurations
that cannot serve the workload at all (a prompt above the token budget without chunked prefill) are kept
in the table as infeasible rather than dropped silently. With a memory model, every configuration gets the
KV blocks its own token budget leaves (a larger budget reserves more activation memory), as vLLM would.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from dooly.core.errors import DoolyError
from dooly.simulator.memory import MemoryModel
from dooly.simulator.metrics import Summary
from dooly.simulator.scheduler import SchedulerConfig
from dooly.simulator.simulator import CachedLatency, LatencyModel, PipelineLatency, simulate
from dooly.simulator.workload import Workload


@dataclass(frozen=True)
class SLO:
    ttft_p90: float | None = None  # seconds
    tpot_p90: float | None = None

    def met(self, s: Summary) -> bool:
        ok = True
        if self.ttft_p90 is not None:
            ok &= s.ttft["p90"] <= self.ttft_p90
        if self.tpot_p90 is not None:
            ok &= not (s.tpot["p90"] > self.tpot_p90)  # NaN (all one-token outputs) passes
        return bool(ok)

    def describe(self) -> str:
        parts = []
        if self.ttft_p90 is not None:
            parts.append(f"TTFT p90 <= {self.ttft_p90 * 1e3:g} ms")
        if self.tpot_p90 is not None:
            parts.append(f"TPOT p90 <= {self.tpot_p90 * 1e3:g} ms")
        return ", ".join(parts) or "no SLO"


@dataclass
class SweepPoint:
    config: SchedulerConfig
    summary: Summary | None  # None when infeasible
    meets_slo: bool
    reason: str = ""


def config_grid(
    base: SchedulerConfig,
    max_num_batched_tokens: Iterable[int] = (256, 512, 1024, 2048),
    max_num_seqs: Iterable[int] = (4, 8, 16, 32),
    chunked_prefill: Iterable[bool] = (False, True),
) -> list[SchedulerConfig]:
    return [
        replace(base, max_num_batched_tokens=t, max_num_seqs=s, chunked_prefill=c)
        for t, s, c in itertools.product(max_num_batched_tokens, max_num_seqs, chunked_prefill)
    ]


def sweep(
    workload: Workload,
    latency: LatencyModel,
    configs: list[SchedulerConfig],
    slo: SLO,
    num_replicas: int = 1,
    progress: Callable[[], None] | None = None,
    memory: MemoryModel | None = None,
    router: str = "round_robin",
    router_seed: int = 0,
) -> list[SweepPoint]:
    """Simulate every config (sharing one latency cache, since batch shapes recur across configs). With
    `memory`, each config's ``num_kv_blocks`` is derived from device memory first."""
    cached = latency if isinstance(latency, (CachedLatency, PipelineLatency)) else CachedLatency(latency)
    points = []
    for cfg in configs:
        try:
            if memory is not None:
                cfg = memory.configure(cfg)
            res = simulate(workload, cached, cfg, num_replicas=num_replicas, router=router, router_seed=router_seed)
            points.append(SweepPoint(cfg, res.summary, slo.met(res.summary)))
        except DoolyError as exc:
            points.append(SweepPoint(cfg, None, False, str(exc)))
        if progress is not None:
            progress()
    return points


def best(points: list[SweepPoint]) -> SweepPoint | None:
    ok = [p for p in points if p.meets_slo and p.summary is not None]
    if not ok:
        return None
    return min(ok, key=lambda p: (-p.summary.throughput_tokens, p.summary.e2e["p90"]))
