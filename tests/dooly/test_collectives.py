"""Collectives of a tensor-parallel rank, timed between two real processes (one per core) through vLLM's CPU
communicator, stored under the collective's signature and priced by the rank's predictor like any op.

A tiny llama (4 heads, 2 KV heads: both divide by 2) on the tiny grid; the worker processes import vLLM once for
the whole module. The TP=2 rank's profile (`dooly profile --tp 2`: vLLM's start-up, both traces, the grid) takes
~25 s on an idle machine, so the tests built on it are marked slow.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

# found, not imported: collecting the suite must not pay vLLM's import in every worker
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (the vLLM engine is optional)", allow_module_level=True)

from typer.testing import CliRunner  # noqa: E402

from dooly.cli import app  # noqa: E402
from dooly.db.store import ProfileStore  # noqa: E402
from dooly.engines import get_engine  # noqa: E402
from dooly.predict.predictor import Predictor  # noqa: E402
from dooly.profile import GridSpec, TimerConfig, default_threads, make_plan  # noqa: E402
from dooly.profile.collectives import CollectiveCall, CollectiveTimer, collective_kind  # noqa: E402

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 512}  # fmt: skip
FAST = TimerConfig(warmup=1, repeats=3, budget_s=0.05)
ALL_REDUCE = "dooly_vllm.all_reduce.default"


@pytest.fixture(scope="module")
def timer():  # type: ignore[no-untyped-def]
    with CollectiveTimer() as t:
        yield t


def test_two_processes_time_every_collective_at_each_message_size(timer) -> None:  # type: ignore[no-untyped-def]
    assert timer.backend(2) in ("vllm-shm", "gloo")
    small, large = (1, 128), (4096, 1024)  # 512 B and 16 MiB (how time grows with size: bench_collectives.py)
    calls = [CollectiveCall(kind, shape, "float32", 0, 2) for kind in ("all_reduce", "all_gather") for shape in
             (small, large)]  # fmt: skip
    calls += [CollectiveCall(kind, small, "float32", 0, 2) for kind in ("send", "recv")]
    out = timer.time(calls, FAST)
    assert not [m for m in out if isinstance(m, str)], out
    assert len(out) == len(calls) and all(m.median_s > 0 for m in out)  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A TP=2 rank of the tiny llama, profiled by `dooly profile --tp 2` on the tiny grid: (config, DB, plan)."""
    tmp = tmp_path_factory.mktemp("tp2")
    path, db = tmp / "llama.json", tmp / "p.db"
    path.write_text(json.dumps(LLAMA))
    args = ["profile", str(path), "--db", str(db), "--engine", "vllm", "--tp", "2", "--grid", "tiny"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    with ProfileStore(db, readonly=True) as store:  # the plan again: every signature known, nothing to time
        plan = make_plan([str(path)], store, get_engine("vllm", tp=2), GridSpec.tiny(), threads=default_threads())
    assert not plan.jobs
    return path, db, plan


@pytest.mark.slow  # the shared profile of a TP=2 rank takes ~22 s with vLLM's start-up
def test_the_db_holds_a_rank_s_all_reduce_timed_between_processes(profiled) -> None:  # type: ignore[no-untyped-def]
    path, db, plan = profiled
    needs = plan.models[0].needs["prefill"]
    key = next(k for k, n in needs.items() if n.signature.op == ALL_REDUCE)
    with ProfileStore(db, readonly=True) as store:
        assert key in store.complete_keys(plan.ctx)
        pts = {(int(p["requests"]), int(p["tokens"])): m.median_s for p, m in store.points(plan.ctx, key)}
    assert set(pts) == {(r, t) for r in (1, 2) for t in (1, 4, 8)} and min(pts.values()) > 0


@pytest.mark.slow  # the shared profile of a TP=2 rank takes ~22 s with vLLM's start-up
def test_a_tp2_predictor_prices_the_collectives_from_their_points(profiled) -> None:  # type: ignore[no-untyped-def]
    path, db, plan = profiled
    engine = get_engine("vllm", tp=2)
    pred = Predictor.for_model(str(path), db, engine, threads=default_threads(), method="interp")
    values = {"requests": 2, "kv_len": 16}  # a grid point: interpolation returns what was stored there
    coll = {s.key: n for s, n in pred.traces["decode"].at(values).unique().items() if collective_kind(s.op)}
    assert coll
    with ProfileStore(db, readonly=True) as store:
        # a decode's collectives move one row per request: their points are over the requests alone
        stored = {k: {int(p["requests"]): m.median_s for p, m in store.points(plan.ctx, k)} for k in coll}
    expected = sum(mult * stored[k][2] for k, mult in coll.items())
    share = pred.collectives_share("decode", values)
    assert 0 < share < 1
    assert share * pred.ops_latency("decode", values) == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow  # the shared profile of a TP=2 rank takes ~22 s with vLLM's start-up
def test_simulate_a_tp2_replica(profiled) -> None:  # type: ignore[no-untyped-def]
    path, db, _ = profiled
    workload = "poisson:n=4,rate=2,prompt=4-8,output=2-4,seed=0"
    args = ["simulate", str(path), "--db", str(db), "--engine", "vllm", "--tp", "2", "--workload", workload]
    res = CliRunner().invoke(app, [*args, "--cpu-kvcache-gb", "1"])
    assert res.exit_code == 0, res.output
    assert "TTFT" in res.output and "TPOT" in res.output
    assert "collectives:" in res.output
