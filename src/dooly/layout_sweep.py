"""`dooly simulate --sweep-layouts`: every tensor x pipeline x replica layout of a fixed number of devices, priced
and simulated, and the pick (the layout meeting the SLO at the highest throughput per device). Vidur's configuration
search, without per-model code: each stage's rank comes from vLLM's own sharding (:mod:`dooly.engines.vllm_parallel`),
priced from the profile DB and the shape model (:func:`dooly.api.stage_latency_models`); the layouts and vLLM's
refusals come from :mod:`dooly.simulator.layouts`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dooly.api import (
    SIM_WORKLOAD,
    VLLM_BLOCK_SIZE,
    ServeHooks,
    memory_model,
    replica_latency,
    resolved,
    stage_latency_models,
    warm_traces,
)
from dooly.core.errors import DoolyError

if TYPE_CHECKING:
    from dooly.core.zoo import ModelSpec
    from dooly.predict.predictor import Predictor
    from dooly.simulator import SchedulerConfig
    from dooly.simulator.layouts import Layout
    from dooly.simulator.metrics import Summary


@dataclass
class LayoutPoint:
    """One layout of a :func:`sweep_layouts`: why it cannot run (``reason``), else what the simulator answered,
    with the collectives' share of a replica's operator time in a full prefill and a full decode iteration (every
    stage's ranks together)."""

    layout: Layout
    reason: str = ""
    fits: bool = True
    kv_blocks: int = 0
    summary: Summary | None = None
    collectives_prefill: float = float("nan")
    collectives_decode: float = float("nan")
    meets_slo: bool = False
    stages: str = ""  # layers per pipeline stage, as vLLM splits them ("27+27+26")
    notes: list[str] = field(default_factory=list)  # how its collectives were priced

    @property
    def throughput_per_device(self) -> float:
        return self.summary.throughput_tokens / self.layout.devices if self.summary else float("nan")

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {
            "layout": self.layout.label(),
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "replicas": self.layout.replicas,
            "fits": self.fits,
            "reason": self.reason,
            "kv_blocks": self.kv_blocks,
            "layers_per_stage": self.stages,
            "ttft_p90_s": s.ttft["p90"] if s else float("nan"),
            "tpot_p90_s": s.tpot["p90"] if s else float("nan"),
            "tok_per_s": s.throughput_tokens if s else float("nan"),
            "tok_per_s_per_device": self.throughput_per_device,
            "collectives_prefill": self.collectives_prefill,
            "collectives_decode": self.collectives_decode,
            "meets_slo": self.meets_slo,
        }


@dataclass
class LayoutSweep:
    """What :func:`sweep_layouts` found: every layout of ``devices`` devices, the SLO, and notes on the pricing
    (collectives extrapolated past the group sizes measured)."""

    model: str
    devices: int
    workload: str
    config: str
    slo: Any
    points: list[LayoutPoint]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def best(self) -> LayoutPoint | None:
        """The layout that meets the SLO at the highest throughput per device (ties: the lower p90 end-to-end)."""
        ok = [p for p in self.points if p.meets_slo and p.summary is not None]
        if not ok:
            return None
        return min(ok, key=lambda p: (-p.throughput_per_device, p.summary.e2e["p90"]))  # type: ignore[union-attr]

    def payload(self) -> dict[str, Any]:
        top = self.best
        return {
            "kind": "layout-sweep",
            "model": self.model,
            "devices": self.devices,
            "workload": self.workload,
            "config": self.config,
            "slo": self.slo.describe(),
            "best": top.layout.label() if top else "none meets the SLO",
            "layouts": [p.row() for p in self.points],
            "notes": self.notes,
            "seconds": self.seconds,
        }


def _replica_collectives(stages: Sequence[Predictor], cfg: SchedulerConfig, kv_len: int = 256) -> tuple[float, float]:
    """The collectives' share of a replica's operator time (all stages) in a full prefill and a full decode."""
    out = []
    for phase, values in (
        ("prefill", {"requests": 1, "tokens": cfg.max_num_batched_tokens}),
        ("decode", {"requests": cfg.max_num_seqs, "kv_len": kv_len}),
    ):
        ops = [p.ops_latency(phase, values) for p in stages]
        coll = sum(p.collectives_share(phase, values) * t for p, t in zip(stages, ops, strict=True))
        out.append(coll / sum(ops) if sum(ops) else 0.0)
    return out[0], out[1]


def sweep_layouts(
    model: str | ModelSpec,
    db: Path,
    *,
    devices: int,
    workload: str = SIM_WORKLOAD,
    max_seqs: int = 32,
    max_tokens: int = 2048,
    block_size: int | None = None,
    memory_gb: float | None = None,
    gpu_util: float = 0.9,
    kv_cache_dtype: str = "auto",
    activation_gb: float | None = None,
    kv_blocks: int | None = None,
    router: str = "round_robin",
    router_seed: int = 0,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    dtype: str = "bfloat16",
    engine: str = "vllm",
    max_pp: int | None = None,
    method: str = "interp",
    save: bool = True,
    hooks: ServeHooks | None = None,
) -> LayoutSweep:
    """`dooly simulate --sweep-layouts`: every (tp, pp, replicas) of ``devices`` devices
    (:func:`~dooly.simulator.layouts.enumerate_layouts`), the ones vLLM refuses named with its reason, the ones
    whose weights and KV cache do not fit in ``memory_gb`` GiB per device marked so, and every other one simulated
    on ``workload`` with vLLM v1's scheduler (``max_seqs``, ``max_tokens`` per replica; requests spread over the
    replicas by ``router``). The pick meets the SLO at the highest throughput per device.

    Each stage's rank is priced from the DB with the shape model for what was never profiled (a layout is rarely
    profiled whole), and its collectives from the ring model over the group sizes measured
    (:mod:`dooly.predict.collectives`, extrapolations listed in ``notes``). The stages' traces are cached in the DB.
    ``method``: the estimator between grid points (interp by default: a layout priced from shape has grid points
    only; auto chooses on the DB's points, which costs seconds of forest fits)."""
    from dooly.report import save_result
    from dooly.simulator import make_router, parse_workload, vllm_v1_config
    from dooly.simulator.layouts import enumerate_layouts
    from dooly.simulator.memory import DEFAULT_KV_BLOCKS
    from dooly.simulator.search import SLO

    t0 = time.perf_counter()
    hooks = hooks or ServeHooks()
    if engine != "vllm":
        raise DoolyError(f"--sweep-layouts needs --engine vllm (tensor and pipeline parallel ranks), not {engine}")
    make_router(router)
    w = parse_workload(workload)
    spec = resolved(model)
    base = vllm_v1_config(max_seqs, max_tokens, block_size or VLLM_BLOCK_SIZE, DEFAULT_KV_BLOCKS)
    limits = (memory_gb, gpu_util, kv_cache_dtype, activation_gb, kv_blocks)
    slo = SLO(slo_ttft, slo_tpot)
    layouts = enumerate_layouts(devices, max_pp)
    points: list[LayoutPoint] = []
    notes: dict[str, None] = {}
    chosen = [method]  # auto: chosen on the DB's points by the first layout priced, then kept
    with hooks.bars() as task:
        advance = task(f"simulating {len(layouts)} layouts of {devices} devices", len(layouts))
        for lay in layouts:
            point = _layout_point(spec, db, lay, w, base, limits, dtype, router, router_seed, chosen)
            if point.summary is not None:
                point.meets_slo = slo.met(point.summary)
            notes.update(dict.fromkeys(point.notes))
            points.append(point)
            advance(1)
    sweep = LayoutSweep(str(model), devices, workload, base.label(), slo, points, list(notes))
    sweep.seconds = time.perf_counter() - t0
    if save:
        save_result(db, f"layouts-{Path(str(model)).stem}-{devices}", sweep.payload())
    return sweep


def _layout_point(
    spec: str | ModelSpec,
    db: Path,
    lay: Layout,
    w: Any,
    base: SchedulerConfig,
    limits: tuple,
    dtype: str,
    router: str,
    router_seed: int,
    method: list[str],
) -> LayoutPoint:
    """One layout of :func:`sweep_layouts`: refused, not fitting, or simulated (``limits``: memory GiB per device,
    utilisation, KV dtype, activation reserve, explicit KV blocks)."""
    from dooly.core.zoo import num_layers, resolve_model
    from dooly.simulator.layouts import pp_partition, vllm_refusal
    from dooly.simulator.memory import size_kv_cache
    from dooly.simulator.simulator import simulate as run_sim

    memory_gb, gpu_util, kv_cache_dtype, activation_gb, kv_blocks = limits
    point = LayoutPoint(lay)
    cfg = resolve_model(spec)[1]
    why = vllm_refusal(cfg, lay.tp, lay.pp)
    if why:
        point.reason, point.fits = f"vLLM refuses it: {why}", False
        return point
    if lay.pp > 1:
        point.stages = "+".join(map(str, pp_partition(num_layers(cfg) or 0, lay.pp)))
    mem = None
    if memory_gb is not None:  # each device holds 1/(tp x pp) of the weights and of the KV cache
        per_replica = memory_gb * lay.devices_per_replica
        mem = memory_model(spec, per_replica, gpu_util, dtype, kv_cache_dtype, activation_gb, "vllm")
    try:
        kv = size_kv_cache(base, mem, kv_blocks)
    except DoolyError as exc:
        point.reason, point.fits = f"does not fit: {exc}", False
        return point
    point.kv_blocks = kv.config.num_kv_blocks
    warm_traces(spec, db, "vllm", dtype, lay.tp, lay.pp)
    try:
        stages, _ = stage_latency_models(spec, db, dtype, None, "vllm", True, lay.tp, lay.pp, method=method[0])
        method[0] = stages[0].method
    except DoolyError as exc:  # a signature neither profiled nor covered by a shape model: said, not hidden
        point.reason = f"cannot price it: {exc}"
        return point
    point.notes = list(dict.fromkeys(n for pred in stages for n in pred.collective_notes))
    point.collectives_prefill, point.collectives_decode = _replica_collectives(stages, kv.config)
    try:
        res = run_sim(w, replica_latency(stages), kv.config, lay.replicas, router=router, router_seed=router_seed)
    except DoolyError as exc:  # a request a replica can never hold
        point.reason = str(exc)
    else:
        point.summary = res.summary
    return point
