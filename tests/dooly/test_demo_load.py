"""`dooly demo`'s sweep runs at a load where the engine configurations differ."""

from __future__ import annotations

from pathlib import Path

import dooly.api
from dooly.core.batch import Batch
from dooly.demo import SIM_REQUESTS, queueing_rate
from dooly.simulator import SchedulerConfig, parse_workload
from dooly.simulator.search import SLO, config_grid, sweep


class Linear:
    def iteration_latency(self, batch: Batch) -> float:
        return 0.02 + 2e-4 * batch.num_tokens + 2e-6 * sum(batch.decode)


def test_sweep_rows_differ_at_the_demo_load(monkeypatch):
    monkeypatch.setattr(dooly.api, "load_latency_model", lambda model, db, *a, **k: Linear())
    rate = queueing_rate(Path("unused.db"), "smollm2-135m")
    rows = {}
    for r in (rate / 10, rate):
        w = parse_workload(f"poisson:rate={r:g},{SIM_REQUESTS}")
        pts = sweep(w, Linear(), config_grid(SchedulerConfig(), max_num_batched_tokens=(512,)), SLO(None, None))
        rows[r] = {p.config.max_num_seqs: round(p.summary.ttft["p90"], 3) for p in pts if not p.config.chunked_prefill}
    light, loaded = rows[rate / 10], rows[rate]
    assert len(set(light.values())) <= 2  # far below capacity the configurations hardly differ
    assert loaded[4] > 3 * loaded[32]  # at the demo's load the small batch limit queues
    assert len(set(loaded.values())) == 4
