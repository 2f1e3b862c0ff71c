"""Nothing dooly starts outlives it: the reaper kills a server's whole session when dooly dies, SIGKILL included
(a stand-in server that forks a grandchild), and a real `dooly validate-serving --engine vllm` killed with
SIGKILL leaves no vLLM process (slow: `make test-all`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dooly.engines import _reaper

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
# a server that forks a worker and ignores SIGTERM in it (only SIGKILL stops it), both writing their pids; the
# worker holds Python shared memory, as vLLM's message queues are (its name written beside the pids)
STANDIN = (
    "import os, signal, sys, time\n"
    "if os.fork() == 0:\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    from multiprocessing import shared_memory\n"
    "    m = shared_memory.SharedMemory(create=True, size=4096)\n"
    "    open(sys.argv[1] + '-shm.' + m.name, 'w').close()\n"
    "open(sys.argv[1] + '.' + str(os.getpid()), 'w').close()\n"
    "time.sleep(600)\n"
)
# dooly's stand-in: starts the server under the reaper, says the reaper's pid, then waits to be killed
PARENT = (
    "import sys, time\n"
    "from dooly.engines import _reaper\n"
    "p = _reaper.spawn([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    """Running (a zombie, already dead and waiting for init to reap it, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone_within(pids: Callable[[], list[int]], limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not [p for p in pids() if _alive(p)]:
            return True
        time.sleep(0.1)
    return False


def _wait_for(cond: Callable[[], bool], limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "the stand-in server did not start"
        time.sleep(0.05)


def _started(tmp_path: Path) -> list[int]:
    return [int(p.suffix[1:]) for p in tmp_path.glob("server.*")]


def test_sigkilled_parent_takes_the_server_and_its_children_with_it(tmp_path):
    env = {**ENV, "DOOLY_REAPER_GRACE_S": "0.5"}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, STANDIN, str(tmp_path / "server")], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        sid = int(parent.stdout.readline())
        _wait_for(lambda: len(_started(tmp_path)) == 2 and any(tmp_path.glob("server-shm.*")))
        servers = _started(tmp_path)
        assert all(os.getsid(p) == sid for p in servers)
        segments = [Path("/dev/shm") / p.suffix[1:] for p in tmp_path.glob("server-shm.*")]
        assert all(s.exists() for s in segments)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone_within(lambda: [sid, *servers], 10.0), "server processes outlived their parent"
        assert not [p for p in _reaper.session_pids(sid) if _alive(p)]
        # the killed session's resource tracker would have unlinked it: the reaper did
        assert not [s for s in segments if s.exists()]
    finally:
        parent.kill()
        parent.wait()
        _reaper.kill_session(sid if "sid" in locals() else -1)
        for s in tmp_path.glob("server-shm.*"):
            (Path("/dev/shm") / s.suffix[1:]).unlink(missing_ok=True)


def test_sigterm_to_the_reaper_stops_the_server_with_its_status(tmp_path):
    proc = _reaper.spawn([sys.executable, "-c", "import time; time.sleep(600)"], env=ENV)
    try:
        _wait_for(lambda: len(_reaper.session_pids(proc.pid)) >= 2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert _gone_within(lambda: _reaper.session_pids(proc.pid), 10.0)
    finally:
        _reaper.kill_session(proc.pid)
        proc.wait()


def test_the_server_status_is_the_reapers():
    proc = _reaper.spawn([sys.executable, "-c", "raise SystemExit(3)"])
    assert proc.wait(30) == 3


def test_an_orphaned_reaper_starts_nothing(tmp_path):
    flag = tmp_path / "started"
    not_my_parent = os.getpid()  # the reaper's parent is the shell below, not this process
    cmd = _reaper.command([sys.executable, "-c", f"open({str(flag)!r}, 'w')"], parent=not_my_parent)
    proc = subprocess.run(["sh", "-c", '"$@"', "sh", *cmd], start_new_session=True)
    assert proc.returncode == 1 and not flag.exists()


def test_die_with_parent_sets_the_death_signal():
    code = "import ctypes; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=_reaper.die_with_parent
    )
    assert int(out.stdout) == signal.SIGKILL


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _dooly(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dooly", *args], env=ENV, text=True, **kw)


@pytest.mark.slow
def test_sigkilled_validate_serving_leaves_no_vllm_process(tmp_path):
    """A real `dooly validate-serving --engine vllm` (smollm2-135m, the smallest zoo model), SIGKILLed while its
    server runs: the API server, engine core, workers and resource tracker are gone within 10 s. Minutes long
    (profiling the predictor's ops, vLLM's start-up)."""
    pytest.importorskip("vllm", reason="vllm is not installed")
    db = tmp_path / "p.db"
    prof = _dooly(
        "profile",
        "smollm2-135m",
        "--db",
        str(db),
        "--grid",
        "tiny",
        "--no-calibrate",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert prof.wait(900) == 0
    run = _dooly(
        "validate-serving",
        "smollm2-135m",
        "--db",
        str(db),
        "--engine",
        "vllm",
        "--workload",
        "poisson:n=400,rate=2,prompt=16-64,output=8-16,seed=0",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    sessions: list[int] = []
    try:
        for line in run.stderr:  # dooly says when the server is up (and has spawned its engine core)
            if "vllm serve up" in line:
                break
        assert run.poll() is None, "validate-serving ended before its server came up"
        sessions = [c for c in _children(run.pid) if os.getsid(c) == c]
        server = [p for s in sessions for p in _reaper.session_pids(s)]
        assert len(server) >= 3  # reaper, API server, engine core (and more)
        run.send_signal(signal.SIGKILL)
        run.wait()
        assert _gone_within(lambda: server, 10.0), f"vLLM outlived dooly: {[p for p in server if _alive(p)]}"
        assert not [p for s in sessions for p in _reaper.session_pids(s) if _alive(p)]
    finally:
        run.kill()
        run.wait()
        for s in sessions:
            _reaper.kill_session(s)
