"""Code that branches on a request size: every side traced, each exact where its guards hold, and priced there."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_tracer import OTHER_ARCHS, traced_and_real_ops

from dooly.core.errors import DoolyError
from dooly.engines import get_engine
from dooly.predict.predictor import Predictor
from dooly.trace.signature import ModelTrace, eval_guard

# gemma2 with a 64-token sliding window: past the window its cache keeps only the window, so the decode step's
# ops change with kv_len (the branch torch records as the guard `kv_len >= 64`)
WINDOWED = OTHER_ARCHS["gemma2"][0]


@pytest.fixture(scope="module")
def windowed_plan(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The windowed model planned into a fresh DB (tracing both phases once for the whole module)."""
    from test_profiler import GRID

    from dooly.db.store import ProfileStore
    from dooly.profile import make_plan

    cfg = {**WINDOWED, "_name_or_path": "windowed"}
    db = tmp_path_factory.mktemp("branches") / "p.db"
    with ProfileStore(db) as st:
        plan = make_plan([cfg], st, get_engine(), GRID, threads=1)
    return cfg, db, plan


@pytest.fixture(scope="module")
def windowed_decode(windowed_plan) -> ModelTrace:  # noqa: ANN001
    return windowed_plan[2].models[0].traces["decode"]


def test_each_side_of_a_length_branch_is_traced_with_its_own_guards(windowed_decode: ModelTrace) -> None:
    tr = windowed_decode
    assert tr.guards == ["kv_len >= 64"] and tr.sides
    below = tr.at({"requests": 3, "kv_len": 20})
    assert below is not tr and below.hints["kv_len"] < 62 and "kv_len < 62" in below.guards
    assert len(below.records) != len(tr.records)  # the ops differ, not just the sizes
    assert tr.at({"requests": 5, "kv_len": 1000}) is tr
    # every traced size lies in exactly the branch traced there, and each branch's guards hold at its own hints
    for b in tr.branches():
        assert all(eval_guard(g, b.hints) for g in b.guards)
        assert tr.at(b.hints) is b
    # the signatures a plan profiles are those of every branch
    assert set(tr.all_unique()) == set().union(*(b.unique() for b in tr.branches()))


@pytest.mark.parametrize("kv_len", [20, 63, 64, 200])
def test_each_branch_matches_a_real_run_inside_its_region(windowed_decode: ModelTrace, kv_len: int) -> None:
    """Not only at the size each branch was traced at: anywhere its guards hold (20 and 200 were never traced)."""
    values = {"requests": 2, "kv_len": kv_len}
    branch = windowed_decode.at(values)
    assert all(eval_guard(g, values) for g in branch.guards)
    engine = get_engine()
    torch.manual_seed(0)
    model = engine.build_model(WINDOWED)
    traced, real = traced_and_real_ops(engine, model, dataclasses.replace(branch, hints=values))
    assert traced == [op for op in real if op[0] != "aten.alias.default"]


def test_sides_survive_json_and_bad_guards_are_refused(windowed_decode: ModelTrace) -> None:
    back = ModelTrace.from_json(windowed_decode.to_json())
    assert [b.guards for b in back.branches()] == [b.guards for b in windowed_decode.branches()]
    assert [b.unique() for b in back.branches()] == [b.unique() for b in windowed_decode.branches()]
    doc = json.loads(windowed_decode.to_json())
    doc["sides"][0]["guards"] = ["__import__('os')"]
    with pytest.raises(DoolyError, match="bad guard"):
        ModelTrace.from_json(json.dumps(doc), "t.json")
    doc["sides"][0]["guards"] = []
    doc["sides"][0]["sides"] = [doc["sides"][1]]
    with pytest.raises(DoolyError, match="one level deep"):
        ModelTrace.from_json(json.dumps(doc), "t.json")


def test_guards_evaluate_with_the_expression_grammar() -> None:
    assert eval_guard("kv_len + 1 >= 64", {"kv_len": 63})
    assert not eval_guard("(kv_len < 62) and (kv_len + tokens >= 63)", {"kv_len": 10, "tokens": 5})
    assert eval_guard("(tokens == 63) or (16 - (tokens)%(16) > 2)", {"tokens": 20})
    for bad in ("kv_len", "kv_len < 2 < 3", "open('x') == 1", "kv_len <"):
        with pytest.raises(DoolyError, match="bad guard"):
            eval_guard(bad, {"kv_len": 1})


def test_the_predictor_prices_the_branch_whose_guards_hold(windowed_decode: ModelTrace) -> None:
    # every signature costs 1 us per call: a pass's operator time is its number of calls
    points = {s.key: [({k: 1 for k in s.symbols()}, 1e-6)] for s in windowed_decode.all_unique()}
    p = Predictor("windowed", {"decode": windowed_decode}, points, "interp")
    for kv, branch in ((20, windowed_decode.at({"requests": 2, "kv_len": 20})), (500, windowed_decode)):
        v = {"requests": 2, "kv_len": kv}
        assert p.ops_latency("decode", v) == pytest.approx(1e-6 * len(branch.records))
        assert p.records_at("decode", v) == len(branch.records)


def test_plan_profile_and_predict_a_model_whose_code_branches(windowed_plan) -> None:  # noqa: ANN001
    """`dooly plan/profile/validate` on the windowed model: every branch's signatures are planned and profiled, and
    the predictor prices each request size with the branch traced for it."""
    from test_profiler import FAST

    from dooly.db.store import ProfileStore
    from dooly.profile import run_plan

    cfg, db, plan = windowed_plan
    engine = get_engine()
    with ProfileStore(db) as st:
        traces = plan.models[0].traces
        assert traces["decode"].sides and traces["prefill"].sides
        for phase, tr in traces.items():
            assert set(plan.models[0].needs[phase]) == {s.key for s in tr.all_unique()}
        stats = run_plan(plan, st, engine, timer=FAST, threads=1)
        assert stats["failed"] == 0
        assert st.complete_keys(plan.ctx) >= {s.key for tr in traces.values() for s in tr.all_unique()}
    p = Predictor.for_model(cfg, db, engine, threads=1, method="interp")
    dec = traces["decode"]
    short, long = {"requests": 2, "kv_len": 8}, {"requests": 2, "kv_len": 100}
    assert p.records_at("decode", short) == len(dec.at(short).records) != p.records_at("decode", long)
    assert p.forward_latency("decode", short) > 0 and p.forward_latency("decode", long) > 0
