"""Report, CLI serving commands (with a stand-in predictor) and the Vidur op mapping."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from dooly.cli import app
from dooly.core.batch import Batch
from dooly.db.store import Measurement, ProfileContext, ProfileStore
from dooly.profile.savings import ModelSignatures, record_models, savings_of
from dooly.report import build_report, save_result, savings_from_db, write_report
from dooly.vidur_export import vidur_op


class Linear:
    def iteration_latency(self, batch: Batch) -> float:
        return 0.003 + 2e-4 * batch.num_tokens + 1e-6 * sum(batch.decode)


def _trace(model: str, keys: list[str]) -> str:
    recs = [{"sig": k, "order": i, "module": "m", "layer": 0, "view": False} for i, k in enumerate(keys)]
    return json.dumps({"format": "dooly.trace/1", "model": model, "records": recs})


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "profiles.db"
    ctx = ProfileContext("cpu-test")
    with ProfileStore(path) as store:
        for key, cost in (("s1", 1.0), ("s2", 2.0), ("s3", 4.0)):
            store.register_signature(ctx, key, "{}", 1)
            store.put_point(ctx, key, {"tokens": 8}, Measurement(1e-3, 9e-4, 1.1e-3, 5, cost))
        record_models(store, ctx, [ModelSignatures("a", {"s1": 1, "s2": 1})])
        # a second calibration round's trace is cached under its own key: it is not a model
        store.put_trace("hf-eager", "a#round2@h@v", "prefill", _trace("a#round2", ["s1", "s2"]))
        record_models(store, ctx, [ModelSignatures("b", {"s2": 1, "s3": 1}), ModelSignatures("a", {"s1": 1, "s2": 1})])
    return path


def test_savings_counts_each_model_once_in_profiling_order(db):
    [(ctx, sv)] = savings_from_db(db)
    assert ctx == ProfileContext("cpu-test")
    assert [(r.name, r.alone_s, r.marginal_s) for r in sv.models] == [("a", 3.0, 3.0), ("b", 6.0, 4.0)]
    assert sv.saved_pct == pytest.approx(100 * (1 - 7 / 9))
    with ProfileStore(db) as store:  # one model alone saves nothing, to the last digit
        one = savings_of([ModelSignatures("b", {"s3": 1, "s2": 1, "s1": 1})], store, ctx)
        # a plan over signatures already in the DB says what this run will not measure again
        two = savings_of([ModelSignatures("a", {"s1": 1, "s2": 1}), ModelSignatures("b", {"s2": 1, "s3": 1})],
                         store, ctx, known={"s1", "s2"})  # fmt: skip
    assert one.saved_pct == 0.0 and one.describe().startswith("1 model: 7.0 device-s")
    assert "already in the DB" not in one.describe()
    assert two.in_db_s == pytest.approx(3.0) and two.with_reuse_s == pytest.approx(7.0)
    assert [(r.reused_db, r.new) for r in two.models] == [(2, 0), (0, 1)]
    assert two.describe().endswith("3.0 device-s of it already in the DB, so this run measures 4.0")


def test_report_is_self_contained(db, tmp_path):
    rng = np.random.default_rng(0)
    m = rng.uniform(0.1, 0.2, 20)
    save_result(
        db,
        "validation-a",
        {
            "kind": "validation",
            "model": "a",
            "workload": "w",
            "config": "c",
            "table": [{"metric": "TTFT", "measured_p50": 0.15, "simulated_p50": 0.16, "mape_pct": 4.2}],
            "iteration_mape": 3.3,
            "measured": {"ttft": m, "tpot": m / 10},
            "simulated": {"ttft": m * 1.05, "tpot": m / 9},
            "iterations": {"measured": m / 5, "predicted": m / 5.2},
        },
    )
    out = write_report(db, tmp_path / "r.html")
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 4  # savings + 2 CDFs + iteration scatter
    assert "22.2% saved" in page  # 1 - (3 + 4) / (3 + 6)
    assert "4.2" in page and "http" not in page.replace("http-equiv", "")


def test_report_errors(tmp_path):
    from dooly.core.errors import DoolyError

    with pytest.raises(DoolyError, match="no such profile database"):
        build_report(tmp_path / "none.db")


def test_cli_simulate_and_sweep(db, tmp_path, monkeypatch):
    import dooly.api

    monkeypatch.setattr(dooly.api, "load_latency_model", lambda model, db, *a: Linear())
    runner = CliRunner()
    res = runner.invoke(
        app, ["simulate", "a", "--db", str(db), "--workload", "poisson:n=40,rate=20,prompt=64-400,output=4-16"]
    )
    assert res.exit_code == 0, res.output
    assert "TTFT" in res.output and "throughput" in res.output
    csv_out = tmp_path / "sweep.csv"
    res = runner.invoke(
        app,
        ["simulate", "a", "--db", str(db), "--workload", "poisson:n=40,rate=20,prompt=64-400,output=4-16",
         "--sweep", "--slo-ttft", "0.5", "-o", str(csv_out)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "best under TTFT p90 <= 500 ms" in res.output
    lines = csv_out.read_text().splitlines()
    assert len(lines) == 1 + 32
    # 400-token prompts do not fit a 256-token budget without chunking: listed as infeasible
    assert sum("above max_num_batched_tokens" in line for line in lines) == 4
    saved = json.loads((tmp_path / "profiles.results" / "simulation-a.json").read_text())
    assert saved["kind"] == "simulation" and len(saved["sweep"]) == 32
    page = build_report(db)
    assert "Simulated serving" in page


def test_cli_bad_workload_is_one_line(db):
    from dooly.cli.app import main  # noqa: F401  (the entry point turns DoolyError into exit 1)

    res = CliRunner().invoke(app, ["simulate", "a", "--db", str(db), "--workload", "nope.csv"])
    assert res.exit_code != 0
    assert "no such workload file" in str(res.exception)


@pytest.mark.parametrize(
    "module,op",
    [
        ("model.embed_tokens", "emb"),
        ("model.layers.0.input_layernorm", "input_layernorm"),
        ("model.layers.0.self_attn.q_proj", "attn_pre_proj"),
        ("model.layers.0.self_attn.o_proj", "attn_post_proj"),
        ("model.layers.0.self_attn", "attn"),
        ("model.layers.0.post_attention_layernorm", "post_attention_layernorm"),
        ("model.layers.0.mlp.gate_proj", "mlp_up_proj"),
        ("model.layers.0.mlp.down_proj", "mlp_down_proj"),
        ("model.layers.0.mlp.act_fn", "mlp_act"),
        ("model.decoder.layers.0.fc1", None),
        ("model.layers.0", "add"),
    ],
)
def test_vidur_op_mapping(module, op):
    assert vidur_op(module) == op


def test_vidur_export_layout(tmp_path, monkeypatch):
    """Rows per num_tokens / decode shape with Vidur's column names, times in ms from the profiles."""
    import csv

    import dooly.core.zoo as zoo
    import dooly.profile as profiler
    from dooly.trace.signature import ModelTrace, OpRecord, Signature, TensorSpec
    from dooly.vidur_export import export_vidur

    def sig(op: str, shape: tuple) -> Signature:
        return Signature(op, (TensorSpec(shape, "bfloat16"),), '{"args":[{"tensor":0}],"kwargs":{}}', "hf-eager/cpu")

    pre_mm = sig("aten.mm.default", ("requests*tokens", 64))
    pre_attn = sig("aten.bmm.default", ("requests", "tokens", "tokens"))
    dec_attn = sig("aten.bmm.default", ("requests", 1, "kv_len + 1"))
    recs = {
        "prefill": [
            OpRecord(pre_mm, 0, "model.layers.0.self_attn.q_proj", 0),
            OpRecord(pre_mm, 1, "model.layers.1.self_attn.q_proj", 1),  # other layers are left out
            OpRecord(pre_attn, 2, "model.layers.0.self_attn", 0),
            OpRecord(pre_mm, 3, "model.layers.0.mlp.down_proj", 0),
        ],
        "decode": [OpRecord(dec_attn, 0, "model.layers.0.self_attn", 0)],
    }
    traces = {ph: ModelTrace("m", "h", ph, "hf-eager/cpu", r) for ph, r in recs.items()}
    ctx = ProfileContext("cpu-test")
    db = tmp_path / "p.db"
    with ProfileStore(db) as store:
        for t in (1, 2048):
            store.put_point(ctx, pre_mm.key, {"requests": 1, "tokens": t}, Measurement(1e-4 * t, 0, 0, 3, 0.1))
            store.put_point(ctx, pre_attn.key, {"requests": 1, "tokens": t}, Measurement(2e-5 * t, 0, 0, 3, 0.1))
        for b in (1, 32):
            for k in (16, 2048):
                store.put_point(
                    ctx, dec_attn.key, {"requests": b, "kv_len": k}, Measurement(1e-6 * b * k, 0, 0, 3, 0.1)
                )
    monkeypatch.setattr(profiler, "model_traces", lambda *a, **k: traces)
    monkeypatch.setattr(profiler, "context_for", lambda *a, **k: ctx)
    monkeypatch.setattr(zoo, "resolve_model", lambda m: ("m", {"model_type": "llama", "hidden_size": 64,
                        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))  # fmt: skip
    mlp, attn = export_vidur("m", db, tmp_path / "vidur" / "m", num_tokens=[1, 2048], decode_batches=[1, 32],
                             kv_sizes=[16, 2048])  # fmt: skip
    rows = list(csv.DictReader(mlp.open()))
    assert [int(r["num_tokens"]) for r in rows] == [1, 2048]
    assert float(rows[1]["time_stats.attn_pre_proj.median"]) == pytest.approx(204.8)  # 0.2048 s, layer 0 only
    assert float(rows[1]["time_stats.mlp_down_proj.median"]) == pytest.approx(204.8)
    assert rows[0]["n_embd"] == "64" and rows[0]["n_kv_head"] == "4" and rows[0]["use_gated_mlp"] == "True"
    arows = list(csv.DictReader(attn.open()))
    assert len(arows) == 2 + 4
    pre = [r for r in arows if r["is_prefill"] == "True"]
    assert float(pre[1]["time_stats.attn_prefill.median"]) == pytest.approx(2e-5 * 2048 * 1e3)
    dec = [r for r in arows if r["is_prefill"] == "False"]
    assert {(r["batch_size"], r["kv_cache_size"]) for r in dec} == {
        ("1", "16"),
        ("1", "2048"),
        ("32", "16"),
        ("32", "2048"),
    }
    big = next(r for r in dec if r["batch_size"] == "32" and r["kv_cache_size"] == "2048")
    assert float(big["time_stats.attn_decode.median"]) == pytest.approx(1e-6 * 32 * 2048 * 1e3)
