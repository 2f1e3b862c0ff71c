"""`dooly plan`, `dooly profile`, `dooly validate` on tiny configs (traces seeded, tiny grid)."""

from __future__ import annotations

import json
import re
import shlex
import sqlite3
from pathlib import Path

import pytest
from test_profile_fixtures import seed_traces, tiny_config
from typer.testing import CliRunner

from dooly.cli import app
from dooly.core.errors import DoolyError
from dooly.core.zoo import resolve_model

runner = CliRunner()


@pytest.fixture
def configs(tmp_path: Path) -> tuple[Path, Path, Path]:
    db = tmp_path / "p.db"
    paths = []
    for name, inter in (("tiny-a", 128), ("tiny-b", 96)):
        cfg = tiny_config(name, inter)
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(cfg))
        seed_traces(db, cfg)
        paths.append(p)
    return db, paths[0], paths[1]


def test_plan_profile_validate(configs, monkeypatch) -> None:
    db, a, b = configs
    monkeypatch.setenv("DOOLY_THREADS", "1")
    res = runner.invoke(app, ["plan", str(a), str(b), "--db", str(db), "--grid", "tiny"])
    assert res.exit_code == 0, res.output
    assert "tiny-a" in res.output and "saved" in res.output
    res = runner.invoke(app, ["profile", str(a), str(b), "--db", str(db), "--grid", "tiny", "--no-calibrate"])
    assert res.exit_code == 0, res.output
    assert "signatures completed" in res.output
    res = runner.invoke(app, ["plan", str(a), str(b), "--db", str(db), "--grid", "tiny"])
    assert "to profile now: 0 jobs, 0 points" in res.output
    res = runner.invoke(app, ["validate", str(a), "--db", str(db), "--repeats", "1", "--method", "interp"])
    assert res.exit_code == 0, res.output
    assert "MAPE prefill" in res.output and "decode" in res.output
    assert re.search(r"measuring tiny-a: 0/(\d+) shapes, .*measuring tiny-a: \1/\1 shapes", res.output, re.S)
    # --keep stores the held-out forwards; a second --keep run re-scores them without measuring
    res = runner.invoke(app, ["validate", str(a), "--db", str(db), "--repeats", "1", "--method", "interp", "--keep"])
    assert res.exit_code == 0, res.output
    with sqlite3.connect(db) as con:
        kept = con.execute("SELECT COUNT(*) FROM forwards WHERE model LIKE 'tiny-a#holdout%'").fetchone()[0]
    assert kept > 0
    import dooly.profile

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(dooly.profile, "measure_forward", no_measuring)
    again = runner.invoke(app, ["validate", str(a), "--db", str(db), "--repeats", "1", "--method", "interp", "--keep"])
    assert again.exit_code == 0, again.output
    assert re.findall(r"MAPE prefill .*", again.output) == re.findall(r"MAPE prefill .*", res.output)
    # serving: percentiles first (as `vllm bench serve` prints them), per-request errors second
    w = "static:n=4,prompt=8-24,output=3-5,seed=0"
    res = runner.invoke(app, ["validate-serving", str(a), "--db", str(db), "--workload", w, "--clock", "thread"])
    assert res.exit_code == 0, res.output
    line = re.search(
        r"percentile error \(p50/p90/p99 averaged\): TTFT [\d.]+% +TPOT [\d.]+% +ITL [\d.]+% +E2E", res.output
    )
    assert line and res.output.index("percentile error") < res.output.index("per request, in arrival order")


def test_validate_without_db_is_one_clear_error(configs) -> None:
    db, a, _ = configs
    res = runner.invoke(app, ["validate", str(a), "--db", str(db.parent / "none.db")])
    assert res.exit_code != 0 and isinstance(res.exception, DoolyError)
    assert "no such profile database" in str(res.exception)


def test_help_texts() -> None:
    for cmd in ("plan", "profile", "validate"):
        res = runner.invoke(app, [cmd, "--help"])
        assert res.exit_code == 0 and "--db" in res.output


