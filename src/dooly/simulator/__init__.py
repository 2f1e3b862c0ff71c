"""dooly's serving simulator, cut as Vidur's is: entities, events, a replica scheduler, workloads, metrics."""

from dooly.simulator.entities import KVCache, Request, ScheduledBatch
from dooly.simulator.metrics import RequestMetrics, Summary, mape, summarize
from dooly.simulator.scheduler import ReplicaScheduler, SchedulerConfig
from dooly.simulator.simulator import CachedLatency, LatencyModel, SimulationResult, simulate
from dooly.simulator.workload import Workload, generate_workload, load_workload, parse_workload

__all__ = [
    "CachedLatency",
    "KVCache",
    "LatencyModel",
    "ReplicaScheduler",
    "Request",
    "RequestMetrics",
    "ScheduledBatch",
    "SchedulerConfig",
    "SimulationResult",
    "Summary",
    "Workload",
    "generate_workload",
    "load_workload",
    "mape",
    "parse_workload",
    "simulate",
    "summarize",
]
