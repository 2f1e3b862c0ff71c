"""strace reader on a capture made here and on hand-written edge cases.

tests/fixtures/strace/strace-f-ttt-T.txt is `strace -f -ttt -T -o FILE sh -c 'echo tracesynth | gzip -c |
gzip -dc > /dev/null; ls /nonexistent 2>/dev/null; sleep 5 & kill -TERM $!; wait; cat /etc/hostname > /dev/null'`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tracesynth.errors import TraceSynthError
from tracesynth.io import detect_format, read_trace
from tracesynth.io.strace import read_strace

STRACE = Path(__file__).resolve().parents[1] / "fixtures" / "strace" / "strace-f-ttt-T.txt"


def _rows(t):
    return t.table.to_pylist()


def test_strace_fixture():
    assert detect_format(STRACE) == "strace"
    t = read_trace(STRACE)
    assert t.metadata["source_format"] == "strace"
    assert t.table["cpu"].null_count == len(t)
    assert np.all(np.diff(t.ts) >= 0)
    counts = t.event_counts()
    assert counts["syscall_entry_openat"] == counts["syscall_exit_openat"] == 79
    assert counts["sched_process_exit"] == 7  # sh, its subshell, 2 gzip, ls, the killed sleep, cat
    assert counts["signal_deliver"] >= 6  # SIGCHLDs and the SIGTERM to `sleep`
    assert "syscall_exit_exit_group" not in counts and counts["syscall_entry_exit_group"] >= 4
    rows = _rows(t)
    assert rows[0]["event"] == "syscall_entry_execve" and rows[0]["comm"] is None  # before the exec
    assert rows[1] == {
        "ts": 1796223840883037000,  # 1796223840.882763 + <0.000274>
        "event": "syscall_exit_execve",
        "cpu": None,
        "tid": 18203,
        "comm": "sh",
        "ret": 0,
    }
    by_tid = {}
    for r in rows:
        by_tid.setdefault(r["tid"], set()).add(r["comm"])
    # gzip children start as forks of sh, then exec gzip
    assert by_tid[18205] == {"sh", "gzip"} and by_tid[18207] == {"sh", "ls"}
    # "-1 ENOENT" becomes the kernel's -2; ERESTARTNOHAND its internal -514
    newstat = [r["ret"] for r in rows if r["event"] == "syscall_exit_newfstatat"]
    assert -2 in newstat
    assert any(r["ret"] == -514 for r in rows if r["event"] == "syscall_exit_rt_sigsuspend")
    # exits carry ret, nothing else does
    for r in rows:
        assert (r["ret"] is not None) == r["event"].startswith("syscall_exit_")


def test_unfinished_resumed_pairs_and_pid_prefixes(tmp_path):
    text = (
        '1700000000.000100 execve("/usr/bin/prog-with-a-long-name", ["x"], 0x0 /* 1 var */) = 0 <0.000050>\n'
        "1700000000.000200 clone(child_stack=NULL, flags=SIGCHLD) = 42 <0.000010>\n"
        "[pid    42] 1700000000.000300 read(0,  <unfinished ...>\n"
        "[pid    41] 1700000000.000400 fstat(1, {st_mode=S_IFCHR|0620, ...}) = 0 <0.000001>\n"
        '[pid    42] 1700000000.000900 <... read resumed>"ab", 4096) = 2 <0.000550>\n'
        "[pid    42] 1700000000.001000 mmap(NULL, 8192, PROT_READ, MAP_PRIVATE, -1, 0) = 0x7f0000000000 <0.000005>\n"
        "[pid    42] 1700000000.001100 --- SIGTERM {si_signo=SIGTERM, si_code=SI_USER} ---\n"
        "[pid    42] 1700000000.001200 +++ killed by SIGTERM +++\n"
        "1700000000.001300 syscall_0x1c3(0x1, 0x2) = -1 ENOSYS (Function not implemented) <0.000002>\n"
        "1700000000.001400 exit_group(0)           = ?\n"
        "1700000000.001500 +++ exited with 0 +++\n"
        "strace: Process 41 detached\n"
    )
    p = tmp_path / "s.txt"
    p.write_text(text)
    with pytest.warns(UserWarning, match="skipped 1 line"):
        t = read_strace(p)
    rows = _rows(t)
    got = [(r["ts"] - 1700000000_000000000, r["event"], r["tid"], r["comm"], r["ret"]) for r in rows]
    assert got == [
        (100_000, "syscall_entry_execve", 41, None, None),
        (150_000, "syscall_exit_execve", 41, "prog-with-a-lon", 0),  # the kernel keeps 15 chars
        (200_000, "syscall_entry_clone", 41, "prog-with-a-lon", None),
        (210_000, "syscall_exit_clone", 41, "prog-with-a-lon", 42),
        (300_000, "syscall_entry_read", 42, "prog-with-a-lon", None),
        (400_000, "syscall_entry_newfstat", 41, "prog-with-a-lon", None),
        (401_000, "syscall_exit_newfstat", 41, "prog-with-a-lon", 0),
        (850_000, "syscall_exit_read", 42, "prog-with-a-lon", 2),  # entry time + <0.000550>
        (1_000_000, "syscall_entry_mmap", 42, "prog-with-a-lon", None),
        (1_005_000, "syscall_exit_mmap", 42, "prog-with-a-lon", 0x7F0000000000),
        (1_100_000, "signal_deliver", 42, "prog-with-a-lon", None),
        (1_200_000, "sched_process_exit", 42, "prog-with-a-lon", None),
        (1_300_000, "syscall_entry_" + _name(0x1C3), 41, "prog-with-a-lon", None),
        (1_302_000, "syscall_exit_" + _name(0x1C3), 41, "prog-with-a-lon", -38),
        (1_400_000, "syscall_entry_exit_group", 41, "prog-with-a-lon", None),
        (1_500_000, "sched_process_exit", 41, "prog-with-a-lon", None),
    ]


def _name(nr: int) -> str:
    from tracesynth.io.syscalls import syscall_name

    return syscall_name(nr)


@pytest.mark.parametrize("content", ["not strace at all\n", "   \n\n"])
def test_garbage_is_one_clear_error(tmp_path, content):
    p = tmp_path / "bad.txt"
    p.write_text(content)
    with pytest.raises(TraceSynthError, match="no strace events") as err:
        read_strace(p)
    assert str(p) in str(err.value)
