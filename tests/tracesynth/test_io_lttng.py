"""LTTng kernel CTF reading and the generic babeltrace2 event stream.

Small traces are written at test time by the project's CTF writer (and re-written by babeltrace2's
own CTF sink, so the reader also sees a CTF layout we did not produce); the real wget trace in
../shared is checked against the babeltrace2 CLI's own text output and skipped when absent.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tracesynth.errors import TraceSynthError
from tracesynth.io import detect_format, read_trace
from tracesynth.io.babeltrace import (
    _PRETTY_PARAMS,
    Field,
    _lines_from_block,
    _take_lines,
    _unescape,
    ctf_metadata,
    import_bt2,
    iter_ctf_batches,
    parse_pretty_block,
    parse_pretty_lines_regex,
)
from tracesynth.io.ctf_writer import write_ctf
from tracesynth.io.lttng import read_lttng
from tracesynth.trace import Trace

pytestmark = pytest.mark.skipif(shutil.which("babeltrace2") is None, reason="babeltrace2 is not installed")


def _bt2_lines(path: Path) -> list[str]:
    """babeltrace2's default text output, one line per event (the reference we compare with)."""
    out = subprocess.run(["babeltrace2", str(path)], capture_output=True, text=True, check=True).stdout
    return out.splitlines()


_LINE = re.compile(r"^\[[^\]]+\] \([^)]+\) \S+ (\S+): (?:\{ cpu_id = (\d+) \})?")


def small_trace() -> Trace:
    """Two CPUs, sched_switch hand-offs, syscall pairs, an IRQ, names needing escapes."""
    rows = [
        # ts, event, cpu, tid, comm, ret
        (1_000, "syscall_entry_read", 0, None, None, None),  # before cpu 0's first switch
        (1_100, "sched_switch", 0, 0, "swapper/0", None),
        (1_200, "syscall_entry_openat", 0, 42, "wget", None),
        (1_300, "syscall_exit_openat", 0, 42, "wget", 3),
        (1_350, "sched_switch", 1, 0, "swapper/1", None),
        (1_400, "irq_handler_entry", 1, 7, 'we"ird\\name', None),
        (1_450, "syscall_exit_read", 1, 7, 'we"ird\\name', -11),
        (1_500, "sched_switch", 0, 42, "wget", None),
        (1_500, "syscall_entry_close", 0, 0, "swapper/0", None),  # tie on the same CPU
        (1_600, "timer_hrtimer_start", 0, 0, "swapper/0", None),
    ]
    cols = list(zip(*rows, strict=True))
    return Trace.from_columns(*cols, metadata={"source_format": "test", "workload": "unit"})


# -- generic event stream -----------------------------------------------------------------------
def test_stream_yields_requested_fields(tmp_path: Path) -> None:
    trace = small_trace()
    write_ctf(trace, tmp_path / "t")
    fields = [
        Field("ret", events=("syscall_exit_*",)),
        Field("next_tid", events=("sched_switch",)),
        Field("next_comm", kind="str", events=("sched_switch",)),
        Field("procname", kind="str", scope="context"),
        Field("tid", scope="context", column="ctx_tid"),
        Field("absent_field"),
    ]
    table = pa.Table.from_batches(list(iter_ctf_batches(tmp_path / "t", fields, batch_bytes=256)))
    assert table.num_rows == len(trace)
    assert table["ts"].to_pylist() == trace.ts.tolist()
    assert table["event"].to_pylist() == trace.column("event").to_pylist()
    assert table["cpu"].to_pylist() == trace.column("cpu").to_pylist()
    assert table["ret"].to_pylist() == [None, None, None, 3, None, None, -11, None, None, None]
    # next_* of a switch is the thread of the next event on that CPU
    assert table["next_tid"].to_pylist()[1] == 42 and table["next_comm"].to_pylist()[4] == 'we"ird\\name'
    assert table["procname"].to_pylist()[5] == 'we"ird\\name'
    assert table["ctx_tid"].to_pylist()[0] == -1
    assert table["absent_field"].null_count == len(trace)


ALL_KINDS = [
    Field("ret", scope="payload"),
    Field("prev_tid", scope="payload", events=("sched_switch",)),
    Field("next_comm", kind="str", scope="payload", events=("sched_switch",)),
    Field("prev_comm", kind="str", scope="payload", events=("sched_switch",)),
    Field("tid", scope="context", column="ctx_tid"),
    Field("procname", kind="str", scope="context"),
    Field("tid", column="any_tid"),
    Field("tid", scope="payload", column="payload_tid"),
    Field("hrtimer"),
    Field("name", kind="str"),
    Field("comm", kind="str"),
    Field("fd"),
    Field("filename", kind="str", scope="payload"),
]


def _pretty_text(path: Path) -> bytes:
    cmd = ["babeltrace2", str(path), "-c", "sink.text.pretty", "-p", _PRETTY_PARAMS]
    return subprocess.run(cmd, capture_output=True, check=True).stdout


