"""Predictor: per-signature interpolation, method choice, overhead fit, iteration composition."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from test_profile_fixtures import tiny_config, tiny_traces

from dooly.core.batch import Batch
from dooly.core.errors import DoolyError
from dooly.predict.estimators import SignatureModel, choose_method, holdout_errors, method_errors
from dooly.predict.overhead import OverheadModel
from dooly.predict.pages import fresh_output_bytes
from dooly.predict.predictor import Predictor
from dooly.predict.validate import ValidationRow, phase_mape, round_spread


def _law(v: dict) -> float:
    """A latency that is affine in the work, as most kernels are: 5 us + 20 ns per (requests*tokens) + kv."""
    r, t, k = v.get("requests", 1), v.get("tokens", 1), v.get("kv_len", 0)
    return 5e-6 + 2e-8 * r * t * 64 + 1e-9 * r * k * 16


def _grid_points(symbols: tuple[str, ...]) -> list[tuple[dict, float]]:
    axes = {"requests": (1, 2, 4, 8), "tokens": (1, 4, 16, 64, 256), "kv_len": (16, 64, 256, 1024)}
    pts: list[dict] = [{}]
    for s in symbols:
        pts = [{**p, s: v} for p in pts for v in axes[s]]
    return [(p, _law(p)) for p in pts]


def test_interp_exact_on_grid_and_close_between() -> None:
    pts = _grid_points(("requests", "tokens"))
    m = SignatureModel(("requests", "tokens"), pts)
    for p, t in pts:
        assert m(p) == pytest.approx(t, rel=1e-9)
    for v in ({"requests": 3, "tokens": 40}, {"requests": 6, "tokens": 100}):
        assert m(v) == pytest.approx(_law(v), rel=0.08)
    # linear extrapolation in log-log space past the grid stays in the right range
    far = {"requests": 16, "tokens": 512}
    assert m(far) == pytest.approx(_law(far), rel=0.25)
    # a constant signature (no request symbol) is its single point
    assert SignatureModel((), [({}, 3e-6)])({"requests": 7}) == pytest.approx(3e-6)


def test_extrapolation_past_two_ends_does_not_multiply_the_noise() -> None:
    """A view op's four noisy timings (2.6-4.4 us on a 2 x 2 grid) extrapolated 30-fold in requests and 70-fold
    in KV length: multilinear weights past both ends once priced it at 38,622 s. Each axis on its own, never
    downward, it stays microseconds."""
    pts = [({"requests": 1, "kv_len": 4}, 4.4e-6), ({"requests": 2, "kv_len": 4}, 2.79e-6),
           ({"requests": 1, "kv_len": 16}, 2.56e-6), ({"requests": 2, "kv_len": 16}, 3.13e-6)]  # fmt: skip
    m = SignatureModel(("requests", "kv_len"), pts, "interp")
    far = m({"requests": 64, "kv_len": 1100})
    assert 3.13e-6 <= far < 5e-5
    # a slope that points down at the edge (noise) is held flat past it
    assert m({"requests": 64, "kv_len": 4}) == pytest.approx(m({"requests": 2, "kv_len": 4}))
    assert m({"requests": 1, "kv_len": 2000}) == pytest.approx(2.56e-6)


def test_incomplete_grid_still_predicts() -> None:
    pts = _grid_points(("requests", "tokens"))
    pts = [(p, t) for p, t in pts if not (p["requests"] == 8 and p["tokens"] == 256)]
    m = SignatureModel(("requests", "tokens"), pts)
    assert math.isfinite(m({"requests": 8, "tokens": 256}))


def test_method_choice_uses_held_out_error() -> None:
    pts = {"s0": _grid_points(("requests", "tokens"))}
    errs = method_errors(pts)
    assert errs["interp"] and errs["forest"]
    # smooth affine latencies: interpolation beats a forest (which cannot interpolate between leaves)
    assert np.mean(errs["interp"]) < np.mean(errs["forest"])
    assert choose_method(pts) == "interp"
    assert len(holdout_errors(("tokens",), _grid_points(("tokens",)), "interp")) == 3  # interior grid lines


def test_overhead_fit_recovers_a_known_law() -> None:
    rows = []
    for n in (500, 1500, 3000):
        for r in (1, 4, 16):
            ops = 1e-3 * n / 500 * r
            v = {"requests": r, "tokens": 8}
            real = 1.1 * ops + 2e-6 * n + 1e-4
            rows.append(("prefill", ops, n, v, real))
    ov = OverheadModel.fit(rows)
    for _, ops, n, v, real in rows:
        assert ov("prefill", ops, n, v) == pytest.approx(real, rel=0.02)
    assert ov("decode", 0.5, 100, {}) == 0.5  # no forwards for a phase: the op sum alone


def test_an_asynchronous_device_takes_the_longer_of_host_and_kernels() -> None:
    """CUDA: the host queues kernels while earlier ones run, so a pass costs max(kernels, host), not the sum."""
    rows = []
    for n in (1000, 2000, 3000):
        for ops in (0.004, 0.008, 0.050):  # the host needs 10 us per op record: the 50 ms pass is kernel-bound
            rows.append(("decode", ops, n, {"requests": 1, "kv_len": 8}, max(ops, 1e-5 * n + 1e-3)))
    ov = OverheadModel.fit(rows, overlapped=True)
    for _, ops, n, v, real in rows:
        assert ov("decode", ops, n, v) == pytest.approx(real, rel=0.02)
    serial = OverheadModel.fit(rows)  # the CPU's law (kernels after the host) misses such passes
    assert max(abs(serial("decode", ops, n, v) / real - 1) for _, ops, n, v, real in rows) > 0.1


def _predictor(method: str = "interp") -> Predictor:
    traces = tiny_traces(tiny_config("tiny-a"))
    pts = {}
    for tr in traces.values():
        for s in tr.unique():
            pts[s.key] = _grid_points(tuple(sorted(s.symbols())))
    return Predictor("tiny-a", traces, pts, method)


def test_forward_is_the_sum_over_the_trace_with_multiplicities() -> None:
    p = _predictor()
    v = {"requests": 2, "tokens": 16}
    expect = sum(mult * _law({k: v[k] for k in s.symbols()}) for s, mult in p.traces["prefill"].unique().items())
    assert p.ops_latency("prefill", v) == pytest.approx(expect, rel=1e-6)
    assert p.forward_latency("prefill", v) == pytest.approx(expect, rel=1e-6)  # no overhead fitted
    assert not any(p.missing.values())


def test_outputs_above_the_mmap_ceiling_pay_their_page_faults() -> None:
    from dooly.profile.timing import MMAP_MAX_BYTES

    p = _predictor()
    cat = next(s for s in p.traces["decode"].unique() if s.op == "aten.cat.default")
    small, big = {"requests": 2, "kv_len": 64}, {"requests": 64, "kv_len": 16384}
    assert fresh_output_bytes(cat, big) == 64 * 2 * 16385 * 16 * 2  # [requests, 2, kv_len + 1, 16] bfloat16
    assert fresh_output_bytes(cat, small) < MMAP_MAX_BYTES < fresh_output_bytes(cat, big)
    before = {k: p.ops_latency("decode", v) for k, v in (("small", small), ("big", big))}
    p.page_cost_s_per_byte = 1e-9
    assert p.ops_latency("decode", small) == before["small"]  # reused from the heap: no faults
    faults = p.traces["decode"].unique()[cat] * fresh_output_bytes(cat, big) * 1e-9
    assert p.ops_latency("decode", big) == pytest.approx(before["big"] + faults, rel=1e-9)


def test_iteration_latency_composes_chunks_and_decodes() -> None:
    p = _predictor()
    b = Batch(prefill=((16, 0), (4, 32)), decode=(64, 256, 100))
    expect = (
        p.forward_latency("prefill", {"requests": 1, "tokens": 16})
        + p.forward_latency("prefill", {"requests": 1, "tokens": 4})
        + p.forward_latency("decode", {"requests": 3, "kv_len": 256})
    )
    assert p.iteration_latency(b) == pytest.approx(expect)
    assert p.iteration_latency(Batch()) == 0.0
    assert p.iteration_latency(Batch(decode=(10,))) < p.iteration_latency(Batch(decode=(10, 10, 10, 10)))
    f = _predictor("forest")
    assert f.iteration_latency(b) == pytest.approx(expect, rel=0.5)


def test_a_flattening_engine_prices_an_iteration_as_one_forward() -> None:
    """vLLM runs the chunks and the decodes of an iteration as one pass: its token-wise ops once over all
    24 tokens, plus the decodes' KV-dependent attention; cheaper than HF's three separate passes."""
    p = _predictor()
    p.flattens_batches = True
    b = Batch(prefill=((16, 0), (5, 32)), decode=(64, 256, 100))
    kv_part = p.forward_latency("decode", {"requests": 3, "kv_len": 256}) - p.forward_latency(
        "decode", {"requests": 3, "kv_len": 16}
    )
    assert kv_part > 0
    # the later chunk (5 new after 32 cached) also attends over its prefix: the prefill passes' cross term
    f = {t: p.forward_latency("prefill", {"requests": 1, "tokens": t}) for t in (1, 5, 24, 32, 37)}
    prefix = max(0.0, f[37] - f[32] - f[5] + f[1])
    assert prefix > 0
    assert p.prefix_attention(5, 32) == pytest.approx(prefix)
    expect = f[24] + kv_part + prefix
    assert p.iteration_latency(b) == pytest.approx(expect)
    no_prefix = Batch(prefill=((16, 0), (5, 0)), decode=(64, 256, 100))
    assert p.iteration_latency(no_prefix) == pytest.approx(f[24] + kv_part)
    p.flattens_batches = False
    assert p.iteration_latency(b) > expect
    p.flattens_batches = True
    decode_only = Batch(decode=(64, 256))  # no prefill: the decode pass itself, as before
    one_pass = p.forward_latency("decode", {"requests": 2, "kv_len": 256})
    assert p.iteration_latency(decode_only) == pytest.approx(one_pass)


def test_missing_db_and_missing_signatures_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DoolyError, match="no such profile database"):
        Predictor.for_model(tiny_config("tiny-a"), tmp_path / "absent.db")
    from test_profile_fixtures import seed_traces

    db = tmp_path / "p.db"
    seed_traces(db, tiny_config("tiny-a"))
    with pytest.raises(DoolyError, match="have no profile"):
        Predictor.for_model(tiny_config("tiny-a"), db, threads=1)


def test_batch_validates() -> None:
    with pytest.raises(ValueError):
        Batch(prefill=((0, 0),))
    with pytest.raises(ValueError):
        Batch(decode=(-1,))
    b = Batch(prefill=((5, 3),), decode=(7, 8))
    assert b.num_tokens == 7 and b.num_requests == 3 and not b.is_empty


def test_run_to_run_spread_is_the_rounds_disagreement() -> None:
    rows = [
        ValidationRow("prefill", {"tokens": 8}, 1.0, 1.1, (0.9, 1.1)),
        ValidationRow("prefill", {"tokens": 16}, 2.0, 2.0, (2.0, 2.0)),
        ValidationRow("decode", {"kv_len": 8}, 1.0, 1.0, (1.0,)),  # one round: no spread to report
    ]
    assert rows[0].spread == pytest.approx(0.2)
    assert round_spread(rows, "prefill") == pytest.approx(10.0)
    assert math.isnan(round_spread(rows, "decode"))
    assert phase_mape(rows, "prefill") == pytest.approx(5.0)


def test_a_model_with_its_own_calibration_gets_its_own_overhead_fit(tmp_path: Path) -> None:
    import json

    from test_profile_fixtures import seed_traces

    from dooly.db.store import Measurement, ProfileStore
    from dooly.engines import get_engine
    from dooly.predict.overhead import fit_overhead
    from dooly.profile import context_for

    db, engine = tmp_path / "p.db", get_engine()
    pts = {}
    laws = {"tiny-a": (1.0, 0.01), "tiny-b": (3.0, 0.05)}  # real forward = alpha * op sum + per-pass cost
    for name, inter in (("tiny-a", 128), ("tiny-b", 96)):
        cfg = tiny_config(name, inter)
        for tr in seed_traces(db, cfg).values():
            for s in tr.unique():
                pts[s.key] = _grid_points(tuple(sorted(s.symbols())))
    ctx = context_for(engine, 1)
    shapes = {"prefill": [{"requests": 1, "tokens": t} for t in (8, 32, 128)],
              "decode": [{"requests": r, "kv_len": 64} for r in (1, 4, 8)]}  # fmt: skip
    with ProfileStore(db) as st:
        for name, inter in (("tiny-a", 128), ("tiny-b", 96)):
            cfg = tiny_config(name, inter)
            st.put_trace("config", name, "config", json.dumps(cfg))
            pred = Predictor(name, tiny_traces(cfg), pts)
            alpha, c = laws[name]
            for phase, vs in shapes.items():
                for v in vs:
                    real = alpha * pred.ops_latency(phase, v) + c
                    st.put_forward(ctx, name, phase, v, Measurement(real, real, real, 1, real))
        ov_a = fit_overhead(st, ctx, engine, pts, "interp", own="tiny-a", predictor=Predictor)
        ov_joint = fit_overhead(st, ctx, engine, pts, "interp", predictor=Predictor)
    pred_a = Predictor("tiny-a", tiny_traces(tiny_config("tiny-a", 128)), pts)
    v = {"requests": 1, "tokens": 64}
    ops, n = pred_a.ops_latency("prefill", v), pred_a.n_records["prefill"]
    assert ov_a("prefill", ops, n, v) == pytest.approx(ops + 0.01, rel=0.02)
    assert abs(ov_joint("prefill", ops, n, v) - (ops + 0.01)) > 0.05 * (ops + 0.01)  # the other model skews it


def test_half_depth_calibration_predicts_the_architecture_at_another_depth(tmp_path: Path) -> None:
    """Forwards at one depth cannot split a fixed per-pass cost from a per-call one (every pass holds the same
    calls); with the half-depth ones they can, and a deeper model of the same layers, never run, borrows that
    fit and is predicted from the slope."""
    import json

    from test_profile_fixtures import ENGINE

    from dooly.core.zoo import at_depth
    from dooly.db.store import Measurement, ProfileStore
    from dooly.engines import get_engine
    from dooly.predict.overhead import fit_overhead
    from dooly.profile import context_for, trace_cache_key

    engine = get_engine()
    full = tiny_config("tiny-a", layers=4)
    half = at_depth(full, 2)
    deep = {**at_depth(full, 12), "_name_or_path": "tiny-a-deep"}
    pts = {s.key: _grid_points(tuple(sorted(s.symbols()))) for tr in tiny_traces(full).values() for s in tr.unique()}

    def real(p: Predictor, phase: str, v: dict) -> float:  # 0.8 x kernels + 2 ms a pass + 20 us a call
        return 0.8 * p.ops_latency(phase, v) + 2e-3 + 2e-5 * p.records_at(phase, v)

    ctx = context_for(engine, 1)
    shapes = {"prefill": [{"requests": 1, "tokens": t} for t in (8, 32, 128)],
              "decode": [{"requests": r, "kv_len": 64} for r in (1, 4, 8)]}  # fmt: skip
    fits = {}
    for depths in ((("tiny-a", full),), (("tiny-a", full), ("tiny-a#layers2", half))):
        path = tmp_path / f"p{len(depths)}.db"
        with ProfileStore(path) as st:
            for key, cfg in depths:
                st.put_trace("config", key, "config", json.dumps(cfg))
                for phase, tr in tiny_traces(cfg).items():
                    st.put_trace(f"{ENGINE}:bfloat16", trace_cache_key(key, cfg), phase, tr.to_json())
                pred = Predictor(key, tiny_traces(cfg), pts)
                for phase, vs in shapes.items():
                    for v in vs:
                        t = real(pred, phase, v)
                        st.put_forward(ctx, key, phase, v, Measurement(t, t, t, 1, t))
            sigs = Predictor("tiny-a-deep", tiny_traces(deep), pts).signature_keys()
            fits[len(depths)] = fit_overhead(
                st, ctx, engine, pts, "interp", own="tiny-a-deep", signatures=sigs, predictor=Predictor
            )
    p_deep = Predictor("tiny-a-deep", tiny_traces(deep), pts)
    v = {"requests": 4, "kv_len": 256}
    truth = real(p_deep, "decode", v)
    ops, n = p_deep.ops_latency("decode", v), p_deep.records_at("decode", v)
    assert fits[2]("decode", ops, n, v) == pytest.approx(truth, rel=0.02)
    assert abs(fits[1]("decode", ops, n, v) - truth) > 0.05 * truth  # one depth: the split was a guess


def test_an_unknown_method_is_one_error_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(DoolyError, match=r"^unknown predictor method 'tree' \(known: interp, forest\)$"):
        SignatureModel(("requests",), [({"requests": 1}, 1e-6)], "tree")
    with pytest.raises(DoolyError, match=r"^unknown predictor method 'tree' \(known: auto, interp, forest\)$"):
        Predictor.for_model("smollm2-135m", tmp_path / "none.db", method="tree")


def test_a_pipeline_stage_is_calibrated_at_half_depth_only_where_each_stage_keeps_a_layer() -> None:
    """At half depth a 2-layer model has one layer, so its second pipeline stage would have none (vLLM then
    builds no layer its KV cache could serve): that stage is calibrated at its full depth alone."""
    from dooly.profile.calibrate import calibration_variants

    two, four = tiny_config("tiny-a", layers=2), tiny_config("tiny-a", layers=4)
    assert list(calibration_variants("m", two)) == ["m", "m#layers1"]
    assert list(calibration_variants("m", two, stages=2)) == ["m"]
    assert list(calibration_variants("m", four, stages=2)) == ["m", "m#layers2"]


def test_a_tensor_parallel_replica_s_calibration_fits_its_ranks_alone(tmp_path: Path) -> None:
    """A replica's forwards (``NAME@tp2``, :func:`calibrate_replica`) fit its rank's overhead and nothing else:
    the one-device fit, the calibrated models and the savings never read them."""
    import json

    from test_profile_fixtures import ENGINE, seed_traces

    from dooly.db.store import Measurement, ProfileStore
    from dooly.engines import get_engine
    from dooly.predict.overhead import fit_overhead
    from dooly.profile import context_for, model_traces, trace_cache_key
    from dooly.profile.calibrate import calibrated_models, replica_key

    db, engine = tmp_path / "p.db", get_engine()
    cfg = tiny_config("tiny-a", 128)
    seeded = seed_traces(db, cfg)
    pts = {s.key: _grid_points(tuple(sorted(s.symbols()))) for tr in seeded.values() for s in tr.unique()}
    ctx = context_for(engine, 1)
    with ProfileStore(db) as st:  # the replica's passes are the same hand-written traces: nothing is traced
        for phase, tr in seeded.items():
            st.put_trace(f"{ENGINE}:bfloat16", trace_cache_key("tiny-a@tp2", cfg), phase, tr.to_json())
    shapes = {"prefill": [{"requests": 1, "tokens": t} for t in (8, 32, 128)],
              "decode": [{"requests": r, "kv_len": 64} for r in (1, 4, 8)]}  # fmt: skip
    preds = {}
    with ProfileStore(db) as st:
        for key, per_pass in (("tiny-a", 0.01), ("tiny-a@tp2", 0.03)):  # the replica: 20 ms more a pass
            st.put_trace("config", key, "config", json.dumps(cfg))
            preds[key] = Predictor(key, model_traces(key, cfg, engine, st), pts)  # as the fit prices its forwards
            for phase, vs in shapes.items():
                for v in vs:
                    real = preds[key].ops_latency(phase, v) + per_pass
                    st.put_forward(ctx, key, phase, v, Measurement(real, real, real, 1, real))
        one = fit_overhead(st, ctx, engine, pts, "interp", own="tiny-a", predictor=Predictor)
        joint = fit_overhead(st, ctx, engine, pts, "interp", predictor=Predictor)  # every model, replicas left out
        rep = fit_overhead(st, ctx, engine, pts, "interp", own="tiny-a@tp2", replica="tiny-a@tp2", predictor=Predictor)
        assert calibrated_models(st, ctx) == {"tiny-a"}
    v = {"requests": 1, "tokens": 64}
    for key, fitted, per_pass in (("tiny-a", one, 0.01), ("tiny-a", joint, 0.01), ("tiny-a@tp2", rep, 0.03)):
        ops, n = preds[key].ops_latency("prefill", v), preds[key].n_records["prefill"]
        assert fitted("prefill", ops, n, v) == pytest.approx(ops + per_pass, rel=0.02), key
    assert replica_key("m", get_engine("vllm", tp=2)) == "m@tp2" and replica_key("m", engine) is None
    assert replica_key("m", get_engine("vllm", tp=2, pp=2)) is None  # a stage's rank keeps the one-device fit
