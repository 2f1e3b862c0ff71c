"""Grids within a model's position limit, and a profile used only once every planned point is stored."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_profile_fixtures import seed_traces, tiny_config
from typer.testing import CliRunner

from dooly.cli import app
from dooly.core.errors import DoolyError
from dooly.core.zoo import at_depth, max_positions
from dooly.db.store import ProfileStore
from dooly.engines import get_engine
from dooly.predict.predictor import Predictor
from dooly.profile import GridSpec, TimerConfig, context_for, make_plan, run_plan, shapes_within, trace_cache_key

FAST = TimerConfig(warmup=1, repeats=3, min_sample_s=0.0, max_inner=1, budget_s=0.05)
runner = CliRunner()

# a GPT-2-style model as a new user writes it: learned positions (n_positions), Conv1D projections
TINY_GPT2 = {
    "model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32, "n_ctx": 32,
    "vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0, "_name_or_path": "tiny-gpt2",
}  # fmt: skip


def test_max_positions_reads_every_spelling() -> None:
    assert max_positions({"max_position_embeddings": 2048}) == 2048
    assert max_positions({"n_positions": 1024, "n_ctx": 1024}) == 1024
    assert max_positions({"text_config": {"max_position_embeddings": 512}}) == 512
    assert max_positions({"model_type": "mpt", "max_seq_len": 2048}) == 2048  # an ALiBi table of that size
    assert max_positions({"model_type": "rwkv"}) is None
    # a window limits the grid only when every layer slides; a mixed model still attends to everything
    slides = ["sliding_attention"] * 2
    assert max_positions({"max_position_embeddings": 4096, "sliding_window": 256, "layer_types": slides}) == 256
    mixed = ["sliding_attention", "full_attention"]
    assert max_positions({"max_position_embeddings": 4096, "sliding_window": 256, "layer_types": mixed}) == 4096


def test_at_depth_keeps_the_first_layers_under_any_spelling() -> None:
    mixed = {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size": 8}
    assert at_depth(mixed, 2) == {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                                  "hidden_size": 8}  # fmt: skip
    assert mixed["num_hidden_layers"] == 4  # a copy
    assert at_depth({"n_layer": 12, "n_head": 12}, 6) == {"n_layer": 6, "n_head": 12}
    assert at_depth({"text_config": {"num_hidden_layers": 8}}, 4) == {"text_config": {"num_hidden_layers": 4}}
    assert at_depth({"model_type": "rwkv"}, 2) is None


def test_grid_is_clamped_to_the_positions() -> None:
    g = GridSpec((1, 2), (1, 4, 64), (1,), (4, 16, 64, 1024))
    assert g.within(None) is g
    c = g.within(32)
    assert c.prefill_tokens == (1, 4, 32) and c.decode_kv_len == (4, 16, 31)  # a decode at kv_len 31 holds 32
    assert c.prefill_requests == (1, 2)
    assert GridSpec().within(1024).decode_kv_len == (16, 64, 256, 1023)
    shapes = {"prefill": [{"requests": 1, "tokens": 32}, {"requests": 1, "tokens": 33}],
              "decode": [{"requests": 4, "kv_len": 31}, {"requests": 1, "kv_len": 32}]}  # fmt: skip
    assert shapes_within(shapes, 32) == {"prefill": [shapes["prefill"][0]], "decode": [shapes["decode"][0]]}


def test_gpt2_style_model_profiles_within_its_positions(tmp_path: Path) -> None:
    """The grid reaches past the model's 32 positions; the clamped plan runs to completion and predicts."""
    db = tmp_path / "p.db"
    engine = get_engine()
    grid = GridSpec((1,), (1, 4, 64), (1,), (4, 16, 64))
    with ProfileStore(db) as st:
        plan = make_plan([TINY_GPT2], st, engine, grid, threads=1)
        shapes = {j.shape for j in plan.jobs}
        assert max(tok for _, tok, kv in shapes if kv == 0) == 32  # prefill up to the limit, not past it
        assert max(kv for *_, kv in shapes) == 31
        stats = run_plan(plan, st, engine, timer=FAST, threads=1)
        assert stats["failed"] == 0 and stats["points"] == plan.todo_points
        assert st.complete_keys(plan.ctx) == set(plan.grid_size)
    pred = Predictor.for_model(TINY_GPT2, db, engine, threads=1, method="interp")
    assert pred.forward_latency("decode", {"requests": 1, "kv_len": 20}) > 0


