"""Two CPU processes under torchrun (DDP, gloo) train and save a model in the 1-process format."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from tracesynth.cli import app
from tracesynth.trace import Trace

ARGS = ["--kind", "diffusion", "--context", "32", "--steps", "2", "--d-model", "32", "--layers", "1"]
ARGS += ["--batch-size", "2"]


def small_trace(n: int = 400) -> Trace:
    rng = np.random.default_rng(0)
    events = np.array(["sys_enter_read", "sys_exit_read", "sched_switch"])[np.arange(n) % 3]
    return Trace.from_columns(
        np.cumsum(rng.integers(10, 900, n)), events, cpu=rng.integers(0, 2, n), tid=rng.integers(1, 4, n)
    )


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on a shared CPU
    yield
    torch.set_num_threads(n)


def test_torchrun_two_cpu_processes_save_the_same_format(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    if not Path(torchrun).exists():
        pytest.skip("torchrun is not installed")
    small_trace().save(tmp_path / "real.parquet")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}  # torchrun's agent leaves a directory
    cmd = [torchrun, "--standalone", "--nproc-per-node=2", "-m", "tracesynth"]
    cmd += ["fit", str(tmp_path / "real.parquet"), "-o", str(tmp_path / "m2"), *ARGS]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    # the 1-process reference runs in this process (same code path, no process group)
    res1 = CliRunner().invoke(app, ["fit", str(tmp_path / "real.parquet"), "-o", str(tmp_path / "m1"), *ARGS])
    assert res1.exit_code == 0, res1.output
    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    assert sorted(p.name for p in m1.iterdir()) == sorted(p.name for p in m2.iterdir())
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert tensor_shapes(m1 / name) == tensor_shapes(m2 / name), name
    c1, c2 = (json.loads((m / "config.json").read_text()) for m in (m1, m2))
    assert c1["config"] == c2["config"] and c1["step"] == c2["step"] == 2
    assert (m1 / "vocab.json").read_text() == (m2 / "vocab.json").read_text()
