"""Damaged inputs give one-line errors or a warning and the rest of the trace, never a wrong silent result."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_run import tracesynth

from tracesynth.io import read_trace
from tracesynth.io.perf import read_perf_script
from tracesynth.io.strace import read_strace
from tracesynth.trace import Trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STRACE = FIXTURES / "strace" / "strace-f-ttt-T.txt"
PERF_SCRIPT = FIXTURES / "perf" / "perf-script.txt"
PERF_CTF = FIXTURES / "perf" / "ctf"
needs_bt2 = pytest.mark.skipif(shutil.which("babeltrace2") is None, reason="babeltrace2 is not installed")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


# -- CTF ------------------------------------------------------------------------------------------
@needs_bt2
def test_invalid_utf8_in_a_ctf_string_is_kept_with_a_warning(tmp_path: Path, lttng_wget: Path) -> None:
    good = read_trace(lttng_wget)
    bad = _copy(lttng_wget, tmp_path / "t")
    flipped = 0
    for stream in bad.glob("k_*"):  # every "wget" comm / next_comm becomes "w\xffet"
        data = stream.read_bytes()
        flipped += data.count(b"wget\0")
        stream.write_bytes(data.replace(b"wget\0", b"w\xffet\0"))
    assert flipped
    with pytest.warns(UserWarning, match=r"invalid UTF-8.*U\+FFFD"):
        t = read_trace(bad)
    assert len(t) == len(good)  # no event lost
    comms = set(t.column("comm").drop_null().to_pylist())
    assert "w\ufffdet" in comms and "wget" not in comms
    assert np.array_equal(t.ts, good.ts)


@needs_bt2
@pytest.mark.parametrize("damage", ["empty", "deleted"])
def test_an_empty_or_deleted_lttng_stream_is_named(tmp_path: Path, lttng_wget: Path, damage: str) -> None:
    full = read_trace(lttng_wget)
    t = _copy(lttng_wget, tmp_path / "t")
    if damage == "empty":
        (t / "k_1").write_bytes(b"")
    else:
        (t / "k_1").unlink()
    with pytest.warns(UserWarning, match="k_1") as rec:
        part = read_trace(t)
    assert any(("empty" if damage == "empty" else "missing") in str(w.message) for w in rec)
    assert 0 < len(part) < len(full)  # the other streams still load
    assert 1 not in set(part.table["cpu"].drop_null().to_pylist())


@needs_bt2
def test_a_deleted_perf_ctf_stream_is_named(tmp_path: Path) -> None:
    t = _copy(PERF_CTF, tmp_path / "ctf")
    (t / "perf_stream_0").unlink()
    with pytest.warns(UserWarning, match="perf_stream_0 missing"):
        assert len(read_trace(t)) > 0


@needs_bt2
def test_an_intact_trace_gives_no_stream_warning(lttng_wget: Path, recwarn) -> None:
    read_trace(lttng_wget)
    assert not [w for w in recwarn if "stream" in str(w.message)]


# -- text formats -----------------------------------------------------------------------------------
def test_perf_script_with_crlf_reads_like_lf(tmp_path: Path) -> None:
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(PERF_SCRIPT.read_bytes().replace(b"\n", b"\r\n"))
    lf, got = read_perf_script(PERF_SCRIPT), read_perf_script(crlf)
    assert got == lf
    assert got.table["ret"].null_count < len(got)  # exits carry ret


def test_strace_with_crlf_reads_like_lf(tmp_path: Path) -> None:
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(STRACE.read_bytes().replace(b"\n", b"\r\n"))
    assert read_strace(crlf) == read_strace(STRACE)


@pytest.mark.parametrize(
    "line",
    [
        '1234 99999999999999999999.000001 read(3, "", 10) = 0 <0.000010>',  # seconds beyond int64
        '1234 9300000000.000001 read(3, "", 10) = 0 <0.000010>',  # fits as s, not as ns
        '1234 1796223841.000001 read(3, "", 10) = 99999999999999999999 <0.000010>',  # return value
        '1234 1796223841.000001 read(3, "", 10) = 0x1ffffffffffffffff <0.000010>',  # 65-bit register
        '1234 1796223841.000001 read(3, "", 10) = 0 <99999999999999999.000010>',  # duration
        '123456789012345678901234 1796223841.000001 read(3, "", 10) = 0 <0.000010>',  # pid
    ],
)
def test_strace_numbers_beyond_int64_skip_that_line_with_a_warning(tmp_path: Path, line: str) -> None:
    text = STRACE.read_text().splitlines(keepends=True)
    p = tmp_path / "s.txt"
    p.write_text("".join(text[:3]) + line + "\n" + "".join(text[3:6]))
    with pytest.warns(UserWarning, match=r"skipped 1 line\(s\) whose .* 64 bits \(line 4\)") as rec:
        t = read_strace(p)
    assert str(p) in str(rec[0].message)
    assert len(t) == len(read_strace(_lines(tmp_path, text[:6])))  # everything else kept
    r = tracesynth("ingest", p, "-o", tmp_path / "o.parquet")
    assert r.code == 0 and "Traceback" not in r.err


def _lines(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "ref.txt"
    p.write_text("".join(lines))
    return p


def test_strace_fraction_beyond_nanoseconds_is_truncated(tmp_path: Path) -> None:
    p = tmp_path / "s.txt"
    p.write_text('1 1700000000.1234567891234 read(3, "", 10) = 0 <0.000010>\n')
    assert read_strace(p).ts[0] == 1_700_000_000_123_456_789


def test_strace_with_only_oversized_lines_is_one_error(tmp_path: Path) -> None:
    p = tmp_path / "s.txt"
    p.write_text('1 99999999999999999999.0 read(3, "", 10) = 0 <0.000010>\n')
    r = tracesynth("ingest", p, "-o", tmp_path / "o.parquet")
    assert r.code == 1 and "Traceback" not in r.err and "64 bits" in r.err and str(p) in r.err
    assert not (tmp_path / "o.parquet").exists()


# -- info on extreme timestamps ---------------------------------------------------------------------
def test_info_on_timestamps_spanning_2_pow_63(tmp_path: Path) -> None:
    t = Trace.from_columns(
        ts=[-(2**62), -(2**62) + 5, 2**62 - 10, 2**62],
        event=["syscall_entry_read", "syscall_exit_read", "syscall_entry_read", "syscall_exit_read"],
        tid=[1, 1, 1, 1],
        ret=[None, 0, None, 3],
    )
    assert t.duration_ns == 2**63
    t.save(tmp_path / "t.parquet")
    r = tracesynth("info", tmp_path / "t.parquet")
    assert r.code == 0 and "Traceback" not in r.err and "overflow" not in r.err, r.err
    assert "9223372036.855 s" in r.out  # 2**63 ns, not a wrapped negative span
    wide = Trace.from_columns(ts=[-(2**62), 2**62], event=["syscall_entry_read", "syscall_exit_read"], tid=[1, 1])
    from tracesynth.stats import syscall_latencies

    assert syscall_latencies(wide)[0].tolist() == [2**63]


@needs_bt2
def test_truncated_lttng_metadata_is_one_error_not_a_hang(tmp_path: Path, lttng_wget: Path) -> None:
    t = _copy(lttng_wget, tmp_path / "t")
    meta = (t / "metadata").read_bytes()
    (t / "metadata").write_bytes(meta[:55933])  # cut inside a packet: babeltrace2 2.0 spins on it
    r = tracesynth("ingest", t, "-o", tmp_path / "o.parquet", timeout=60)
    assert not r.timed_out and r.code == 1 and "Traceback" not in r.err
    assert "metadata" in r.err and "cut short" in r.err
    assert not (tmp_path / "o.parquet").exists()


def test_a_stuck_perf_script_is_killed_with_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """perf script can loop forever on a damaged perf.data: the reader gives up and kills it."""
    import time

    from tracesynth.errors import TraceSynthError
    from tracesynth.io.perf import read_perf_data

    fake = tmp_path / "bin" / "perf"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\nexec sleep 600\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("TRACESYNTH_STALL_SECONDS", "2")
    t0 = time.monotonic()
    with pytest.raises(TraceSynthError, match="printed nothing for 2 s") as err:
        read_perf_data(FIXTURES / "perf" / "perf.data")
    assert time.monotonic() - t0 < 30
    assert err.value.path == str(FIXTURES / "perf" / "perf.data")
    pid = int((tmp_path / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
