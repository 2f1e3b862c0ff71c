"""A watchdog between dooly and a server it starts, so that nothing the server spawns outlives dooly.

``python _reaper.py PARENT_PID -- CMD...`` (started by :func:`spawn`, a session of its own) runs CMD in its
session and waits. When dooly (PARENT_PID) dies -- SIGKILL included, which no handler in dooly can see -- it
signals every process of its session (SIGTERM, then SIGKILL after a grace period) and exits: the server and
everything it spawned go with it (vLLM's engine core, its workers, multiprocessing's resource tracker), not
only the direct child that ``PR_SET_PDEATHSIG`` would reach. It is also a child subreaper, so grandchildren
orphaned by the server's own death are reaped here rather than left to init.

SIGTERM or SIGINT to the reaper (dooly stopping the server) is passed on to CMD's process group; once CMD is
gone the reaper kills what is left of the session and exits with CMD's status. :func:`kill_session` is the
last resort when the reaper itself does not stop.

Standard library only and run as a file, not ``-m``: it starts in tens of milliseconds and imports nothing of
dooly's (no torch).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# SIGTERM first: vLLM's API server shuts its engine core down cleanly within a few seconds
GRACE_S = float(os.environ.get("DOOLY_REAPER_GRACE_S", "10"))
POLL_S = 0.2


def _prctl(what: int, arg: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(what, arg, 0, 0, 0)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """For a ``preexec_fn``: the child gets ``sig`` when the thread that forked it exits (Linux only; no-op
    elsewhere). Fork from the main thread, or a worker thread's end kills the child."""
    _prctl(PR_SET_PDEATHSIG, int(sig))


def session_pids(sid: int) -> list[int]:
    """Every process of session ``sid`` but this one, zombies included (from /proc; empty where it cannot be
    read)."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            if os.getsid(int(d.name)) == sid:
                out.append(int(d.name))
        except OSError:
            continue  # gone meanwhile
    return out


def mapped_segments(pids: list[int], prefix: str = "psm_") -> set[Path]:
    """The /dev/shm files named ``<prefix>*`` that processes ``pids`` have mapped (from /proc/PID/maps; a process
    that cannot be read is skipped). vLLM's message queues are Python shared memory (``psm_*``) that its resource
    tracker unlinks; when a server's session is killed, the tracker dies with it and they stay: these are the
    names to remove then."""
    out: set[Path] = set()
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            at = line.find(f"/dev/shm/{prefix}")
            if at >= 0:
                out.add(Path(line[at:].removesuffix(" (deleted)")))
    return out


def remove_mapped(segments: set[Path]) -> None:
    """Unlink ``segments`` (from :func:`mapped_segments`) once their processes are dead; a clean exit unlinked them
    already, and one that cannot be removed is left."""
    for segment in segments:
        with contextlib.suppress(OSError):
            segment.unlink(missing_ok=True)


def _reap(keep: int | None = None) -> None:
    """Reap exited children (orphans handed to this subreaper), but leave ``keep``'s status to its Popen."""
    with contextlib.suppress(ChildProcessError):
        while (info := os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)) is not None:
            if info.si_pid == keep:
                return
            os.waitpid(info.si_pid, 0)


def kill_session(sid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every process of session ``sid`` (this one excepted)."""
    for pid in session_pids(sid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _kill_session(grace_s: float) -> None:
    """SIGTERM to every process of this session, SIGKILL to those still alive after ``grace_s``."""
    sid = os.getsid(0)
    segments = mapped_segments(session_pids(sid))  # read while they live: a SIGKILL takes their resource trackers
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        kill_session(sid, sig)
        while session_pids(sid) and time.monotonic() < deadline:
            _reap()  # zombies still count as processes of the session until reaped
            time.sleep(0.05)
        deadline = time.monotonic() + 5.0
    _reap()
    remove_mapped(segments)


def _parent_gone(parent: int, pidfd: int | None) -> bool:
    if os.getppid() != parent:
        return True
    if pidfd is None:
        return False
    return bool(select.select([pidfd], [], [], 0)[0])


def run(parent: int, cmd: list[str]) -> int:
    """Run ``cmd`` until it exits (its status) or ``parent`` dies (every process of the session killed)."""
    if os.getppid() != parent:
        return 1  # dooly died before we started: start nothing
    if os.getsid(0) != os.getpid():
        try:
            os.setsid()  # the session is what gets killed: never the caller's (a terminal's, a test runner's)
        except OSError:
            print("_reaper.py: cannot lead a session of its own (start it with start_new_session)", file=sys.stderr)
            return 2
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGUSR1))  # wakes the poll below at once (the handler does nothing)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    pidfd = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(parent)
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: stop.append(s))
    child = subprocess.Popen(cmd, process_group=0)  # a stop signal reaches CMD and its children once, from here
    forwarded = 0
    while True:
        for sig in stop[forwarded:]:
            forwarded += 1
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, sig)
        if child.poll() is not None:
            _kill_session(GRACE_S)  # what the server left behind
            return child.returncode if child.returncode >= 0 else 128 - child.returncode
        if _parent_gone(parent, pidfd):
            _kill_session(GRACE_S)
            return 1
        if pidfd is not None:
            with contextlib.suppress(InterruptedError):
                select.select([pidfd], [], [], POLL_S)
        else:
            time.sleep(POLL_S)
        _reap(keep=child.pid)


def command(cmd: list[str], parent: int | None = None) -> list[str]:
    """``cmd`` run under the reaper, watching ``parent`` (this process by default)."""
    parent = os.getpid() if parent is None else parent
    return [sys.executable, "-I", str(Path(__file__).resolve()), str(parent), "--", *cmd]


def spawn(cmd: list[str], **popen: object) -> subprocess.Popen:
    """``subprocess.Popen(cmd)`` under the reaper, in a session of its own whose id is the returned process's
    pid (the reaper's: SIGTERM it to stop CMD and everything CMD started)."""
    return subprocess.Popen(command(cmd), start_new_session=True, **popen)  # type: ignore[call-overload]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: _reaper.py PARENT_PID -- CMD...", file=sys.stderr)
        return 2
    return run(int(argv[0]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
