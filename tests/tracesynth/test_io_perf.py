"""perf readers: `perf script` text, perf.data and perf CTF, on a tiny capture made on this machine.

tests/fixtures/perf/ holds one capture (`sh -c 'echo tracesynth | gzip -c | gzip -dc; ls /nonexistent;
cat /etc/hostname'` under `perf record` on sched, raw_syscalls, irq, timer and syscalls:*openat
tracepoints) in three forms: perf.data, its `perf script -F trace:comm,tid,cpu,time,event,trace --ns`
text, and its `perf data convert --to-ctf ctf --all` directory.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from tracesynth.errors import TraceSynthError
from tracesynth.io import detect_format, read_trace
from tracesynth.io.perf import canonical_event, read_perf_ctf, read_perf_data, read_perf_script
from tracesynth.io.syscalls import ENTRY_POINT_NAMES, lookup_numbers, parse_unistd, syscall_name, syscall_names

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "perf"
SCRIPT = FIX / "perf-script.txt"
CTF = FIX / "ctf"
PERF_DATA = FIX / "perf.data"


def test_syscall_table_uses_kernel_entry_point_names():
    assert syscall_name(0) == "read"
    assert syscall_name(257) == "openat"
    assert syscall_name(4) == "newstat"  # LTTng's syscall_entry_newstat, perf's sys_enter_newstat
    assert syscall_name(40) == "sendfile64"
    assert syscall_name(435) == "clone3" and syscall_name(462) == "mseal"  # 462: probed past the 6.1 header
    assert syscall_name(100000) == "unknown"
    codes, names = lookup_numbers(np.array([0, 1, -1, 99999, 59]))
    assert [names[c] for c in codes] == ["read", "write", "unknown", "unknown", "execve"]
    assert len(syscall_names()) > 330


def test_unistd_parser_applies_entry_point_renames():
    text = "#define __NR_read 0\n#define __NR_stat 4\n#define __NR_umount2 166\n#define __NR_foo_bar 9\n"
    assert parse_unistd(text) == {0: "read", 4: "newstat", 166: "umount", 9: "foo_bar"}


def test_entry_point_names_exist_as_tracepoints():
    events = Path("/sys/kernel/tracing/events/syscalls")
    if not events.is_dir():
        pytest.skip("tracefs syscalls events are not readable here")
    have = {p.name.removeprefix("sys_enter_") for p in events.glob("sys_enter_*")}
    for renamed in ENTRY_POINT_NAMES.values():
        assert renamed in have
    # nearly all table names are tracepoints (the rest are unimplemented slots such as tuxcall)
    names = set(syscall_names().values())
    assert len(names & have) > 0.9 * len(names)


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        ("sched:sched_switch", "sched_switch"),
        ("sched:sched_process_fork", "sched_process_fork"),
        ("irq:softirq_entry", "irq_softirq_entry"),
        ("irq:irq_handler_entry", "irq_handler_entry"),
        ("timer:hrtimer_start", "timer_hrtimer_start"),
        ("exceptions:page_fault_user", "x86_exceptions_page_fault_user"),
        ("syscalls:sys_enter_openat", "syscall_entry_openat"),
        ("syscalls:sys_exit_newstat", "syscall_exit_newstat"),
    ],
)
def test_canonical_event_follows_lttng_names(raw, name):
    assert canonical_event(raw) == name


def test_perf_script_fixture():
    assert detect_format(SCRIPT) == "perf-script"
    t = read_perf_script(SCRIPT)
    assert len(t) == 1241
    counts = t.event_counts()
    # raw_syscalls:sys_enter NR 257 and syscalls:sys_enter_openat both become syscall_entry_openat
    assert counts["syscall_entry_openat"] == counts["syscall_exit_openat"] == 79 * 2
    assert counts["sched_switch"] == 13 and counts["sched_process_exec"] == 5
    assert not any(e.startswith(("raw_syscalls", "sched:")) for e in counts)
    assert set(t.column("comm").to_pylist()) == {"sh", "gzip", "ls", "cat"}
    assert t.table["tid"].null_count == 0 and set(t.column("cpu").to_pylist()) == {0, 1}
    ev = np.array(t.column("event").to_pylist())
    ret_known = ~np.array(t.table["ret"].is_null())
    assert np.all(ret_known == np.char.startswith(ev, "syscall_exit_"))
    ts = t.ts
    assert np.all(np.diff(ts) >= 0) and ts[0] == 1155_314340814
    first = t.table.slice(0, 3).to_pylist()
    assert [r["event"] for r in first] == ["sched_switch", "sched_process_exec", "syscall_exit_execve"]
    assert first[2]["ret"] == 0 and first[2]["comm"] == "sh" and first[2]["tid"] == 14586
    # the restarted wait4 whose number the kernel lost ("NR -1 = 14589") keeps its return value
    unknown = t.table.filter(np.array(ev == "syscall_exit_unknown")).column("ret").to_pylist()
    assert 14589 in unknown


def test_block_boundaries_do_not_change_the_result():
    whole = read_perf_script(SCRIPT)
    assert read_perf_script(SCRIPT, block_bytes=4096) == whole
    assert read_perf_script(SCRIPT, block_bytes=100) == whole


def test_default_perf_layout_with_pid_tid_period_and_microseconds(tmp_path):
    text = (
        "            bash  101/102   [003]   12.000001:      1 raw_syscalls:sys_enter: NR 0 (3, 7ffd, 1)\n"
        "            bash  101/102   [003]   12.000003:      1 raw_syscalls:sys_exit: NR 0 = -11\n"
        " Web Content  7/7 [1] 12.5: syscalls:sys_exit_openat: 0xfffffffffffffffe\n"
        "\tffffffff8100 do_syscall_64 ([kernel.kallsyms])\n"
        "\n"
    )
    p = tmp_path / "x.txt"
    p.write_text(text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = read_perf_script(p)
    assert any("skipped 1 line" in str(w.message) for w in caught)
    rows = t.table.to_pylist()
    assert [r["event"] for r in rows] == ["syscall_entry_read", "syscall_exit_read", "syscall_exit_openat"]
    assert [r["ts"] for r in rows] == [12_000_001_000, 12_000_003_000, 12_500_000_000]
    assert [r["tid"] for r in rows] == [102, 102, 7]
    assert [r["cpu"] for r in rows] == [3, 3, 1]
    assert [r["comm"] for r in rows] == ["bash", "bash", "Web Content"]
    assert [r["ret"] for r in rows] == [None, -11, -2]


def test_unsorted_text_is_sorted(tmp_path):
    lines = SCRIPT.read_text().splitlines(keepends=True)
    p = tmp_path / "shuffled.txt"
    p.write_text("".join(lines[600:] + lines[:600]))
    t = read_perf_script(p)
    assert np.all(np.diff(t.ts) >= 0) and len(t) == len(lines)


@pytest.mark.parametrize("content", [b"hello world\nthis is not perf\n", b"\n\n"])
def test_garbage_is_one_clear_error(tmp_path, content):
    p = tmp_path / "bad.txt"
    p.write_bytes(content)
    with pytest.raises(TraceSynthError, match="no perf script events") as err:
        read_perf_script(p)
    assert str(p) in str(err.value)


def test_perf_ctf_equals_perf_script():
    if shutil.which("babeltrace2") is None:
        pytest.skip("babeltrace2 is not installed")
    assert detect_format(CTF) == "perf-ctf"
    ctf = read_trace(CTF)
    assert ctf.metadata["source_format"] == "perf-ctf"
    assert ctf == read_perf_script(SCRIPT)


def test_perf_ctf_without_sideband_warns(tmp_path):
    if shutil.which("babeltrace2") is None:
        pytest.skip("babeltrace2 is not installed")
    if shutil.which("perf") is None:
        pytest.skip("perf is not installed")
    import subprocess

    out = tmp_path / "ctf"
    subprocess.run(
        ["perf", "data", "convert", "--to-ctf", str(out), "-i", str(PERF_DATA)], check=True, capture_output=True
    )
    with pytest.warns(UserWarning, match="no perf_comm"):
        t = read_perf_ctf(out)
    assert t.table["comm"].null_count == len(t)
    ref = read_perf_script(SCRIPT)
    assert t.column("event").equals(ref.column("event")) and t.column("ret").equals(ref.column("ret"))


def test_perf_data_equals_perf_script():
    if shutil.which("perf") is None:
        pytest.skip("perf is not installed")
    assert detect_format(PERF_DATA) == "perf-data"
    t = read_perf_data(PERF_DATA)
    assert t.metadata["source_format"] == "perf-data"
    assert t == read_perf_script(SCRIPT)


def test_perf_data_that_is_not_perf_data(tmp_path):
    if shutil.which("perf") is None:
        pytest.skip("perf is not installed")
    p = tmp_path / "perf.data"
    p.write_bytes(b"PERFILE2" + b"\0" * 100)
    with pytest.raises(TraceSynthError) as err:
        read_perf_data(p)
    assert str(p) in str(err.value)