def _assert_parsers_agree(text: bytes) -> None:
    fast = parse_pretty_block(text, ALL_KINDS)
    ref = parse_pretty_lines_regex(_lines_from_block(text), ALL_KINDS)
    assert fast.schema.names == ref.schema.names
    for name in fast.schema.names:
        a, b = fast[name], ref[name]
        if pa.types.is_dictionary(a.type):
            a, b = a.cast(pa.string()), b.cast(pa.string())
        assert a.equals(b), name


def test_fast_parser_matches_regex_reference(tmp_path: Path) -> None:
    trace = small_trace()
    write_ctf(trace, tmp_path / "ctx")
    write_ctf(trace, tmp_path / "plain", context=False)
    for d in ("ctx", "plain"):
        _assert_parsers_agree(_pretty_text(tmp_path / d))


def test_fast_parser_matches_regex_reference_on_wget(lttng_wget: Path) -> None:
    _assert_parsers_agree(_pretty_text(lttng_wget))  # hex ints, enums, nested payloads, long strings


def test_take_lines_cuts_at_the_last_newline() -> None:
    buf, nbytes, rest = _take_lines([b"ab\ncd", b"ef\ngh"], 10, done=False)
    assert bytes(buf[:nbytes]) == b"ab\ncdef\n" and rest == [b"gh"] and not buf[nbytes:].any()
    buf, nbytes, rest = _take_lines(rest, 2, done=True)  # the stream's last line lacks its newline
    assert bytes(buf[:nbytes]) == b"gh\n" and rest == []
    buf, nbytes, rest = _take_lines([b"abc"], 3, done=False)  # no whole line yet
    assert nbytes == 0 and rest == [b"abc"]


def test_unescape_matches_babeltrace2_escapes() -> None:
    assert _unescape(r"a\"b\\c\nd\x01\?") == 'a"b\\c\nd\x01?'
    assert _unescape("plain") == "plain"


def test_metadata_reports_env_clock_and_context(tmp_path: Path) -> None:
    write_ctf(small_trace(), tmp_path / "t")
    meta = ctf_metadata(tmp_path / "t")
    assert meta["env"]["domain"] == "kernel" and meta["env"]["tracer_name"] == "lttng-modules"
    assert meta["clocks"][0]["freq"] == 1_000_000_000
    assert set(meta["context_fields"]) == {"tid", "procname"}


def test_bt2_bindings_importable_or_clear_error() -> None:
    try:
        bt2 = import_bt2()
    except TraceSynthError as exc:
        assert "apt-get install python3-bt2" in str(exc)
    else:
        assert hasattr(bt2, "TraceCollectionMessageIterator")


# -- read_lttng ---------------------------------------------------------------------------------
def test_roundtrip_with_context_is_exact(tmp_path: Path) -> None:
    trace = small_trace()
    write_ctf(trace, tmp_path / "t")
    assert detect_format(tmp_path / "t") == "lttng"
    back = read_trace(tmp_path / "t")
    assert back == trace
    assert back.metadata == trace.metadata


def test_threads_derived_from_sched_switch_without_context(tmp_path: Path) -> None:
    trace = small_trace()
    write_ctf(trace, tmp_path / "t", context=False)
    assert ctf_metadata(tmp_path / "t")["context_fields"] == []
    back = read_lttng(tmp_path / "t")
    # the first row precedes cpu 0's first switch: unknown; every other row matches the table
    assert back.column("tid").to_pylist() == [None] + trace.column("tid").to_pylist()[1:]
    assert back.column("comm").to_pylist() == [None] + trace.column("comm").to_pylist()[1:]
    assert back.column("ret").equals(trace.column("ret"))


def test_columns_outgrowing_their_first_size_read_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace with more events than its bytes suggest: the column buffers grow, nothing is lost."""
    from tracesynth.io import lttng as mod
    from tracesynth.io.ctf import stream

    trace = small_trace()
    write_ctf(trace, tmp_path / "t", context=False)
    ref = read_lttng(tmp_path / "t")
    monkeypatch.setattr(stream, "CHUNK", 7)  # blocks of a few rows: the buffers grow again and again
    monkeypatch.setattr(mod, "_event_bound", lambda dirs: 1)
    assert read_lttng(tmp_path / "t").table.equals(ref.table)


def test_reader_handles_babeltrace2_written_ctf(tmp_path: Path) -> None:
    """babeltrace2's own CTF sink writes a different layout (headers, packets): same table."""
    trace = small_trace()
    write_ctf(trace, tmp_path / "ours", context=False)
    out = tmp_path / "bt2"
    subprocess.run(
        ["babeltrace2", str(tmp_path / "ours"), "-o", "ctf", "-w", str(out)], check=True, capture_output=True
    )
    back = read_trace(out)  # a session-like directory: the trace sits one level down
    assert back.column("event").equals(trace.column("event"))
    assert back.column("tid").to_pylist()[1:] == trace.column("tid").to_pylist()[1:]


