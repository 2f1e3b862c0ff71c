"""Savings pricing: a signature nothing is measured of costs what profiling its points at its predicted latency
would, not the DB's mean cost per point."""

from __future__ import annotations

import numpy as np
import pytest
from test_shape_model import TOKENS, mm, roofline

from dooly.profiler import TimerConfig, time_calls
from dooly.profiler import timing as timing_mod
from dooly.profiler.savings import ModelSignatures, PointCost, estimate_costs, savings_of
from dooly.signature import canonical_json
from dooly.store import Measurement, ProfileContext, ProfileStore


@pytest.mark.parametrize("t", [1e-7, 3e-6, 5e-5, 2e-4, 0.1, 0.4, 2.0])
def test_point_cost_counts_the_calls_time_calls_makes(t, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setitem(timing_mod.CLOCKS, "fake", lambda: t * len(calls))  # each call of the op takes exactly t
    time_calls(lambda i: calls.append(i), "cpu", TimerConfig(), "fake")
    assert PointCost(0.0, 1.0).calls(np.array([t]))[0] == len(calls)


def test_point_cost_fit_recovers_its_overhead_and_scale() -> None:
    truth = PointCost(0.02, 1.3)
    t = np.geomspace(1e-7, 0.5, 40)
    fitted = PointCost.fit(t, truth(t))
    assert fitted.c0 == pytest.approx(0.02, rel=1e-6) and fitted.c1 == pytest.approx(1.3, rel=1e-6)


def test_an_unmeasured_large_signature_is_priced_by_its_predicted_latency(tmp_path) -> None:
    ctx = ProfileContext("cpu-test")
    truth = PointCost(0.01, 1.0)
    small = [mm(k, n) for k, n in ((64, 64), (64, 256), (256, 64), (128, 512), (512, 128), (256, 256))]
    big = mm(4096, 4096)  # 100x the largest measured matmul's work per token
    with ProfileStore(tmp_path / "p.db") as store:
        for s in small:
            store.register_signature(ctx, s.key, canonical_json(s.to_dict()), len(TOKENS))
            for tok in TOKENS:
                lat = roofline(s, tok)
                store.put_point(ctx, s.key, {"tokens": tok}, Measurement(lat, lat, lat, 5, float(truth(lat))))
            store.mark_complete(ctx, s.key)
        grid = [{"tokens": t} for t in TOKENS]
        est = estimate_costs(store, ctx, {big.key: (big, grid)})
        exact = float(truth(np.array([roofline(big, t) for t in TOKENS])).sum())
        assert est[big.key] == pytest.approx(exact, rel=0.1)
        measured = store.signature_costs(ctx)
        mean_price = len(TOKENS) * sum(measured.values()) / (len(TOKENS) * len(small))
        assert est[big.key] > 3 * mean_price  # what the mean cost per point would have under-priced
        models = [ModelSignatures("a", {s.key: len(TOKENS) for s in small}), ModelSignatures("b", {big.key: 5})]
        sv = savings_of(models, store, ctx, estimated=est)
        assert sv.models[1].alone_s == pytest.approx(est[big.key]) and sv.mean_priced_share == 0.0
        assert savings_of(models, store, ctx).mean_priced_share == pytest.approx(1 / 7)
