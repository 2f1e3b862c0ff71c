"""dooly's serving simulator, cut as Vidur's is: entities, events, a replica scheduler, a router across replicas,
workloads, metrics, and KV-cache sizing from device memory."""

from dooly.simulator.entities import KVCache, Request, ScheduledBatch
from dooly.simulator.memory import KVLayout, MemoryModel, MemoryPlan, cpu_kv_blocks, kv_layout
from dooly.simulator.metrics import RequestMetrics, Summary, summarize
from dooly.simulator.router import ROUTERS, Router, make_router
from dooly.simulator.scheduler import (
    SCHEDULING_POLICIES,
    ReplicaScheduler,
    SchedulerConfig,
    scheduling_policy,
    vllm_v1_config,
)
from dooly.simulator.simulator import CachedLatency, LatencyModel, PipelineLatency, SimulationResult, simulate
from dooly.simulator.workload import Workload, generate_workload, load_workload, parse_workload

__all__ = [
    "ROUTERS",
    "SCHEDULING_POLICIES",
    "CachedLatency",
    "KVCache",
    "KVLayout",
    "LatencyModel",
    "MemoryModel",
    "MemoryPlan",
    "PipelineLatency",
    "ReplicaScheduler",
    "Request",
    "RequestMetrics",
    "Router",
    "ScheduledBatch",
    "SchedulerConfig",
    "SimulationResult",
    "Summary",
    "Workload",
    "cpu_kv_blocks",
    "generate_workload",
    "kv_layout",
    "load_workload",
    "make_router",
    "parse_workload",
    "scheduling_policy",
    "simulate",
    "summarize",
    "vllm_v1_config",
]