def test_blocks_carry_cpu_state(tmp_path: Path) -> None:
    """Tiny parse blocks split the trace mid-way: per-CPU state must cross block borders."""
    rng = np.random.default_rng(0)
    n = 3000
    cpu = rng.integers(0, 3, n)
    event = np.where(rng.random(n) < 0.1, "sched_switch", "syscall_entry_read")
    event[:3] = "sched_switch"
    cpu[:3] = [0, 1, 2]
    tid = np.zeros(n, dtype=np.int64)
    for c in range(3):  # the thread on each CPU changes at each of its switches
        rows = np.flatnonzero(cpu == c)
        sw = np.cumsum(event[rows] == "sched_switch")
        tid[rows] = 100 * c + np.r_[0, sw[:-1]]  # a switch row belongs to the outgoing thread
    trace = Trace.from_columns(np.arange(n) * 10, event, cpu, tid, [f"t{t}" for t in tid])
    write_ctf(trace, tmp_path / "t", context=False, packet_bytes=512)
    from tracesynth.io import lttng as mod

    orig = mod.iter_ctf_batches
    mod.iter_ctf_batches = lambda p, f: orig(p, f, batch_bytes=4096)
    try:
        back = read_lttng(tmp_path / "t")
    finally:
        mod.iter_ctf_batches = orig
    assert back.column("tid").to_pylist()[3:] == trace.column("tid").to_pylist()[3:]
    assert back.column("comm").to_pylist()[3:] == trace.column("comm").to_pylist()[3:]


def test_no_events_is_an_error(tmp_path: Path) -> None:
    write_ctf(small_trace(), tmp_path / "t")
    for f in (tmp_path / "t").iterdir():
        if f.name != "metadata":
            f.unlink()
    with pytest.raises(TraceSynthError, match="no events"):
        read_lttng(tmp_path / "t")


def test_truncated_stream_names_the_trace(tmp_path: Path) -> None:
    write_ctf(small_trace(), tmp_path / "t")
    stream = tmp_path / "t" / "channel0_0"
    stream.write_bytes(stream.read_bytes()[:60])
    with pytest.raises(TraceSynthError, match="cannot read this trace") as exc:
        read_lttng(tmp_path / "t")
    assert str(tmp_path / "t") in str(exc.value)


# -- the real trace -----------------------------------------------------------------------------
def test_wget_counts_match_babeltrace2(lttng_wget: Path) -> None:
    lines = _bt2_lines(lttng_wget)
    ref = [_LINE.match(line) for line in lines]
    assert all(ref)
    trace = read_lttng(lttng_wget)
    assert len(trace) == len(lines) == 17_702
    assert trace.event_counts() == dict(Counter(m.group(1) for m in ref))
    assert trace.column("event").to_pylist() == [m.group(1) for m in ref]
    assert trace.column("cpu").to_pylist() == [int(m.group(2)) for m in ref]
    assert trace.metadata["source_format"] == "lttng" and trace.metadata["hostname"] == "arnaud-desktop"


def test_wget_threads_and_ret(lttng_wget: Path) -> None:
    lines = _bt2_lines(lttng_wget)
    trace = read_lttng(lttng_wget)
    events = trace.column("event").to_pylist()
    cpu = trace.column("cpu").to_numpy()
    tid = trace.column("tid")
    comm = trace.column("comm")
    is_switch = np.array([e == "sched_switch" for e in events])
    for c in np.unique(cpu):  # tid/comm known exactly from each CPU's first sched_switch on
        rows = np.flatnonzero(cpu == c)
        first = rows[is_switch[rows]][0]
        assert tid.filter(pa.array(np.isin(np.arange(len(trace)), rows[rows >= first]))).null_count == 0
        assert comm.filter(pa.array(np.isin(np.arange(len(trace)), rows[rows >= first]))).null_count == 0
        before = pa.array(np.isin(np.arange(len(trace)), rows[rows < first]))
        assert tid.filter(before).null_count == (first > rows).sum()
    # the row after a switch runs next_tid; the switch itself is the outgoing prev_tid
    i = int(np.flatnonzero(is_switch)[10])
    m = re.search(r'prev_comm = "([^"]*)", prev_tid = (\d+).*next_comm = "([^"]*)", next_tid = (\d+)', lines[i])
    assert (tid[i].as_py(), comm[i].as_py()) == (int(m.group(2)), m.group(1))
    j = next(k for k in range(i + 1, len(trace)) if cpu[k] == cpu[i])
    assert (tid[j].as_py(), comm[j].as_py()) == (int(m.group(4)), m.group(3))
    # ret: on every syscall exit (babeltrace2's value), nowhere else
    ret = trace.column("ret").to_pylist()
    for k, (e, line) in enumerate(zip(events, lines, strict=True)):
        if e.startswith("syscall_exit_"):
            assert ret[k] == int(re.search(r"[{,] ret = (-?(?:0x[0-9A-Fa-f]+|\d+))", line).group(1), 0)
        else:
            assert ret[k] is None


def test_wget_roundtrip_through_ctf(lttng_wget: Path, tmp_path: Path) -> None:
    trace = read_lttng(lttng_wget)
    write_ctf(trace, tmp_path / "c")
    assert read_lttng(tmp_path / "c") == trace
    write_ctf(trace, tmp_path / "n", context=False)  # derivation alone rebuilds the same threads
    assert read_lttng(tmp_path / "n") == trace
