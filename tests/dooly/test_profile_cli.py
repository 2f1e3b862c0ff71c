"""`dooly plan`, `dooly profile`, `dooly validate` on tiny configs (traces seeded, tiny grid)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_profile_fixtures import seed_traces, tiny_config
from typer.testing import CliRunner

from dooly.cli import app
from dooly.errors import DoolyError

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


def test_validate_without_db_is_one_clear_error(configs) -> None:
    db, a, _ = configs
    res = runner.invoke(app, ["validate", str(a), "--db", str(db.parent / "none.db")])
    assert res.exit_code != 0 and isinstance(res.exception, DoolyError)
    assert "no such profile database" in str(res.exception)


def test_help_texts() -> None:
    for cmd in ("plan", "profile", "validate"):
        res = runner.invoke(app, [cmd, "--help"])
        assert res.exit_code == 0 and "--db" in res.output
