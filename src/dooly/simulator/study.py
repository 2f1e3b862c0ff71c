"""One ``dooly simulate`` run as a library call: simulate a workload at one configuration, and optionally
sweep configurations under an SLO, with the KV cache sized as :func:`~dooly.simulator.memory.size_kv_cache`
decided. The result carries the payload saved beside the profile DB."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dooly.simulator.memory import KVSizing, MemoryModel
from dooly.simulator.scheduler import SchedulerConfig
from dooly.simulator.search import SLO, SweepPoint, best, config_grid, sweep
from dooly.simulator.simulator import LatencyModel, SimulationResult, simulate
from dooly.simulator.workload import Workload


@dataclass
class Study:
    model: str
    workload: str  # the spec as given
    kv: KVSizing
    replicas: int
    router: str
    result: SimulationResult
    slo: SLO | None = None  # set when configurations were swept
    points: list[SweepPoint] = field(default_factory=list)

    @property
    def best(self) -> SweepPoint | None:
        return best(self.points)

    def payload(self) -> dict[str, Any]:
        cfg, res, plan = self.kv.config, self.result, self.kv.plan
        out = {
            "kind": "simulation",
            "model": self.model,
            "workload": self.workload,
            "config": cfg.label(),
            "num_kv_blocks": cfg.num_kv_blocks,
            "replicas": self.replicas,
            "router": self.router,
            "memory": plan.describe() if plan else None,
            "summary": res.summary.row(),
            "ttft": res.metrics.ttft,
            "e2e": res.metrics.e2e,
        }
        if self.slo is not None:
            top = self.best
            out.update(slo=self.slo.describe(), best=top.config.label() if top else "none meets the SLO")
            out["sweep"] = [_sweep_row(p) for p in self.points]
        return out


def _sweep_row(p: SweepPoint) -> dict[str, Any]:
    s, c = p.summary, p.config
    return {
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "chunked": c.chunked_prefill,
        "num_kv_blocks": c.num_kv_blocks,
        "ttft_p90_s": s.ttft["p90"] if s else float("nan"),
        "tpot_p90_s": s.tpot["p90"] if s else float("nan"),
        "tok_per_s": s.throughput_tokens if s else float("nan"),
        "meets_slo": p.meets_slo,
    }


def run_study(
    model: str,
    workload_spec: str,
    workload: Workload,
    latency: LatencyModel,
    kv: KVSizing,
    memory: MemoryModel | None = None,
    replicas: int = 1,
    router: str = "round_robin",
    router_seed: int = 0,
    slo: SLO | None = None,
    configs: list[SchedulerConfig] | None = None,
    progress: Callable[[], None] | None = None,
) -> Study:
    """Simulate at ``kv.config``; with an ``slo``, also sweep ``configs`` (default: :func:`config_grid` around
    it), each with the KV blocks its own token budget leaves when the blocks come from ``memory``."""
    res = simulate(workload, latency, kv.config, num_replicas=replicas, router=router, router_seed=router_seed)
    study = Study(model, workload_spec, kv, replicas, router, res, slo)
    if slo is not None:
        study.points = sweep(
            workload,
            latency,
            configs or config_grid(kv.config),
            slo,
            replicas,
            progress=progress,
            memory=memory if kv.per_config else None,
            router=router,
            router_seed=router_seed,
        )
    return study
