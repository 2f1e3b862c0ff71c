"""Tensor x pipeline-parallel replicas: the pipeline in the simulator (vLLM v1's batch queue), the layouts of a
device count as vLLM accepts them, the pick of a layout sweep, `dooly simulate --sweep-layouts`, and collectives
priced at group sizes never timed (the ring model, labelled as an extrapolation).

Latencies here are analytic stand-ins (no profile), so every test is fast and exact; the 70B sweep on real
profiles is bench/bench_layouts.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from dooly import api, layout_sweep
from dooly.cli import app
from dooly.core.batch import Batch
from dooly.simulator import PipelineLatency, ReplicaScheduler, parse_workload, simulate, vllm_v1_config
from dooly.simulator.layouts import Layout, enumerate_layouts, pp_partition, vllm_refusal

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 4096}  # fmt: skip


class Linear:
    """An iteration costs a fixed part plus a part per token (one stage's share when ``share`` < 1)."""

    def __init__(self, fixed: float = 0.02, per_token: float = 1e-4, share: float = 1.0) -> None:
        self.fixed, self.per_token, self.share = fixed, per_token, share

    def iteration_latency(self, batch: Batch) -> float:
        return self.share * (self.fixed + self.per_token * batch.num_tokens)


LONG_PROMPTS = "poisson:n=40,rate=20,prompt=1024-2048,output=2-4,seed=0"  # chunked over several batches: queues


def test_two_stages_pipeline_batches_and_serve_more_than_one_stage_alone() -> None:
    w, cfg = parse_workload(LONG_PROMPTS), vllm_v1_config(16, 512, 128, 4096)
    alone = simulate(w, Linear(), cfg).summary  # the whole model on one stage: the same work, nothing overlapped
    piped = simulate(w, PipelineLatency([Linear(share=0.5), Linear(share=0.5)]), cfg).summary
    assert piped.throughput_requests > 1.5 * alone.throughput_requests
    assert piped.ttft["p90"] < alone.ttft["p90"]


def test_one_stage_pipeline_is_the_plain_simulation() -> None:
    w, cfg = parse_workload("poisson:n=30,rate=8,prompt=32-512,output=8-64,seed=1"), vllm_v1_config(8, 256, 16, 512)
    plain = simulate(w, Linear(), cfg)
    one = simulate(w, PipelineLatency([Linear()]), cfg)
    assert plain.summary.row() == one.summary.row()
    assert [r.token_times for r in plain.requests] == [r.token_times for r in one.requests]


def test_the_pipeline_never_schedules_a_pending_token_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A request whose next token is in flight is in no other batch; only a long prompt's next chunk may follow
    its previous one into the pipeline (vLLM advances the computed tokens at scheduling); at most M in flight."""
    flights: list[int] = []
    dispatch, settle = ReplicaScheduler.dispatch, ReplicaScheduler.settle
    in_flight = {"n": 0}

    def checked_dispatch(self, batch):  # type: ignore[no-untyped-def]
        for req in batch.decode:
            assert req.id not in self.inflight, f"request {req.id} decodes while its token is in flight"
        for req, n in batch.prefill:
            assert self.inflight.get(req.id, 0) + n <= req.remaining_prefill, f"request {req.id} over-scheduled"
        in_flight["n"] += 1
        flights.append(in_flight["n"])
        dispatch(self, batch)

    def counted_settle(self, batch):  # type: ignore[no-untyped-def]
        in_flight["n"] -= 1
        settle(self, batch)

    monkeypatch.setattr(ReplicaScheduler, "dispatch", checked_dispatch)
    monkeypatch.setattr(ReplicaScheduler, "settle", counted_settle)
    w = parse_workload("poisson:n=60,rate=30,prompt=64-1500,output=4-40,seed=2")
    res = simulate(w, PipelineLatency([Linear(share=1 / 3)] * 3), vllm_v1_config(12, 384, 16, 2048))
    assert max(flights) == 3  # the batch queue fills to the pipeline's depth, never past it
    assert all(r.generated == r.output_tokens for r in res.requests)
    for r in res.requests:  # tokens come one at a time, in order
        assert r.token_times == sorted(r.token_times)


def test_pipeline_stages_run_one_batch_at_a_time() -> None:
    w = parse_workload("poisson:n=20,rate=50,prompt=600-900,output=2,seed=3")
    res = simulate(w, PipelineLatency([Linear(share=0.5)] * 2), vllm_v1_config(8, 256, 16, 1024))
    ends = sorted(it.end for it in res.iterations)
    # two stages of the same speed: consecutive completions are at least one stage's latency apart
    shortest = min(0.5 * (0.02 + 1e-4 * it.prefill_tokens) for it in res.iterations)
    assert all(b - a >= shortest - 1e-12 for a, b in zip(ends, ends[1:], strict=False))


def test_the_layouts_of_eight_devices() -> None:
    labels = [lay.label() for lay in enumerate_layouts(8)]
    assert labels == ["TP8", "TP4xPP2", "TP2xPP4", "TP1xPP8", "TP4 x2", "TP2xPP2 x2", "TP1xPP4 x2", "TP2 x4",
                      "TP1xPP2 x4", "TP1 x8"]  # fmt: skip
    assert all(lay.devices == 8 for lay in enumerate_layouts(8))
    assert [lay.label() for lay in enumerate_layouts(8, max_pp=1)] == ["TP8", "TP4 x2", "TP2 x4", "TP1 x8"]


def test_vllm_refuses_heads_that_do_not_divide() -> None:
    cfg = {**LLAMA, "num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 384}
    assert vllm_refusal(cfg, 8, 1) == "attention heads (12) not divisible by TP 8"
    assert vllm_refusal(cfg, 2, 1) == "KV heads (3) and TP 2: neither divides the other"
    assert vllm_refusal(cfg, 4, 2) == "KV heads (3) and TP 4: neither divides the other"
    assert vllm_refusal(cfg, 1, 8) == "4 layers cannot fill 8 pipeline stages"
    assert vllm_refusal(LLAMA, 4, 1) == ""  # 2 KV heads on 4 ranks: each repeated on two, as vLLM does
    assert vllm_refusal(LLAMA, 2, 2) == ""


def test_layers_split_over_stages_as_vllm_splits_them() -> None:
    assert pp_partition(80, 4) == [20, 20, 20, 20]
    assert pp_partition(80, 3) == [27, 27, 26]
    assert pp_partition(10, 4) == [2, 3, 3, 2]
    utils = pytest.importorskip("vllm.distributed.utils")
    for layers, pp in ((80, 3), (10, 4), (7, 2), (9, 8)):
        expected = [utils.get_pp_indices(layers, r, pp) for r in range(pp)]
        assert [(b - a) for a, b in expected] == pp_partition(layers, pp)


def _point(tp: int, pp: int, reps: int, tok_s: float, meets: bool, e2e: float = 1.0) -> layout_sweep.LayoutPoint:
    s = SimpleNamespace(throughput_tokens=tok_s, e2e={"p90": e2e}, ttft={"p90": 0.1}, tpot={"p90": 0.01})
    return layout_sweep.LayoutPoint(Layout(tp, pp, reps), summary=s, meets_slo=meets)  # type: ignore[arg-type]


def test_the_pick_is_the_highest_throughput_per_device_that_meets_the_slo() -> None:
    points = [
        _point(8, 1, 1, 900.0, True),
        _point(4, 1, 2, 1400.0, True, e2e=2.0),
        _point(2, 1, 4, 2000.0, False),  # fastest, misses the SLO
        _point(4, 2, 1, 1400.0, True, e2e=1.5),  # ties on throughput: the lower p90 end-to-end wins
        layout_sweep.LayoutPoint(Layout(1, 1, 8), reason="does not fit: weights", fits=False),
    ]
    sweep = layout_sweep.LayoutSweep("m", 8, "w", "cfg", SimpleNamespace(describe=lambda: "slo"), points)
    assert sweep.best is points[3]
    assert sweep.best.throughput_per_device == 1400.0 / 8
    sweep.points = [p for p in points if not p.meets_slo]
    assert sweep.best is None


class FakeRank:
    """A stage rank's predictor as the sweep reads it: iteration latency, operator time, collectives' share."""

    def __init__(self, tp: int, pp: int, method: str) -> None:
        self.lat, self.method = Linear(0.02 / (tp * pp), 1e-4 / (tp * pp)), method
        self.coll = 0.0 if tp == 1 else 0.1 * (tp - 1)
        self.collective_notes = [f"all_reduce among {tp}: extrapolated"] if tp > 2 else []

    def iteration_latency(self, batch: Batch) -> float:
        return self.lat.iteration_latency(batch)

    def ops_latency(self, phase: str, values: dict) -> float:
        return 1.0

    def collectives_share(self, phase: str, values: dict) -> float:
        return self.coll


@pytest.fixture
def fake_ranks(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """`dooly simulate --sweep-layouts` on a tiny config, each rank an analytic stand-in (no profile, no trace)."""
    monkeypatch.setattr(layout_sweep, "warm_traces", lambda *a, **k: None)
    monkeypatch.setattr(
        layout_sweep, "stage_latency_models", lambda model, db, dtype, threads, engine, shape, tp, pp, method: (
            [FakeRank(tp, pp, method) for _ in range(pp)], engine)
    )  # fmt: skip
    cfg = tmp_path / "llama.json"
    cfg.write_text(json.dumps({**LLAMA, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}))
    db = tmp_path / "p.db"
    db.write_bytes(b"")
    return cfg, db


def test_cli_sweeps_the_layouts_and_names_the_pick(fake_ranks) -> None:  # type: ignore[no-untyped-def]
    cfg, db = fake_ranks
    args = ["simulate", str(cfg), "--db", str(db), "--engine", "vllm", "--sweep-layouts", "--devices", "8",
            "--workload", "poisson:n=40,rate=10,prompt=32-256,output=4-32,seed=0", "--max-num-seqs", "8",
            "--slo-ttft", "5", "--slo-tpot", "0.5", "--memory-gb", "1"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    for label in ("TP8", "TP4xPP2 (2+2)", "TP1 x8", "coll. prefill", "tok/s/device"):
        assert label in res.output
    assert "TP1xPP8" in res.output and "vLLM refuses" in res.output  # 4 layers cannot fill 8 stages
    assert "all_reduce among 4: extrapolated" in res.output
    assert "pick under TTFT p90 <= 5000 ms, TPOT p90 <= 500 ms:" in res.output


def test_cli_refuses_both_sweeps_at_once(fake_ranks) -> None:  # type: ignore[no-untyped-def]
    cfg, db = fake_ranks
    args = ["simulate", str(cfg), "--db", str(db), "--engine", "vllm", "--sweep-layouts", "--sweep"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0 and "--sweep-layouts" in res.output


def test_the_ring_scales_a_collective_with_its_group() -> None:
    from dooly.predict.collectives import RingFit, ring_terms

    # among 8: all-reduce 2 (g - 1) = 14 steps and 2 (g - 1) / g = 1.75 of the bytes; all-gather g - 1 shards
    assert ring_terms("all_reduce", 1000, 8) == (14.0, 1750.0)
    assert ring_terms("all_reduce", 1000, 2) == (2.0, 1000.0)
    assert ring_terms("all_gather", 1000, 8) == (7.0, 7000.0)
    assert ring_terms("reduce_scatter", 1000, 8) == (7.0, 875.0)
    assert ring_terms("send", 1000, 8) == (1.0, 1000.0)  # a stage hands its tensor on whatever the group
    fit = RingFit(alpha=4e-6, beta=1e-9, sigma=0.0, groups=(2,), n=3)
    assert fit("all_reduce", 1000, 8) == pytest.approx(14 * 4e-6 + 1750e-9)


def test_a_collective_past_the_group_sizes_measured_is_extrapolated_and_labelled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm", reason="vllm is not installed (the vLLM engine is optional)")
    from dooly.db.store import Measurement, ProfileStore
    from dooly.engines import get_engine
    from dooly.predict.collectives import collective_fill
    from dooly.profile import context_for
    from dooly.profile.collectives import collective_kind
    from dooly.trace.tracer import trace_model

    one = {**LLAMA, "num_hidden_layers": 1}  # a layer's all-reduces are every layer's

    def traces(tp: int) -> dict:  # type: ignore[type-arg]
        engine = get_engine("vllm", tp=tp)
        return {"decode": trace_model(one, "decode", engine=engine)}  # prefill's collectives are the same ops

    two, four = traces(2), traces(4)
    ctx = context_for(get_engine("vllm", tp=2), 1)
    measured = {}
    with ProfileStore(tmp_path / "p.db") as store:
        # the group-size-2 all-reduces "measured": 4 us per ring step and 1 ns per byte on the wire, exactly
        for tr in two.values():
            for sig in tr.unique():
                if collective_kind(sig.op) != "all_reduce":
                    continue
                store.register_signature(ctx, sig.key, json.dumps(sig.to_dict()), None)
                pts = []
                for n in (1, 16, 256):
                    values = {s: n for s in sig.symbols()}
                    rows = n ** len(values)
                    t = 2 * 4e-6 + 1e-9 * rows * 128 * 2  # rows of 128 bfloat16
                    store.put_point(ctx, sig.key, values, Measurement(t, t, t, 1, t))
                    pts.append((values, t))
                measured[sig.key] = pts
        fill = collective_fill(four, measured, store, ctx, one)
    assert "all_reduce among 4: extrapolated by the ring model from" in " | ".join(fill.notes)
    assert any(n.startswith("all_reduce among 4") and "group size 2" in n for n in fill.notes)
    reduce4 = next(s for s in four["decode"].unique() if collective_kind(s.op) == "all_reduce")
    values, seconds = fill.synth[reduce4.key][0]
    rows = values["requests"]
    assert seconds == pytest.approx(6 * 4e-6 + 1.5 * 1e-9 * rows * 128 * 2, rel=1e-3)  # 6 steps, 1.5 x the bytes


def test_a_deep_model_folded_to_three_layers_per_stage_is_its_full_trace() -> None:
    """`--sweep-layouts` traces a deep model's stage at three layers and repeats the last (its layers alike): the
    same records, modules, layer numbers and order as tracing all of them, on an uneven pipeline split too."""
    pytest.importorskip("vllm", reason="vllm is not installed (the vLLM engine is optional)")
    from dooly.engines import get_engine
    from dooly.profile.traces import fold_traced
    from dooly.trace.tracer import trace_model

    deep = {**LLAMA, "num_hidden_layers": 16}  # three stages of 5, 6 and 5 layers, as vLLM splits them
    engine = get_engine("vllm", tp=2, pp=3, pp_stage=1)
    full, folded = trace_model(deep, "decode", engine=engine, name="d"), fold_traced(deep, "decode", "d", engine)
    assert folded is not None and folded.meta["folded"] == {"traced_layers": 3, "layers": 6}
    assert {r.layer for r in folded.records if r.layer is not None} == set(range(5, 11))

    def rows(tr):  # type: ignore[no-untyped-def]
        return [(r.signature, r.module, r.layer, r.view, r.order) for r in tr.records]

    assert rows(folded) == rows(full) and folded.config_hash == full.config_hash


def test_each_stage_role_is_traced_once_for_every_pipeline_depth(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A first, middle and last stage of a 4-stage pipeline are traced as the 2- and 3-stage pipelines' stages of
    the same role, with the sends and receives among 4 ranks: the records of tracing each stage whole. A deeper
    pipeline's first stage then traces nothing new."""
    pytest.importorskip("vllm", reason="vllm is not installed (the vLLM engine is optional)")
    from dooly.engines import get_engine
    from dooly.profile import traces
    from dooly.trace import tracer

    deep = {**LLAMA, "num_hidden_layers": 20}  # 5 layers a stage in 4 stages, 3 in 8 (too few to fold)
    deep40 = {**LLAMA, "num_hidden_layers": 40}

    def rows(tr):  # type: ignore[no-untyped-def]
        return [(r.signature, r.module, r.layer, r.view, r.order) for r in tr.records]

    for stage in (0, 2, 3):
        engine = get_engine("vllm", tp=2, pp=4, pp_stage=stage)
        assert engine.role_engine().pp in (2, 3)  # type: ignore[attr-defined]
        full, folded = (
            tracer.trace_model(deep, "decode", engine=engine, name="d"),
            traces.fold_traced(deep, "decode", "d", engine),
        )
        assert folded is not None and rows(folded) == rows(full), f"stage {stage}"
        assert folded.meta["pipeline_parallel_size"] == 4 and folded.meta["pipeline_stage"] == stage
        if stage < 3:
            assert any(r.signature.op == "dooly_vllm.send.default" for r in folded.records)
    calls = []
    real = tracer.trace_model
    monkeypatch.setattr(tracer, "trace_model", lambda *a, **k: calls.append(a) or real(*a, **k))
    deeper = traces.fold_traced(deep40, "decode", "d", get_engine("vllm", tp=2, pp=8, pp_stage=0))
    assert deeper is not None and not calls
    sends = {r.signature.args for r in deeper.records if r.signature.op == "dooly_vllm.send.default"}
    assert sends and all(json.loads(a)["args"][-1] == 8 for a in sends)


def test_layers_that_differ_are_never_folded() -> None:
    from dooly.profile.traces import fold_traced

    engine = SimpleNamespace(pp=1, stage=0)
    mixed = {**LLAMA, "num_hidden_layers": 8, "layer_types": ["sliding_attention", "full_attention"] * 4}
    assert fold_traced(mixed, "decode", "m", engine) is None  # type: ignore[arg-type]
    assert fold_traced({**LLAMA, "num_hidden_layers": 8, "first_k_dense_replace": 1}, "decode", "m", engine) is None  # type: ignore[arg-type]
    assert fold_traced(LLAMA, "decode", "m", engine) is None  # type: ignore[arg-type]  # 4 layers: nothing to gain


def test_middle_stages_alike_share_one_predictor_and_cache() -> None:
    assert [api._twin_stage("llama-3.1-70b", 8, s) for s in range(8)] == [None, None, 1, 1, 1, 1, 1, None]
    assert [api._twin_stage("llama-3.1-70b", 3, s) for s in range(3)] == [None, None, None]
    rank = Linear(share=0.25)
    pipe = PipelineLatency([Linear(share=0.25), rank, rank, Linear(share=0.25)])
    assert pipe.stages[1] is pipe.stages[2] and pipe.stages[0] is not pipe.stages[3]
