"""Issue 45, item 5: the token models train under torchrun with two CPU processes (DDP, gloo). Rank 0 writes one
model that `tracesynth sample` loads; both ranks run the same steps (the saved history's rank_steps), stop at the
same step under --time-limit and continue a --resume from the checkpoint's step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tracesynth.cli import app
from tracesynth.io import read_trace

REPO = Path(__file__).resolve().parents[2]
TINY = ["--context", "16", "--d-model", "16", "--layers", "1", "--batch-size", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "real.parquet"
    read_trace(REPO / "data" / "sqlite.parquet").slice(20000, 21000).save(path)
    return path


@pytest.fixture(autouse=True)
def rank_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("torchrun")))  # torchrun's agent leaves a directory
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on a shared CPU
    yield
    torch.set_num_threads(n)


def fit_on_two(*args: object) -> str:
    """`torchrun --standalone --nproc-per-node=2 -m tracesynth fit ARGS` (offline: a local rendezvous); what it
    printed (the CLI prints to stderr)."""
    exe = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    if not Path(exe).exists():
        pytest.skip("torchrun is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "NO_COLOR": "1"}
    cmd = [exe, "--standalone", "--nproc-per-node=2", "-m", "tracesynth", "fit", *map(str, args), *TINY]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return " ".join((res.stdout + res.stderr).split())


def history(model: Path) -> dict[str, Any]:
    return json.loads((model / "config.json").read_text())["history"]


def test_ar_on_two_processes_writes_one_model_stops_in_step_and_resumes_in_step(real: Path, tmp_path: Path) -> None:
    """One model from two ranks; --time-limit stops both at the same step (every token kind shares the training
    loop and its agreement on the time: tokens.py); --resume continues from that step on both."""
    m = tmp_path / "m"
    fit_on_two(real, "-o", m, "--kind", "ar", "--steps", 100000, "--time-limit", 2, "--checkpoint-every", 20)
    h = history(m)
    done = h["steps"]
    assert 0 < done < 100000 and h["rank_steps"] == [done, done] and h["processes"] == 2
    assert h["train_seconds"] >= 1.5  # rank 0's clock; the slower rank's reached the limit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # one model, no leftover of a second writer
    res = CliRunner().invoke(app, ["sample", str(m), "--events", "40", "-o", str(tmp_path / "s.parquet")])
    assert res.exit_code == 0, res.output
    assert len(read_trace(tmp_path / "s.parquet")) == 40
    out = fit_on_two(real, "-o", m, "--resume", "--steps", done + 2, "--checkpoint-every", 2)
    assert f"at step {done}" in out
    h = history(m)
    assert h["steps"] == done + 2 and h["rank_steps"] == [done + 2] * 2


# block and masked run the same training loop under torchrun with their own losses: their runs are in
# `make test-all` (a torchrun costs ~12 s of CPU, ~30 s on a busy machine)
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["block", "masked"])
def test_a_time_limit_stops_both_ranks_at_the_same_step(kind: str, real: Path, tmp_path: Path) -> None:
    m = tmp_path / "m"
    fit_on_two(real, "-o", m, "--kind", kind, "--steps", 100000, "--time-limit", 2)
    h = history(m)
    assert 0 < h["steps"] < 100000 and h["rank_steps"] == [h["steps"]] * 2
    assert h["train_seconds"] >= 1.5  # rank 0's clock; the slower rank's reached the limit
