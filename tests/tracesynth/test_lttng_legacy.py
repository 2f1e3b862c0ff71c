"""Old LTTng (2.5 and older) syscall naming is mapped onto the current names at ingest."""

from __future__ import annotations

import shutil

import pytest

from tracesynth.io.ctf_writer import write_ctf
from tracesynth.io.lttng_legacy import normalise_legacy_syscalls
from tracesynth.trace import Trace


def legacy_trace() -> Trace:
    """Two threads on two CPUs, named as LTTng 2.5 did: sys_NAME entries, one exit_syscall for all."""
    rows = [
        (1000, "sys_openat", 0, 10, "cat", None),
        (1100, "sys_read", 1, 20, "sh", None),
        (1200, "exit_syscall", 0, 10, "cat", 3),
        (1300, "sched_switch", 0, 10, "cat", None),
        (1400, "exit_syscall", 1, 20, "sh", -11),
        (1500, "sys_read", 0, 10, "cat", None),
        (1600, "exit_syscall", 0, 10, "cat", 4096),
        (1700, "exit_syscall", 1, 20, "sh", 0),  # no call open on thread 20: keeps its name
    ]
    ts, ev, cpu, tid, comm, ret = zip(*rows, strict=True)
    return Trace.from_columns(list(ts), list(ev), list(cpu), list(tid), list(comm), list(ret))


EXPECTED = [
    "syscall_entry_openat",
    "syscall_entry_read",
    "syscall_exit_openat",
    "sched_switch",
    "syscall_exit_read",
    "syscall_entry_read",
    "syscall_exit_read",
    "exit_syscall",
]


def test_names_map_to_the_open_call_of_each_thread() -> None:
    out = normalise_legacy_syscalls(legacy_trace())
    assert out.column("event").to_pylist() == EXPECTED
    assert out.column("ret").to_pylist() == [None, None, 3, None, -11, None, 4096, 0]
    t = legacy_trace()
    current = Trace.from_columns(t.ts[:7], EXPECTED[:7], [0] * 7, [10] * 7, ["cat"] * 7, [None] * 7)
    assert normalise_legacy_syscalls(current) is current  # nothing old: left as it is


@pytest.mark.skipif(shutil.which("babeltrace2") is None, reason="babeltrace2 is not installed")
def test_reader_maps_an_old_lttng_trace_and_keeps_ret(tmp_path) -> None:
    from tracesynth.io.lttng import read_lttng

    d = write_ctf(legacy_trace(), tmp_path / "old")
    # read it as a foreign LTTng trace, not as one tracesynth wrote (which reads `ret` everywhere)
    meta = d / "metadata"
    meta.write_text("".join(line for line in meta.read_text().splitlines(True) if "tracesynth" not in line))
    back = read_lttng(d)
    assert back.column("event").to_pylist() == EXPECTED
    assert back.column("ret").to_pylist() == [None, None, 3, None, -11, None, 4096, 0]
