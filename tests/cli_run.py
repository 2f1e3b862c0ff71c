"""Run the tracesynth CLI as a user would (a subprocess), for tests that check exit codes and stderr.

A subprocess is the honest check for "no traceback": the real entry point, its error handling and
interpreter exit all run. (tests/ is on sys.path because it holds the top conftest.py.) A fuzz suite runs
its first case that way and the rest through :func:`dooly_in_process`, which pays torch's imports once.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator, Mapping
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


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _in(cwd: Path, env: Mapping[str, str], timeout: int) -> Iterator[None]:
    """Run a block in ``cwd`` with ``env`` set, raising _Hang after ``timeout`` s; everything is put back."""
    old_env = {k: os.environ.get(k) for k in env}
    old_cwd, old_alarm = os.getcwd(), signal.getsignal(signal.SIGALRM)
    old_term = signal.getsignal(signal.SIGTERM)  # the CLI installs its own; pytest's comes back

    def ring(signum, frame):  # noqa: ANN001
        raise _Hang(f"no exit within {timeout} s")

    os.environ.update(env)
    os.chdir(cwd)
    signal.signal(signal.SIGALRM, ring)
    signal.alarm(timeout)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGTERM, old_term)
        os.chdir(old_cwd)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dooly_in_process(argv: list[str], cwd: Path, env: Mapping[str, str], timeout: int = 180) -> Result:
    """`dooly ARGV` through its real entry point (``dooly.cli.app.main``) in this process. An exception that
    escapes main() is put on ``err`` as the traceback a user would see; a hang is ``timed_out``."""
    from dooly.cli import main  # registers every command, as `python -m dooly` does

    out, err = io.StringIO(), io.StringIO()
    code, timed_out = 0, False
    argv0 = sys.argv
    sys.argv = ["dooly", *map(str, argv)]
    try:
        with _in(cwd, env, timeout), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except _Hang:
        code, timed_out = -1, True
    except BaseException:  # noqa: BLE001 - anything else is the traceback a user would see
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv = argv0
    return Result(code, out.getvalue(), err.getvalue(), timed_out)
