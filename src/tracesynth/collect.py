"""Record real kernel traces of a workload with `perf record` and ingest them.

perf traces the workload's own process tree (it forks the command and inherits the events into
every child), on the tracepoints in EVENTS. `--duration` stops the tree after S seconds with
SIGINT (then SIGTERM/SIGKILL for what ignores it); perf itself is asked to stop last, so the
perf.data file is always complete. The perf.data file is decoded by streaming `perf script`
through the text parser (tracesynth.io.perf), and the trace is saved atomically.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from atomicio import atomic_path
from tracesynth.errors import TraceSynthError
from tracesynth.io.perf import PERF_CLOCK, perf_binary, read_perf_data
from tracesynth.trace import Trace
from tracesynth.workloads import get_workload

# Scheduler and syscalls (the core set), process life cycle, and what a task meets while it
# runs: user page faults, hard/soft interrupts and high-resolution timers (as in LTTng kernel traces).
EVENTS: tuple[str, ...] = (
    "sched:sched_switch",
    "sched:sched_wakeup",
    "sched:sched_wakeup_new",
    "sched:sched_process_fork",
    "sched:sched_process_exec",
    "sched:sched_process_exit",
    "raw_syscalls:sys_enter",
    "raw_syscalls:sys_exit",
    "exceptions:page_fault_user",
    "irq:irq_handler_entry",
    "irq:irq_handler_exit",
    "irq:softirq_entry",
    "irq:softirq_exit",
    "timer:hrtimer_start",
    "timer:hrtimer_cancel",
    "timer:hrtimer_expire_entry",
    "timer:hrtimer_expire_exit",
)
TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
# perf.data bytes per tracepoint sample (raw syscall samples dominate), for --events estimates.
BYTES_PER_EVENT = 100
_PERMISSION = (
    "perf may not record tracepoints here: set `sysctl kernel.perf_event_paranoid=-1` (or run as root / "
    "with CAP_PERFMON) and make tracefs readable (`mount -o remount,mode=755 /sys/kernel/tracing`)"
)


def host_fingerprint() -> str:
    """A stable, non-reversible id of this machine (hash of machine-id and hostname)."""
    mid = ""
    for p in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            mid = Path(p).read_text().strip()
            break
        except OSError:
            continue
    return hashlib.sha256(f"{mid}|{platform.node()}".encode()).hexdigest()[:16]


def check_tracing(events: Sequence[str] = EVENTS) -> str:
    """perf's path, or a TraceSynthError saying what to install or which setting blocks tracing."""
    exe = perf_binary()
    tracefs = next((t for t in TRACEFS if (t / "events").is_dir()), None)
    if tracefs is None:
        raise TraceSynthError(
            f"tracefs is not mounted or not readable (tried {', '.join(map(str, TRACEFS))}); " + _PERMISSION
        )
    missing = [e for e in events if not (tracefs / "events" / e.replace(":", "/")).is_dir()]
    if len(missing) == len(events):
        raise TraceSynthError(
            f"no tracepoint of {', '.join(events[:3])}, ... is visible under {tracefs}; " + _PERMISSION
        )
    return exe


def available_events(events: Sequence[str] = EVENTS) -> list[str]:
    """The subset of `events` this kernel offers (optional ones may be absent on other kernels)."""
    tracefs = next((t for t in TRACEFS if (t / "events").is_dir()), None)
    if tracefs is None:
        return list(events)
    return [e for e in events if (tracefs / "events" / e.replace(":", "/")).is_dir()]


