"""Run the tracesynth CLI as a user would (a subprocess), for tests that check exit codes and stderr.

A subprocess is the honest check for "no traceback": the real entry point, its error handling and
interpreter exit all run. (tests/ is on sys.path because it holds the top conftest.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


@dataclass
class Result:
    code: int
    out: str
    err: str
    timed_out: bool = False


def tracesynth(*args: object, timeout: float = 120, cwd: Path | None = None) -> Result:
    """`python -m tracesynth ARGS` with this checkout's sources; a hang is reported, not waited for."""
    env = dict(os.environ, PYTHONPATH=str(SRC), COLUMNS="200", NO_COLOR="1", TRACESYNTH_SALT="test-salt")
    try:
        p = subprocess.run(
            [sys.executable, "-m", "tracesynth", *map(str, args)],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        return Result(-1, str(exc.stdout or ""), str(exc.stderr or ""), timed_out=True)
    return Result(p.returncode, p.stdout, p.stderr)


def one_line_error(r: Result) -> str:
    """The single error line of a refused command (asserts there is exactly one and no traceback)."""
    assert r.code == 1, (r.code, r.err)
    assert "Traceback" not in r.err, r.err
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.err
    return lines[0]
