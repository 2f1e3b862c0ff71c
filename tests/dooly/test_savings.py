"""Savings pricing: a signature nothing is measured of costs what profiling its points at its predicted latency
would, not the DB's mean cost per point."""

from __future__ import annotations

import numpy as np
import pytest
from test_shape_model import TOKENS, mm, roofline

from dooly.db.store import Measurement, ProfileContext, ProfileStore
from dooly.profile import TimerConfig, time_calls
from dooly.profile import timing as timing_mod
from dooly.profile.savings import ModelSignatures, PointCost, estimate_costs, savings_of
from dooly.trace.signature import canonical_json


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


def _onboarding_db(tmp_path):
    """Two models sharing signature s2: "a" calibrated in full (both depths, two rounds), "b" only checked."""
    from dooly.profile.calibrate import CALIBRATION_SHAPES, CHECK_SHAPES, CHECK_SUFFIX
    from dooly.profile.savings import record_models
    from dooly.profile.traces import TRACE_SECONDS

    ctx = ProfileContext("cpu-test", "hf-eager", "default", "bfloat16")
    store = ProfileStore(tmp_path / "p.db")
    for key, cost in (("s1", 1.0), ("s2", 2.0), ("s3", 4.0)):
        store.register_signature(ctx, key, "{}", 1)
        store.put_point(ctx, key, {"tokens": 8}, Measurement(1e-3, 1e-3, 1e-3, 5, cost))
    record_models(store, ctx, [ModelSignatures("a", {"s1": 1, "s2": 1}), ModelSignatures("b", {"s2": 1, "s3": 1})])
    for key in ("a", "a#round2", "a#layers1", "a#layers1#round2"):  # 9 shapes x 4 = 36 forwards of 0.5 s
        for ph, vs in CALIBRATION_SHAPES.items():
            for v in vs:
                store.put_forward(ctx, key, ph, v, Measurement(1e-2, 1e-2, 1e-2, 5, 0.5))
    for ph, vs in CHECK_SHAPES.items():
        for v in vs:
            store.put_forward(ctx, "b" + CHECK_SUFFIX, ph, v, Measurement(1e-2, 1e-2, 1e-2, 5, 0.25))
    store.put_forward(ctx, "b#holdout", "decode", {"requests": 1, "kv_len": 9}, Measurement(1, 1, 1, 5, 99.0))
    for model, s in (("a", 0.3), ("a#layers1", 0.2), ("b", 0.5)):
        store.put_trace(TRACE_SECONDS, model, "hf-eager:bfloat16", f'{{"seconds": {s}}}')
    return store, ctx


def test_onboarding_counts_tracing_profiling_and_calibration_on_both_sides(tmp_path) -> None:
    store, ctx = _onboarding_db(tmp_path)
    with store:
        models = [ModelSignatures("a", {"s1": 1, "s2": 1}), ModelSignatures("b", {"s2": 1, "s3": 1})]
        sv = savings_of(models, store, ctx)
    a, b = sv.models
    # a: its trace (both depths), its points, its 36 forwards, alone and with reuse alike
    assert (a.trace_s, a.profile_alone_s, a.calib_alone_s, a.calib_s) == pytest.approx((0.5, 3.0, 18.0, 18.0))
    # b: its two checked forwards with reuse (validation's held-out forward is no onboarding); alone, a full
    # calibration, estimated from what a's full set cost over the check's shapes (18 s / 1 s)
    assert (b.trace_s, b.profile_s, b.calib_s) == pytest.approx((0.5, 4.0, 0.5))
    assert b.calib_alone_s == pytest.approx(0.5 * 18.0) and sv.calib_estimated == 1
    assert sv.without_reuse_s == pytest.approx(0.5 + 3 + 18 + 0.5 + 6 + 9)
    assert sv.with_reuse_s == pytest.approx(0.5 + 3 + 18 + 0.5 + 4 + 0.5)
    assert sv.saved_pct == pytest.approx(100 * (1 - 26.5 / 37.0))
    assert sv.saved_pct_uncalibrated == pytest.approx(100 * (1 - 8.0 / 10.0))
    text = sv.describe()
    assert text.startswith("2 models: 26.5 device-s with cross-model reuse vs 37.0 device-s each model alone: 28.4%")
    assert "trace 1.0 + profile 7.0 + calibrate 18.5 device-s with reuse, 1.0 + 9.0 + 27.0 alone" in text
    assert "without calibration 8.0 vs 10.0: 20.0% saved" in text and "estimated, not run" in text
    assert "not recorded" not in text


def test_a_plan_prices_the_calibration_its_policy_will_take(tmp_path) -> None:
    store, ctx = _onboarding_db(tmp_path)
    new = [ModelSignatures("c", {"s1": 1, "s3": 1})]  # never calibrated, never traced (an older DB)
    with store:
        by = {p: savings_of(new, store, ctx, known={"s1", "s3"}, calibration=p).models[0] for p in ("all", "check")}
        none = savings_of(new, store, ctx, calibration="none")
    # alone, a full calibration: c's profiling cost times a's ratio of calibration to profiling (18 / 3)
    assert by["all"].calib_alone_s == pytest.approx(5.0 * 6.0) and by["all"].calib_s == by["all"].calib_alone_s
    assert by["check"].calib_s == pytest.approx(30.0 / 18.0)  # the check only: a's full set over its check shapes
    assert none.models[0].calib_s == 0.0 and none.models[0].calib_alone_s == pytest.approx(30.0)
    assert "tracing of 1 model(s) not recorded in this DB: counted as 0" in none.describe()


def test_a_missed_check_is_priced_as_the_calibration_at_its_own_depth(tmp_path) -> None:
    """A model whose check missed took its own depth's round: paid as recorded with reuse, priced alone as the full
    set; a plan under `check` prices every check missing as the check times that round's share of a full set."""
    from dooly.db.store import canonical_point
    from dooly.profile.calibrate import CALIBRATION_SHAPES, CHECK_SHAPES

    store, ctx = _onboarding_db(tmp_path)
    with store:
        checked = {(ph, canonical_point(v)) for ph, vs in CHECK_SHAPES.items() for v in vs}
        for ph, vs in CALIBRATION_SHAPES.items():  # b's round at its own depth: 7 forwards beside its check's 2
            for v in vs:
                if (ph, canonical_point(v)) not in checked:
                    store.put_forward(ctx, "b", ph, v, Measurement(1e-2, 1e-2, 1e-2, 5, 0.25))
        models = [ModelSignatures("a", {"s1": 1, "s2": 1}), ModelSignatures("b", {"s2": 1, "s3": 1})]
        b = savings_of(models, store, ctx).models[1]
        new = [ModelSignatures("c", {"s1": 1, "s3": 1})]
        passing, missing = (
            savings_of(new, store, ctx, calibration="check", missed=miss).models[0] for miss in ((), ("c",))
        )
    assert b.calib_s == pytest.approx(9 * 0.25)  # its check and the 7 forwards after it, nothing more
    assert b.calib_alone_s == pytest.approx(0.5 * 18.0)  # alone: the full set, estimated from its check
    # c: a's full set over its check shapes is 18; its own depth's round over them 9 x 0.5 / 1 = 4.5
    assert passing.calib_s == pytest.approx(30.0 / 18.0) and missing.calib_s == pytest.approx(30.0 / 18.0 * 4.5)