def _children(pid: int) -> list[int]:
    """All descendants of pid, from /proc (the workload tree under perf)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _signal_tree(pid: int, sig: int) -> None:
    for c in _children(pid):
        try:
            os.kill(c, sig)
        except ProcessLookupError:
            pass


def record(
    command: str,
    perf_data: Path,
    duration: float | None = None,
    events: Sequence[str] = EVENTS,
    cwd: Path | None = None,
    log: Path | None = None,
    progress: Callable[[float], None] | None = None,
    target_events: int | None = None,
) -> dict[str, Any]:
    """Run `command` (a shell line) under `perf record`; returns facts about the run.

    With target_events the workload is stopped once perf.data holds about that many events
    (estimated from its size at BYTES_PER_EVENT), whichever comes first with `duration`.
    """
    exe = check_tracing(events)
    events = available_events(events)
    cmd = [exe, "record", "-e", ",".join(events), "-o", str(perf_data), "-m", "2048", "-N", "-B"]
    cmd += ["--", "/bin/sh", "-c", command]
    log = log or perf_data.with_suffix(".log")
    t0 = time.monotonic()
    stopped = False
    with open(log, "wb") as out, open(perf_data.with_suffix(".perf.log"), "wb") as perr:
        # The workload's output goes to the log; perf's own messages to a second log we inspect.
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=perr, stdin=subprocess.DEVNULL)
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - t0
                if progress:
                    progress(elapsed)
                enough = target_events is not None and _size(perf_data) >= target_events * BYTES_PER_EVENT
                if (enough or (duration is not None and elapsed >= duration)) and not stopped:
                    stopped = True
                    _stop_tree(proc)
                time.sleep(0.1)
        except BaseException:
            _stop_tree(proc)
            raise
    wall = time.monotonic() - t0
    perf_log = perf_data.with_suffix(".perf.log").read_text(errors="replace")
    if not perf_data.exists() or perf_data.stat().st_size == 0:
        _raise_perf_failure(perf_log, proc.returncode)
    lost = sum(int(m) for m in re.findall(r"lost (\d+) chunks", perf_log))
    workload_failed = proc.returncode not in (0, None) and not stopped
    if workload_failed:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        raise TraceSynthError(f"workload exited with status {proc.returncode}: {' '.join(tail) or 'no output'}")
    return {"wall_s": round(wall, 3), "stopped_after_s": round(wall, 1) if stopped else None, "lost_chunks": lost}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _stop_tree(proc: subprocess.Popen) -> None:
    """SIGINT the workload tree, then SIGTERM/SIGKILL stragglers; perf finishes its file after that."""
    for sig, wait in ((signal.SIGINT, 5.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        _signal_tree(proc.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None or not _children(proc.pid):
                break
            time.sleep(0.05)
        if proc.poll() is not None or not _children(proc.pid):
            break
    try:
        proc.wait(timeout=60)  # perf writes its header once the workload has gone
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def _raise_perf_failure(perf_log: str, code: int | None) -> None:
    low = perf_log.lower()
    if any(k in low for k in ("paranoid", "permission", "not permitted", "no permission", "access to performance")):
        raise TraceSynthError(_PERMISSION)
    if "tracefs" in low or "debugfs" in low or "can't access trace events" in low:
        raise TraceSynthError(_PERMISSION)
    lines = [ln.strip() for ln in perf_log.splitlines() if ln.strip()]
    raise TraceSynthError(f"perf record failed (status {code}): {lines[-1] if lines else 'no message'}")


def collect(
    command: str | None = None,
    workload: str | None = None,
    output: str | Path | None = None,
    duration: float | None = None,
    events: Sequence[str] = EVENTS,
    keep_perf_data: str | Path | None = None,
    progress: Callable[[float], None] | None = None,
    target_events: int | None = None,
) -> Trace:
    """Trace a catalogue workload (by name) or any shell command; save to `output` when given."""
    if (command is None) == (workload is None):
        raise TraceSynthError("name a catalogue workload or give --command, not both")
    name = workload or "command"
    if workload is not None:
        w = get_workload(workload)
        w.check()
        command = w.shell_command()
        duration = w.duration if duration is None else duration
    assert command is not None
    if duration is not None and duration <= 0:
        duration = None  # 0 means run to completion
    check_tracing(events)
    work = Path(tempfile.mkdtemp(prefix=f"tracesynth-{name}-"))
    try:
        perf_data = work / "perf.data"
        run_dir = work / "run"
        run_dir.mkdir()
        started = _dt.datetime.now(_dt.UTC)
        facts = record(command, perf_data, duration, events, run_dir, work / "workload.log", progress, target_events)
        meta = {
            "source_format": "perf-data",
            "workload": name,
            "command": command if workload is None else get_workload(workload).command,
            "kernel": platform.release(),
            "arch": platform.machine(),
            "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": host_fingerprint(),
            "cpus": os.cpu_count(),
            "clock": PERF_CLOCK,
            "tracer": _perf_version(),
            "tracepoints": ",".join(available_events(events)),
            "duration_limit_s": duration,
            "target_events": target_events,
            **facts,
        }
        trace = read_perf_data(perf_data, metadata=meta)
        trace.metadata["source"] = f"perf record ({name})"
        if keep_perf_data is not None:
            with atomic_path(keep_perf_data) as tmp:
                shutil.copyfile(perf_data, tmp)
        if output is not None:
            trace.save(output)
        return trace
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _perf_version() -> str:
    try:
        return subprocess.run([perf_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError, TraceSynthError):
        return "perf"


# -- the shipped dataset ----------------------------------------------------------------------
MANIFEST = "manifest.json"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_entry(path: Path, trace: Trace) -> dict[str, Any]:
    """One dataset file's manifest record (what the dataset test checks)."""
    m = trace.metadata
    return {
        "file": path.name,
        "workload": m.get("workload"),
        "command": m.get("command"),
        "kernel": m.get("kernel"),
        "date": m.get("date"),
        "events": len(trace),
        "duration_s": round(trace.duration_ns / 1e9, 6),
        "event_types": trace.n_event_types,
        "event_counts": [[k, v] for k, v in trace.event_counts().items()],  # most frequent first
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return {"format": 1, "traces": []}
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise TraceSynthError(f"not valid JSON ({exc})", path) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traces"), list):
        raise TraceSynthError("manifest has no 'traces' list", path)
    return doc


def add_to_dataset(directory: str | Path, trace_path: str | Path) -> dict[str, Any]:
    """Record (or replace) one trace file in the directory's manifest, written atomically."""
    directory, trace_path = Path(directory), Path(trace_path)
    trace = Trace.load(trace_path)
    entry = manifest_entry(trace_path, trace)
    doc = read_manifest(directory)
    doc["traces"] = [t for t in doc["traces"] if t.get("file") != entry["file"]] + [entry]
    doc["traces"].sort(key=lambda t: t["file"])
    doc["format"] = 1
    doc["description"] = (
        "Real kernel traces recorded on this project's build machine by `tracesynth collect WORKLOAD "
        "--dataset data/` (perf record on scheduler, syscall, fault, irq and timer tracepoints, limited "
        "to the workload's process tree)."
    )
    with atomic_path(directory / MANIFEST) as tmp:
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return entry