def test_the_model_with_more_positions_profiles_a_shared_signature(tmp_path: Path) -> None:
    db = tmp_path / "p.db"
    short = tiny_config("short") | {"max_position_embeddings": 6}
    long = tiny_config("long")  # same shapes, 2048 positions
    seed_traces(db, short)
    seed_traces(db, long)
    with ProfileStore(db) as st:
        plan = make_plan([short, long], st, get_engine(), GridSpec((1,), (1, 4), (1,), (4, 8)), threads=1)
    needs = plan.models[0].needs
    cached = {k for k, n in needs["decode"].items() if "kv_len" in n.signature.symbols()}
    assert cached and {plan.owner[k] for k in cached} == {"long"}  # short cannot decode at kv_len 8
    assert {plan.owner[k] for k in needs["prefill"]} == {"short"}  # the first model otherwise
    assert all(j.shape[2] <= 5 for j in plan.jobs if j.model == "short")


def test_an_incomplete_profile_is_refused_with_the_command_to_finish_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DOOLY_THREADS", "1")
    db, cfg = tmp_path / "p.db", tiny_config("tiny-a")
    path = tmp_path / "tiny-a.json"
    path.write_text(json.dumps(cfg))
    seed_traces(db, cfg)
    engine = get_engine()
    with ProfileStore(db) as st:
        plan = make_plan([cfg], st, engine, GridSpec.tiny(), threads=1)
        plan.jobs = plan.jobs[:-1]  # a run killed before its last job
        run_plan(plan, st, engine, timer=FAST, threads=1)
    finish = f"dooly profile {path} --db {db}"
    for args in (["validate", str(path), "--db", str(db)], ["simulate", str(path), "--db", str(db)]):
        res = runner.invoke(app, args)
        assert res.exit_code != 0 and isinstance(res.exception, DoolyError), res.output
        assert "incomplete" in str(res.exception) and finish in str(res.exception)
    res = runner.invoke(app, ["profile", str(path), "--db", str(db), "--grid", "tiny", "--no-calibrate"])
    assert res.exit_code == 0, res.output
    with pytest.raises(DoolyError, match="no such profile"):
        Predictor.for_model(cfg, tmp_path / "other.db")
    assert Predictor.for_model(str(path), db, engine, threads=1, method="interp").name == "tiny-a"


