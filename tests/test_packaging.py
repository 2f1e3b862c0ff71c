"""The wheel: built from this checkout, installed in a clean venv, both tools run from outside the repo.

Offline: the wheel is built without build isolation and installed with --no-deps; the clean venv
borrows the test venv's third-party packages through a .pth line (which, unlike the test venv's own
site dir, does not process its editable-install hook, so `src/` is never on the path).
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRACESYNTH_DATA")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    # build from a copy, so that the build's own egg-info/build dirs never land in the checkout
    src = tmp / "src-copy"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "out", "data", "*.egg-info", "build"))
    r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
              "-w", str(tmp / "dist"), str(src)], cwd=tmp)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp / "dist").glob("*.whl")
    venv = tmp / "venv"
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    assert r.returncode == 0, r.stderr
    purelib = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        cwd=tmp).stdout.strip())
    deps = [p for p in site.getsitepackages() + [sysconfig.get_path("purelib")] if Path(p).is_dir()]
    (purelib / "test-deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    r = _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
              "--no-index", str(wheel)], cwd=tmp)
    assert r.returncode == 0, r.stderr
    return venv


def test_wheel_runs_both_tools_outside_the_repo(installed: Path, tmp_path: Path) -> None:
    bin_ = installed / "bin"
    r = _run([str(bin_ / "python"), "-c", "import tracesynth, dooly; print(tracesynth.__file__, dooly.__file__)"],
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(REPO / "src") not in r.stdout and str(installed) in r.stdout, r.stdout
    for tool in ("tracesynth", "dooly"):
        r = _run([str(bin_ / tool), "--help"], cwd=tmp_path)
        assert r.returncode == 0 and "Usage" in r.stdout, r.stderr
    # the shipped configs come from package data, not from a checkout
    r = _run([str(bin_ / "tracesynth"), "experiment", "--help"], cwd=tmp_path)
    assert r.returncode == 0 and "regimes" in r.stdout, r.stdout + r.stderr
    # one small real command each
    shutil.copy(REPO / "data" / "sqlite.parquet", tmp_path / "sqlite.parquet")
    r = _run([str(bin_ / "tracesynth"), "info", "sqlite.parquet"], cwd=tmp_path)
    assert r.returncode == 0 and "sqlite" in r.stdout, r.stdout + r.stderr
    r = _run([str(bin_ / "dooly"), "zoo"], cwd=tmp_path)
    assert r.returncode == 0 and "smollm2-135m" in r.stdout, r.stdout + r.stderr
    # outside a checkout, with no data/ here, the demo says where the dataset must come from
    r = _run([str(bin_ / "tracesynth"), "demo", "-o", "out"], cwd=tmp_path)
    assert r.returncode == 1 and "--data" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_dooly_does_not_load_tracesynth() -> None:
    code = (
        "import sys, dooly.cli, dooly.report, dooly.simulator.metrics, dooly.simulator.workload, dooly.vidur_export;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tracesynth', 'pyarrow'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
