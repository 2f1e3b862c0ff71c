"""Ops that cannot be timed standalone are reported per run, never carried over to the next run (issue 44)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from test_profile_fixtures import seed_traces, tiny_config

from dooly.db.store import ProfileStore
from dooly.engines import get_engine
from dooly.profile import GridSpec, TimerConfig, make_plan, run_plan

FAST = TimerConfig(warmup=1, repeats=3, min_sample_s=0.0, max_inner=1, budget_s=0.05)


def test_each_run_reports_its_own_failures(tmp_path: Path) -> None:
    db, cfg = tmp_path / "p.db", tiny_config("tiny-a")
    seed_traces(db, cfg)
    engine = get_engine()
    with ProfileStore(db) as st:
        plan = make_plan([cfg], st, engine, GridSpec((1,), (4,), (1,), (4,)), threads=1)
        job = plan.jobs[0]
        key, sig_json, point = job.items[0]
        sig = {**json.loads(sig_json), "op": "aten.no_such_op.default"}  # cannot be resolved: one failure
        plan.jobs = [replace(job, items=((key, json.dumps(sig), point),))]
        first = run_plan(plan, st, engine, timer=FAST, threads=1)
        second = run_plan(plan, st, engine, timer=FAST, threads=1)
    assert first["failed"] == second["failed"] == 1
    assert len(first["failures"]) == len(second["failures"]) == 1
    assert "no_such_op" in second["failures"][0]
