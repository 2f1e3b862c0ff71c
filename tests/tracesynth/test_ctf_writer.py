"""CTF writer: babeltrace2 reads what we write, and Trace -> CTF -> Trace gives the same table."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tracesynth.errors import TraceSynthError
from tracesynth.io.ctf_writer import write_ctf
from tracesynth.io.lttng import read_lttng
from tracesynth.trace import Trace

pytestmark = pytest.mark.skipif(shutil.which("babeltrace2") is None, reason="babeltrace2 is not installed")

NAMES = ["sched_switch", "syscall_entry_read", "syscall_exit_read", "irq_handler_entry", "sched:sched_wakeup"]
COMMS = ["wget", "swapper/0", "kworker/u8:2-events_unbound_long", "ünïcødé", 'q"uote\\back', "tab\tnl\n"]


def random_trace(n: int, seed: int = 0, cpus: int = 3) -> Trace:
    """Nulls everywhere they are allowed, ties within a CPU, no ties across CPUs."""
    rng = np.random.default_rng(seed)
    cpu = rng.integers(0, cpus, n).astype(object)
    cpu[rng.random(n) < 0.1] = None
    gaps = rng.integers(0, 4, n) * cpus  # equal stamps only ever on one CPU: add a per-CPU residue
    ts = 1_700_000_000_000_000_000 + np.cumsum(gaps) * 10
    ts = ts + np.array([c if c is not None else cpus for c in cpu])
    order = np.argsort(ts, kind="stable")
    ts, cpu = ts[order], cpu[order]
    event = rng.choice(NAMES, n)
    tid = rng.integers(0, 5000, n).astype(object)
    tid[rng.random(n) < 0.1] = None
    comm = rng.choice(np.array(COMMS, dtype=object), n)
    comm[rng.random(n) < 0.1] = None
    ret = rng.integers(-4096, 1 << 40, n).astype(object)
    ret[(event != "syscall_exit_read") & (rng.random(n) < 0.9)] = None  # mostly on exits, a few elsewhere
    ret[(event == "syscall_exit_read") & (rng.random(n) < 0.1)] = None
    return Trace.from_columns(ts, event, cpu, tid, comm, ret, metadata={"source_format": "synthetic", "seed": seed})


def test_roundtrip_random_with_nulls(tmp_path: Path) -> None:
    trace = random_trace(2000)
    write_ctf(trace, tmp_path / "t")
    back = read_lttng(tmp_path / "t")
    for col in ("ts", "event", "cpu", "tid", "comm", "ret"):
        assert back.column(col).equals(trace.column(col)), col
    assert back == trace
    assert back.metadata == trace.metadata


def test_roundtrip_across_packets_and_chunks(tmp_path: Path) -> None:
    trace = random_trace(3000, seed=1)
    write_ctf(trace, tmp_path / "t", packet_bytes=700, chunk_rows=257)
    files = sorted(p.name for p in (tmp_path / "t").iterdir())
    assert files == ["channel0_0", "channel0_1", "channel0_2", "channel0_nocpu", "metadata"]
    assert read_lttng(tmp_path / "t") == trace


def test_babeltrace2_counts_and_lttng_fields(tmp_path: Path) -> None:
    trace = random_trace(500, seed=2)
    write_ctf(trace, tmp_path / "t")
    out = subprocess.run(["babeltrace2", str(tmp_path / "t")], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == len(trace)
    names = Counter(line.split(") ", 1)[1].split(" ", 1)[1].split(": ", 1)[0] for line in lines)
    assert names == Counter(trace.column("event").to_pylist())
    switch = next(line for line in lines if " sched_switch: " in line)
    for field in ("prev_comm", "prev_tid", "prev_prio", "prev_state", "next_comm", "next_tid", "next_prio"):
        assert f"{field} = " in switch
    exits = [line for line in lines if " syscall_exit_read: " in line]
    assert (
        sum("ret = " in line for line in exits)
        == trace.table.filter(
            trace.table["event"].cast("string").to_numpy(zero_copy_only=False) == "syscall_exit_read"
        )["ret"]
        .drop_null()
        .__len__()
    )
    meta = (tmp_path / "t" / "metadata").read_text()
    assert meta.startswith("/* CTF 1.8 */") and 'domain = "kernel";' in meta and "_procname;" in meta


def test_cpu_less_trace_goes_to_one_stream(tmp_path: Path) -> None:
    trace = Trace.from_columns([1, 2, 3], ["a", "b", "c"], tid=[1, None, 3], comm=["x", "y", None], ret=[None, 0, 1])
    write_ctf(trace, tmp_path / "t")
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["channel0_nocpu", "metadata"]
    assert read_lttng(tmp_path / "t") == trace


def test_cross_cpu_ties_come_back_as_a_permutation(tmp_path: Path) -> None:
    trace = Trace.from_columns([5, 5, 5, 9], ["a", "b", "c", "d"], cpu=[2, 0, 1, 0], tid=[1, 2, 3, 4])
    write_ctf(trace, tmp_path / "t")
    back = read_lttng(tmp_path / "t")
    assert back.ts.tolist() == trace.ts.tolist()
    assert sorted(back.column("event").to_pylist()[:3]) == ["a", "b", "c"]
    assert back.column("event").to_pylist()[3] == "d"


def test_writes_are_atomic_and_replace(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    write_ctf(random_trace(50), dest)
    first = (dest / "metadata").read_text()
    bad = Trace.from_columns([1, 2], ["ok", "bad name"], cpu=[0, 0])
    with pytest.raises(TraceSynthError, match="bad name"):
        write_ctf(bad, dest)
    assert (dest / "metadata").read_text() == first  # the old trace is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left behind
    write_ctf(random_trace(60, seed=3), dest)
    assert len(read_lttng(dest)) == 60


@pytest.mark.parametrize(
    ("trace", "message"),
    [
        (Trace.from_columns([], []), "no events"),
        (Trace.from_columns([1], ["has,comma"]), "cannot be written"),
        (Trace.from_columns([1], ['qu"ote']), "cannot be written"),
        (Trace.from_columns([1], ["ok"], tid=[1 << 40]), "int32"),
        (Trace.from_columns([1], ["ok"], cpu=[-1]), "negative cpu"),
    ],
)
def test_unwritable_traces_raise(tmp_path: Path, trace: Trace, message: str) -> None:
    with pytest.raises(TraceSynthError, match=message):
        write_ctf(trace, tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_negative_and_widening_timestamps_roundtrip(tmp_path: Path) -> None:
    """Seconds that change width within a block, and times before the clock origin."""
    ts = [-1_500_000_000, -5, 0, 9_999_999_999, 10_000_000_000, 123_456_789_012]
    trace = Trace.from_columns(
        ts, ["a", "b", "c", "d", "e", "f"], cpu=[0, 0, 1, 0, 1, 0], ret=[None, -1, 2, 3, None, 4]
    )
    write_ctf(trace, tmp_path / "t")
    assert read_lttng(tmp_path / "t") == trace
