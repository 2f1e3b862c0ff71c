"""Running a plan's jobs on a Ray cluster (optional: ``ray`` is imported only when an address is given)."""

from __future__ import annotations

from typing import Any

from dooly.core.errors import DoolyError
from dooly.db.store import ProfileStore
from dooly.profile.plan import Job
from dooly.profile.runner import JobRunner
from dooly.profile.timing import TimerConfig, context_for, fixed_threads


def _ray_job(job: Job, db_path: str, engine_spec: dict[str, Any], timer: TimerConfig, threads: int | None) -> float:
    from dooly.engines import get_engine

    engine = get_engine(**engine_spec)
    with ProfileStore(db_path) as store, fixed_threads(threads):
        ctx = context_for(engine, threads)
        runner = JobRunner(engine, store, ctx, timer)
        try:
            return runner.run(job)
        finally:
            runner.close()


def run_on_ray(plan, store, engine, timer, threads, address, on_job) -> float:  # type: ignore[no-untyped-def]
    """Run every job of ``plan`` as a Ray task; returns the device seconds they spent."""
    try:
        import ray  # noqa: PLC0415 - optional, only for distributed profiling
    except ImportError:
        raise DoolyError("--ray-address given but ray is not installed (pip install 'ray[default]')") from None
    ray.init(address=address, ignore_reinit_error=True)
    # workers share the DB file: one host (or a shared filesystem) and SQLite's WAL serialise the writes.
    # Each worker's hardware fingerprint is its own, so a heterogeneous cluster never mixes timings.
    remote = ray.remote(num_cpus=threads or 1)(_ray_job)
    spec = {"name": engine.name, "device": engine.device, "dtype": getattr(engine, "dtype", "float32")}
    if getattr(engine, "tp", 1) * getattr(engine, "pp", 1) > 1:  # the rank of a parallel replica it profiles
        spec.update(tp=engine.tp, pp=engine.pp, pp_stage=engine.stage)  # type: ignore[attr-defined]
    futures = {remote.remote(job, str(store.path), spec, timer or TimerConfig(), threads): job for job in plan.jobs}
    spent = 0.0
    pending = list(futures)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        s = float(ray.get(ready[0]))
        spent += s
        if on_job:
            on_job(futures[ready[0]], s)
    return spent
