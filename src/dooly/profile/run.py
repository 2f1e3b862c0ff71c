"""Running a plan: every job in this process (:class:`~dooly.profile.runner.JobRunner`) or as Ray tasks
(:mod:`dooly.profile.cluster`), then marking the signatures it completed and the models it profiled."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dooly.db.store import ProfileStore
from dooly.engines import Engine
from dooly.profile.cluster import run_on_ray
from dooly.profile.plan import Job, Plan
from dooly.profile.runner import JobRunner
from dooly.profile.savings import record_profiled
from dooly.profile.timing import PAGE_COST_KEY, TimerConfig, clock_of, fixed_threads, measure_page_cost


def _finish(plan: Plan, store: ProfileStore) -> int:
    """Mark every planned signature whose grid is fully measured as complete; return how many are."""
    n = 0
    for key, size in plan.grid_size.items():
        if key in plan.known:
            continue
        if len(store.done_points(plan.ctx, key)) >= size:
            store.mark_complete(plan.ctx, key)
            n += 1
    return n


def run_plan(
    plan: Plan,
    store: ProfileStore,
    engine: Engine,
    *,
    timer: TimerConfig | None = None,
    threads: int | None = None,
    ray_address: str | None = None,
    on_job: Callable[[Job, float], None] | None = None,
) -> dict[str, Any]:
    """Execute the plan's jobs; every finished point is already committed when this returns or dies.

    Returns the run's counts (``points``, ``failed``, ...), ``device_s``, ``wall_s``, ``completed`` (signatures
    now complete) and ``failures``: one line per op that could not be timed standalone in this run."""
    t0 = time.perf_counter()
    if ray_address:
        spent = run_on_ray(plan, store, engine, timer, threads, ray_address, on_job)
        stats: dict[str, Any] = {"failures": []}  # a Ray worker's failures stay in its log
    else:
        runner = JobRunner(engine, store, plan.ctx, timer)
        spent = 0.0
        try:
            with fixed_threads(threads):
                for job in plan.jobs:
                    s = runner.run(job)
                    spent += s
                    if on_job:
                        on_job(job, s)
        finally:
            runner.close()  # the collective workers, if a parallel rank's plan started them
        stats = {**runner.stats, "failures": runner.failures}
        if not engine.device.startswith("cuda") and not store.forwards(plan.ctx, PAGE_COST_KEY[0]):
            # the page faults the op timings leave out, priced once per machine (see timing.reused_pages)
            with fixed_threads(threads):
                store.put_forward(plan.ctx, *PAGE_COST_KEY, measure_page_cost(clock=clock_of(plan.ctx)))
    stats.update({"device_s": spent, "wall_s": time.perf_counter() - t0, "completed": _finish(plan, store)})
    record_profiled(plan, store)
    return stats
