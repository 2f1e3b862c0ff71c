"""The collector (perf record on a workload's process tree), the catalogue and the dataset manifest."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from typer.testing import CliRunner

from tracesynth import collect as collect_mod
from tracesynth.cli import app
from tracesynth.collect import TRACEFS, add_to_dataset, collect, read_manifest
from tracesynth.errors import TraceSynthError
from tracesynth.stats import summarize
from tracesynth.trace import Trace
from tracesynth.workloads import CATALOGUE, get_workload


def _why_not_trace() -> str | None:
    """Why perf cannot record tracepoints here (None when it can)."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian linux-perf)"
    if not any((t / "events").is_dir() for t in TRACEFS):
        return "tracefs is not mounted or not readable (as root: mount -t tracefs nodev /sys/kernel/tracing)"
    if os.geteuid() == 0:
        return None
    try:
        if int(open("/proc/sys/kernel/perf_event_paranoid").read()) <= -1:
            return None
    except OSError:
        pass
    return "perf tracepoint access needs root or kernel.perf_event_paranoid=-1"


_WHY = _why_not_trace()
needs_perf = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def test_catalogue_covers_the_paper_workload_kinds():
    assert len(CATALOGUE) >= 6
    kinds = {w.kind for w in CATALOGUE.values()}
    assert {"compute", "memory", "io", "video", "compression", "database"} <= kinds
    for w in CATALOGUE.values():
        assert w.package.split(":")[0] in ("debian", "pypi")
        assert "{" not in w.shell_command()  # placeholders filled in
    assert "run_benchmark.py" in get_workload("scimark2").shell_command()
    with pytest.raises(TraceSynthError, match="unknown workload 'nope'.*scimark2"):
        get_workload("nope")


def test_missing_program_names_the_package(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda exe: None)
    with pytest.raises(TraceSynthError, match="apt-get install fio"):
        get_workload("fio").check()
    with pytest.raises(TraceSynthError, match="apt-get install linux-perf"):
        collect(command="true")


def test_unreadable_tracefs_names_the_sysctl(monkeypatch, tmp_path):
    if shutil.which("perf") is None:
        pytest.skip("perf is not installed")
    monkeypatch.setattr(collect_mod, "TRACEFS", (tmp_path / "nothing",))
    with pytest.raises(TraceSynthError, match="kernel.perf_event_paranoid"):
        collect(command="true")


@needs_perf
def test_collect_a_command(tmp_path):
    out = tmp_path / "t.parquet"
    trace = collect(command="cat /etc/hostname > /dev/null; ls / > /dev/null", output=out)
    assert out.is_file() and Trace.load(out) == trace
    counts = trace.event_counts()
    assert counts["sched_process_exec"] >= 2 and counts["syscall_entry_execve"] >= 2
    assert {"cat", "ls"} <= set(trace.column("comm").to_pylist())
    m = trace.metadata
    for key in ("workload", "command", "kernel", "date", "host", "clock", "tracepoints"):
        assert m[key]
    assert m["workload"] == "command" and m["stopped_after_s"] is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    s = summarize(trace)
    assert s.events == len(trace) and s.syscall_latency is not None and s.syscall_latency.count > 10


@needs_perf
def test_duration_stops_the_process_tree(tmp_path):
    t0 = time.monotonic()
    trace = collect(command="sh -c 'sleep 60' & sleep 60; wait", duration=1.0)
    assert time.monotonic() - t0 < 30
    assert trace.metadata["stopped_after_s"] is not None
    assert "sched_process_exit" in trace.event_counts()


@needs_perf
def test_failing_workload_is_one_clear_error(tmp_path):
    out = tmp_path / "t.parquet"
    with pytest.raises(TraceSynthError, match="workload exited with status 3"):
        collect(command="echo boom >&2; exit 3", output=out)
    assert not out.exists()


@needs_perf
def test_cli_collect_into_a_dataset(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["collect", "--command", "ls /", "-o", str(tmp_path / "x.parquet")])
    assert r.exit_code == 0, r.output
    assert Trace.load(tmp_path / "x.parquet").metadata["command"] == "ls /"
    # a dataset directory: manifest entries are written by the tool and listed by `datasets`
    entry = add_to_dataset(tmp_path, tmp_path / "x.parquet")
    doc = read_manifest(tmp_path)
    assert doc["traces"] == [entry] and entry["events"] == len(Trace.load(tmp_path / "x.parquet"))
    json.loads((tmp_path / "manifest.json").read_text())
    r = runner.invoke(app, ["datasets", "--dir", str(tmp_path)])
    assert r.exit_code == 0 and "x.parquet" in r.output


def test_cli_datasets_lists_the_shipped_dataset_and_catalogue():
    runner = CliRunner()
    r = runner.invoke(app, ["datasets"])
    assert r.exit_code == 0, r.output
    for name in CATALOGUE:
        assert f"{name}.parquet" in r.output
    r = runner.invoke(app, ["datasets", "--catalogue"])
    assert r.exit_code == 0 and "pyperformance" in r.output and "stress-ng" in r.output


def test_cli_errors(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["collect"])
    assert r.exit_code != 0
    r = runner.invoke(app, ["datasets", "--dir", str(tmp_path)])
    assert r.exit_code != 0 and isinstance(r.exception, TraceSynthError)


def test_summary_pairs_syscalls_per_thread_and_counts_switches():
    # thread 1: read 0->100 ns, thread 2 interleaved: write 50->250; a dangling exit and a switch
    trace = Trace.from_columns(
        ts=[0, 50, 100, 250, 300, 1_000_000_000],
        event=[
            "syscall_entry_read",
            "syscall_entry_write",
            "syscall_exit_read",
            "syscall_exit_write",
            "syscall_exit_close",
            "sched_switch",
        ],
        tid=[1, 2, 1, 2, 1, 1],
        ret=[None, None, 5, 3, 0, None],
        metadata={"workload": "toy"},
    )
    s = summarize(trace)
    assert s.workload == "toy" and s.events == 6 and s.event_types == 6
    assert s.syscall_latency.count == 2
    assert {q.name: q.p50_ns for q in s.top_syscall_latency} == {"read": 100.0, "write": 200.0}
    assert s.context_switches_per_s == pytest.approx(1.0)
    assert s.families["syscall"] == pytest.approx(5 / 6) and s.families["sched"] == pytest.approx(1 / 6)


def test_info_prints_profiles_and_a_comparison(tmp_path):
    runner = CliRunner()
    data = [p for p in sorted((collect_mod.Path(__file__).resolve().parents[2] / "data").glob("*.parquet"))][:2]
    r = runner.invoke(app, ["info", *map(str, data), "--top", "3"])
    assert r.exit_code == 0, r.output
    assert "profile: syscall" in r.output and "context switches/s" in r.output
    assert "workload comparison" in r.output and "p99" in r.output


@pytest.mark.parametrize(
    ("perf_log", "expected"),
    [
        ("Error:\nNo permission to enable sched:sched_switch event.\nkernel.perf_event_paranoid=2", "paranoid"),
        ("Error:\nAccess to performance monitoring and observability operations is limited.", "paranoid"),
        ("can't access trace events", "tracefs"),
        ("Error:\nsomething else went wrong", "something else went wrong"),
    ],
)
def test_perf_record_failures_say_what_to_change(perf_log, expected):
    with pytest.raises(TraceSynthError, match=expected):
        collect_mod._raise_perf_failure(perf_log, 255)