def test_report_and_cli_print_the_same_savings(tmp_path: Path, monkeypatch) -> None:
    """Profile two models with calibration, validate (whose overhead fit reads the second calibration round),
    report: the report's figure is the CLI's, each model counted once."""
    monkeypatch.setenv("DOOLY_THREADS", "1")
    db, paths = tmp_path / "p.db", []
    for name, inter in (("tiny-a", 128), ("tiny-b", 96)):
        cfg = tiny_config(name, inter)
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(cfg))
        seed_traces(db, cfg)
    res = runner.invoke(app, ["profile", *map(str, paths), "--db", str(db), "--grid", "tiny"])
    assert res.exit_code == 0, res.output
    cli = re.search(r"onboarding cost: 2 models: .*?([\d.]+)% saved", " ".join(res.output.split()))
    assert cli, res.output
    # the split: calibration forwards are counted on both sides, and the figure without them is shown too
    pattern = r"calibrate ([\d.]+) device-s with reuse, [\d.]+ \+ [\d.]+ \+ ([\d.]+) alone; "
    pattern += r"without calibration [\d.]+ vs [\d.]+: ([\d.]+)% saved"
    split = re.search(pattern, " ".join(res.output.split()))
    assert split and float(split.group(1)) > 0 and float(split.group(2)) == float(split.group(1)), res.output
    with ProfileStore(db, readonly=True) as st:  # calibration also ran each model at half its depth
        ctx = context_for(get_engine(), 1)
        assert {m for m, *_ in st.forwards(ctx)} >= {"tiny-a", "tiny-a#round2", "tiny-a#layers1",
                                                     "tiny-a#layers1#round2"}  # fmt: skip
        half = json.loads(st.get_trace("config", "tiny-a#layers1", "config"))
        assert half["num_hidden_layers"] == 1
        # and traced there, so commands that only read the DB do not trace it again on every load
        assert st.get_trace("hf-eager/cpu:bfloat16", trace_cache_key("tiny-a#layers1", half), "decode")
    res = runner.invoke(app, ["validate", str(paths[0]), "--db", str(db), "--repeats", "1", "--method", "interp"])
    assert res.exit_code == 0, res.output
    # the forward MAPE under both calibration policies: its own calibration, and the other model's overhead fit
    for label in ("exact reuse", "own points, overhead fitted on the other models: --calibrate none"):
        assert re.search(rf"MAPE prefill [\d.]+% +decode [\d.]+% +all [\d.]+% +\({label}", res.output), label
    res = runner.invoke(app, ["report", "--db", str(db), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "r.html").read_text()
    found = re.findall(r"(\d+) models: [^<]*?([\d.]+)% saved", page)
    assert found == [("2", cli.group(1))]
    assert "without calibration" in page and f"{split.group(3)}% saved" in page and "calib_alone_s" in page
    assert 0 < float(cli.group(1)) < 100


def test_calibrate_check_calibrates_at_the_models_own_depth_only_when_the_shared_fit_misses(
    tmp_path: Path, monkeypatch
) -> None:
    """`--calibrate check`: the first model has no shared fit to check against (full set); the second is checked
    with one forward per phase and, its check made to miss, calibrated at its own depth, one round, its check's
    two forwards among them; its overhead is then fitted on those nine. `dooly plan` says which, one line per
    model, and the savings count what each took."""
    import dooly.api

    monkeypatch.setenv("DOOLY_THREADS", "1")
    db, paths = tmp_path / "p.db", []
    for name, inter in (("tiny-a", 128), ("tiny-b", 96)):
        cfg = tiny_config(name, inter)
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(cfg))
        seed_traces(db, cfg)
    res = runner.invoke(app, ["plan", *map(str, paths), "--db", str(db), "--grid", "tiny", "--calibrate", "check"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "tiny-a: full, 36 forwards (2 depth(s) x 2 rounds): no shared overhead fit" in text
    assert "tiny-b: check: 2 forwards against the shared overhead fit of 1 model(s)" in text
    assert "9 forwards at its own depth, one round" in text
    assert re.search(r"were every check to miss: [\d.]+ device-s with reuse", text), text
    res = runner.invoke(app, ["plan", str(paths[0]), "--db", str(db), "--grid", "tiny", "--calibrate", "some"])
    assert isinstance(res.exception, DoolyError) and "unknown --calibrate 'some'" in str(res.exception)
    real_check = dooly.api.check_calibration

    def missed(*a, **kw):  # the check's forwards measured for real, its verdict a miss
        return False, real_check(*a, **kw)[1]

    monkeypatch.setattr(dooly.api, "check_calibration", missed)
    for p in paths:
        res = runner.invoke(app, ["profile", str(p), "--db", str(db), "--grid", "tiny", "--calibrate", "check"])
        assert res.exit_code == 0, res.output
        if p == paths[0]:  # nothing to check the DB's first model against: not a miss
            assert "calibration check on tiny-a not possible: full calibration" in res.output, res.output
    assert "calibration check on tiny-b missed: calibrated at its own depth" in res.output, res.output
    ctx = context_for(get_engine(), 1)
    with ProfileStore(db, readonly=True) as st:
        keys = {m for m, *_ in st.forwards(ctx)}
        own, checked = st.forwards(ctx, "tiny-b"), st.forwards(ctx, "tiny-b#check")
    assert {"tiny-a", "tiny-a#layers1#round2", "tiny-b", "tiny-b#check"} <= keys and "tiny-a#check" not in keys
    assert not {k for k in keys if k.startswith("tiny-b#") and k != "tiny-b#check"}  # no half depth, no round 2
    assert (len(own), len(checked)) == (7, 2)  # the check's shapes are not measured again
    pred = Predictor.for_model(str(paths[1]), db, threads=1, method="interp")
    assert pred.overhead.n_fit == {"prefill": 4, "decode": 5}  # its own nine forwards, the check's two among them
    res = runner.invoke(app, ["plan", str(paths[1]), "--db", str(db), "--grid", "tiny", "--calibrate", "check"])
    assert "tiny-b: none to run: already calibrated in the DB" in " ".join(res.output.split()), res.output