def _foreign_sqlite(path: Path) -> bytes:
    """A user's own SQLite file (rollback journal, one table of data): dooly must never alter it."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.executemany("INSERT INTO users (name) VALUES (?)", [("ada",), ("grace",)])
    con.commit()
    con.close()
    return path.read_bytes()


def _db_commands(model: Path, db: Path, out: Path) -> list[list[str]]:
    """Every command that takes --db, with the cheapest arguments that reach the database."""
    return [
        ["plan", str(model), "--db", str(db), "--grid", "tiny"],
        ["profile", str(model), "--db", str(db), "--grid", "tiny", "--no-calibrate"],
        ["validate", str(model), "--db", str(db), "--repeats", "1", "--rounds", "1"],
        ["simulate", str(model), "--db", str(db), "--workload", "poisson:n=4,rate=2,prompt=8-16,output=2-4,seed=0"],
        ["validate-serving", str(model), "--db", str(db), "--real-runs", "1"],
        ["export-vidur", str(model), "--db", str(db), "-o", str(out / "vidur")],
        ["report", "--db", str(db), "-o", str(out / "r.html")],
    ]


def test_a_foreign_sqlite_file_is_refused_untouched_by_every_command(configs, tmp_path: Path) -> None:
    _, a, _ = configs
    foreign = tmp_path / "users.sqlite"
    before = _foreign_sqlite(foreign)
    listing = sorted(p.name for p in tmp_path.iterdir())
    for cmd in _db_commands(a, foreign, tmp_path):
        res = runner.invoke(app, cmd)
        assert isinstance(res.exception, DoolyError), (cmd[0], res.output, res.exception)
        assert "not a dooly profile database" in str(res.exception) and "\n" not in str(res.exception), cmd[0]
        assert foreign.read_bytes() == before, f"{cmd[0]} altered a foreign SQLite file"
        assert sorted(p.name for p in tmp_path.iterdir()) == listing, f"{cmd[0]} left files beside it"


def test_reading_commands_never_write_the_db_nor_create_one(configs, monkeypatch) -> None:
    db, a, b = configs
    monkeypatch.setenv("DOOLY_THREADS", "1")
    before = db.read_bytes()
    res = runner.invoke(app, ["plan", str(a), str(b), "--db", str(db), "--grid", "tiny"])
    assert res.exit_code == 0, res.output
    assert db.read_bytes() == before  # no signatures registered, no WAL switch, no trace cached
    missing = db.parent / "never.db"
    res = runner.invoke(app, ["plan", str(a), "--db", str(missing), "--grid", "tiny"])
    assert res.exit_code == 0 and "to profile now" in res.output
    assert not missing.exists()


def test_bad_input_leaves_no_db_behind(configs) -> None:
    _, a, _ = configs
    bad = a.parent / "bad.json"
    bad.write_text(json.dumps({"model_type": "nonexistent_arch"}))
    new = a.parent / "new.db"
    for cmd in (["plan", str(bad)], ["profile", str(bad), "--grid", "tiny"], ["profile", "no-such-model"]):
        res = runner.invoke(app, [*cmd, "--db", str(new)])
        assert res.exit_code == 1, res.output
        assert not new.exists(), f"{cmd} left {new} behind"
    res = runner.invoke(app, ["profile", str(a), "--db", str(new), "--grid", "nonsense"])
    assert isinstance(res.exception, DoolyError) and not new.exists()


def test_a_model_too_large_to_calibrate_is_refused_before_profiling(configs, monkeypatch) -> None:
    from dooly.engines import base

    _, a, _ = configs
    new = a.parent / "new.db"
    monkeypatch.setattr(base, "free_memory_bytes", lambda device: 1000)
    res = runner.invoke(app, ["profile", str(a), "--db", str(new), "--grid", "tiny"])
    assert isinstance(res.exception, DoolyError) and not new.exists()
    want = r"tiny-a: its weights take (at least )?.*B in bfloat16 .*\(`--no-calibrate` profiles its operators alone"
    assert re.search(want, str(res.exception))


def test_one_unlabelable_model_is_one_line_and_the_rest_is_planned(configs) -> None:
    db, a, b = configs
    bad = a.parent / "weird.json"
    bad.write_text(json.dumps({"model_type": "nonexistent_arch"}))
    res = runner.invoke(app, ["plan", str(a), str(bad), str(b), "--db", str(db), "--grid", "tiny"])
    assert res.exit_code == 1
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "nonexistent_arch" in errors[0]
    assert "tiny-a" in res.output and "tiny-b" in res.output and "to profile now" in res.output


def test_validate_suggests_a_profile_command_that_works(configs) -> None:
    db, a, _ = configs  # traced (seeded) but never profiled
    res = runner.invoke(app, ["validate", str(a), "--db", str(db), "--repeats", "1", "--method", "interp"])
    assert isinstance(res.exception, DoolyError), res.output
    hint = re.search(r"run `(dooly profile .*?)`", str(res.exception))
    assert hint, str(res.exception)
    argv = shlex.split(hint.group(1))
    assert argv == ["dooly", "profile", str(a), "--db", str(db)]
    assert resolve_model(argv[2])[0] == "tiny-a"  # the model argument resolves (the file stem would not)


def test_plan_triage_budget_and_validate_from_shape(configs, monkeypatch) -> None:
    """tiny-b differs from tiny-a only in its MLP width: its four new linears are predictable from tiny-a's (six
    linears profiled), its silu is not (a kind with one profiled signature has no model)."""
    db, a, b = configs
    monkeypatch.setenv("DOOLY_THREADS", "1")
    res = runner.invoke(app, ["profile", str(a), "--db", str(db), "--grid", "tiny", "--no-calibrate"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["validate", str(a), "--db", str(db), "--repeats", "1", "--rounds", "1"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    # tiny-a alone in the DB has no zero-new-points figure, and the reason is not "run `dooly profile`": it was
    # just profiled, and there is no other model to predict it from
    assert "no zero new points figure" in text and "holds no profiled model but tiny-a" in text, text
    assert "no shared overhead figure" in text and "no calibrated model but tiny-a" in text, text
    res = runner.invoke(app, ["plan", str(b), "--db", str(db), "--grid", "tiny", "--budget", "1"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    found = re.search(r"(\d+) reused exactly from the DB; (\d+) new: (\d+) predictable from shape alone.*?(\d+) of "
                      r"kinds never profiled here", text)  # fmt: skip
    assert found, text
    reused, new, covered, uncovered = map(int, found.groups())
    assert (new, covered, uncovered) == (5, 4, 1) and reused > 0
    assert re.search(
        r"--budget 1: measure 2 signatures \(1 uncovered \+ 1 least certain; about [\d.]+ device-s "
        r"predicted\), predict 3 from shape",
        text,
    ), text
    # a device-time cap: 0 s measures only what no shape model covers (and says the cap is exceeded), a large
    # one measures everything; a count and a cap together are refused
    res = runner.invoke(app, ["plan", str(b), "--db", str(db), "--grid", "tiny", "--budget-seconds", "0"])
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "--budget-seconds 0: measure 1 signatures (1 uncovered + 0 least certain" in text
    assert "more than --budget-seconds 0: they are measured anyway" in text
    res = runner.invoke(app, ["plan", str(b), "--db", str(db), "--grid", "tiny", "--budget-seconds", "1e6"])
    assert "measure 5 signatures (1 uncovered + 4 least certain" in " ".join(res.output.split()), res.output
    res = runner.invoke(app, ["plan", str(b), "--db", str(db), "--grid", "tiny", "--budget", "1",
                              "--budget-seconds", "5"])  # fmt: skip
    assert res.exit_code != 0 and "not both" in str(res.exception)
    res = runner.invoke(app, ["profile", str(b), "--db", str(db), "--grid", "tiny", "--no-calibrate", "--budget", "1"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "3 signatures left to the shape model" in text
    # "skipped" counts tiny-b's own signatures found in the DB, not tiny-a's that tiny-b never runs
    unique, skipped = map(int, re.search(r"(\d+) unique signatures; (\d+) skipped as already in the DB", text).groups())
    assert skipped == reused and unique == reused + new, text
    assert f"{reused} signatures already in the DB" in text
    res = runner.invoke(app, ["validate", str(b), "--db", str(db), "--repeats", "1", "--rounds", "1"])
    assert res.exit_code != 0 and "have no profile" in str(res.exception)
    res = runner.invoke(app, ["validate", str(b), "--db", str(db), "--repeats", "1", "--rounds", "1", "--shape",
                              "--method", "interp"])  # fmt: skip
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "(exact reuse + shape)" in text
    shaped = re.search(r"profile: .*?from shape alone: prefill (\d+) of \d+, decode (\d+) of", text)
    assert shaped and int(shaped[1]) + int(shaped[2]) == 3, text
    sim = ["simulate", str(b), "--db", str(db), "--workload", "poisson:n=4,rate=2,prompt=8-16,output=2-4,seed=0"]
    res = runner.invoke(app, sim)
    assert res.exit_code != 0 and "have no profile" in str(res.exception)
    res = runner.invoke(app, [*sim, "--shape"])
    assert res.exit_code == 0, res.output
    # zero new points: every signature only tiny-b needs is held out of the DB and of the fit, even if measured
    from dooly.engines import get_engine
    from dooly.predict.predictor import Predictor

    held = Predictor.for_model(str(b), db, get_engine(), threads=1, method="interp", holdout=True, strict=False)
    predicted = {f.signature.op for fills in held.shape_predicted.values() for f in fills}
    assert predicted == {"aten.linear.default"}
    assert sum(len(f) for f in held.shape_predicted.values()) == 4  # tiny-b's four own linears, one measured


def test_budget_seconds_takes_the_least_certain_that_fit_after_the_uncovered() -> None:
    from dooly.profile.budget import ShapeTriage

    tr = ShapeTriage(reused=set(), uncovered={"u"}, covered={"a": 9.0, "b": 5.0, "c": 1.0},
                     cost_s={"u": 2.0, "a": 4.0, "b": 10.0, "c": 3.0})  # fmt: skip
    assert tr.uncovered_s == 2.0
    assert tr.within_seconds(1.0) == []  # the uncovered one already spends more than the cap
    assert tr.within_seconds(6.0) == ["a"]  # a (4 s) fits after u (2 s); b and c no longer do
    assert tr.within_seconds(9.0) == ["a", "c"]  # b (10 s) is skipped, the cheaper c after it still fits
    assert tr.within_seconds(100.0) == ["a", "b", "c"]


def test_validate_says_when_the_machine_was_busy(configs, monkeypatch) -> None:
    """Rounds of the same shapes that land far apart get a note naming the cause; rounds that agree get none."""
    import dooly.profile
    from dooly.db.store import Measurement

    db, a, _ = configs
    monkeypatch.setenv("DOOLY_THREADS", "1")
    res = runner.invoke(app, ["profile", str(a), "--db", str(db), "--grid", "tiny", "--no-calibrate"])
    assert res.exit_code == 0, res.output
    for slow, noted in ((1.0, False), (1.5, True)):
        seen: set[tuple] = set()

        def fake_forward(_engine, _model, phase, values, *_a, slow=slow, seen=seen, **_k):
            # a shape's second round runs `slow` times longer than its first
            key = (phase, tuple(sorted(values.items())))
            s = 0.01 * (slow if key in seen else 1.0)
            seen.add(key)
            return Measurement(s, s, s, 1, s)

        monkeypatch.setattr(dooly.profile, "measure_forward", fake_forward)
        res = runner.invoke(app, ["validate", str(a), "--db", str(db), "--repeats", "1", "--method", "interp"])
        assert res.exit_code == 0, res.output
        assert ("something else held the CPU" in res.output) is noted, res.output


def test_long_steps_print_a_line_at_least_once_a_minute_in_a_log(monkeypatch) -> None:
    import io
    import time

    from rich.console import Console

    import dooly.cli.profile as cli

    buf = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=buf, force_terminal=False, width=200))
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    with cli._Steps("calibrating m") as steps:
        for done, t in ((0, 0), (1, 10), (2, 50), (3, 70), (4, 100), (5, 140), (6, 150)):
            now[0] = 1000.0 + t
            steps(done, 6, f"shape {done}")
    lines = buf.getvalue().splitlines()
    assert [ln.split(" ", 1)[1] for ln in lines] == [
        "calibrating m: 0/6 shapes, 0s elapsed (shape 0)",
        "calibrating m: 3/6 shapes, 1m10s elapsed, about 1m10s left (shape 3)",  # a minute after the last line
        "calibrating m: 5/6 shapes, 2m20s elapsed, about 28s left (shape 5)",
        "calibrating m: 6/6 shapes, 2m30s elapsed (shape 6)",
    ]


def test_profiling_points_print_a_line_at_least_once_a_minute_in_a_log(monkeypatch) -> None:
    import io
    import time

    from rich.console import Console

    import dooly.cli.profile as cli

    buf = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=buf, force_terminal=False, width=200))
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    with cli._points_bar("profiling", 100) as advance:
        for n, t in ((10, 30), (20, 65), (70, 90)):  # a job's points, when the job ends
            now[0] = 1000.0 + t
            advance(n)
    lines = [ln.split(" ", 1)[1] for ln in buf.getvalue().splitlines()]
    assert lines == [
        "profiling: 0/100 points, 0s elapsed",
        "profiling: 30/100 points, 1m05s elapsed, about 2m32s left",
        "profiling: 100/100 points, 1m30s elapsed",
    ]


def test_calibration_reports_each_shape(tmp_path: Path) -> None:
    from dooly.db.store import ProfileStore
    from dooly.engines import get_engine
    from dooly.profile import calibrate, context_for

    cfg = tiny_config("tiny-cal")
    shapes = {"prefill": [{"requests": 1, "tokens": 8}], "decode": [{"requests": 2, "kv_len": 16}]}
    seen = []
    engine = get_engine()
    seed_traces(tmp_path / "p.db", cfg)
    with ProfileStore(tmp_path / "p.db") as st:
        calibrate(
            "tiny-cal",
            cfg,
            st,
            engine,
            context_for(engine, 1),
            shapes=shapes,
            threads=1,
            repeats=1,
            on_step=lambda d, t, w: seen.append((d, t, w)),
        )
    total = 2 * 2 * 2  # two depths, two rounds, two shapes
    assert seen[0] == (0, total, "building tiny-cal")
    assert [d for d, t, w in seen if not w.startswith("building")] == list(range(1, total + 1))
    assert seen[-1][:2] == (total, total) and "decode requests=2 kv_len=16" in seen[-1][2]


def test_profile_resolves_each_model_once(configs, monkeypatch) -> None:
    import dooly.core.zoo

    db, a, b = configs
    monkeypatch.setenv("DOOLY_THREADS", "1")
    looked_up: list[str] = []
    load_config = dooly.core.zoo.load_config
    monkeypatch.setattr(dooly.core.zoo, "load_config", lambda m: looked_up.append(str(m)) or load_config(m))
    res = runner.invoke(app, ["profile", str(a), str(b), "--db", str(db), "--grid", "tiny", "--calibrate", "check"])
    assert res.exit_code == 0, res.output
    assert sorted(looked_up) == sorted([str(a), str(b)])
