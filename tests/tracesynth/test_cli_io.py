"""ingest / export / anonymize through the CLI, bad input included, and the anonymiser itself."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tracesynth.anonymize import anonymize, anonymize_metadata, hash_comm, relabel_tids
from tracesynth.cli import main
from tracesynth.io.ctf_writer import write_ctf
from tracesynth.io.lttng import read_lttng
from tracesynth.trace import Trace

REPO = Path(__file__).resolve().parents[2]
needs_bt2 = pytest.mark.skipif(shutil.which("babeltrace2") is None, reason="babeltrace2 is not installed")


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """Run the real entry point (error handling included); return (exit status, stderr)."""
    monkeypatch.setattr(sys, "argv", ["tracesynth", *map(str, args)])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def sample_trace() -> Trace:
    return Trace.from_columns(
        ts=[100, 200, 300, 400, 500, 600],
        event=["sched_switch", "syscall_entry_openat", "syscall_exit_openat", "sched_switch", "irq_handler_entry", "x"],
        cpu=[0, 0, 0, 1, 1, None],
        tid=[0, 321, 321, 0, 77, None],
        comm=["swapper/0", "wget", "wget", "swapper/1", "sshd", None],
        ret=[None, None, 3, None, None, None],
        metadata={"source_format": "lttng", "source": "/home/alice/traces/t1", "hostname": "alice-laptop"},
    )


def only(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# -- happy paths ----------------------------------------------------------------------------------
@needs_bt2
def test_export_ctf_then_ingest_roundtrip(tmp_path: Path, capsys, monkeypatch) -> None:
    sample_trace().save(tmp_path / "t.parquet")
    code, err = run_cli(["export", tmp_path / "t.parquet", "--to", "ctf", tmp_path / "ctf"], capsys, monkeypatch)
    assert code == 0, err
    code, err = run_cli(["ingest", tmp_path / "ctf", "-o", tmp_path / "back.parquet"], capsys, monkeypatch)
    assert code == 0, err
    assert "6 events" in err
    assert Trace.load(tmp_path / "back.parquet") == sample_trace()
    code, err = run_cli(["export", tmp_path / "ctf", "--to", "parquet", tmp_path / "p.parquet"], capsys, monkeypatch)
    assert code == 0, err
    assert Trace.load(tmp_path / "p.parquet") == sample_trace()


@needs_bt2
def test_ingest_format_option(tmp_path: Path, capsys, monkeypatch) -> None:
    write_ctf(sample_trace(), tmp_path / "ctf")
    args = ["ingest", tmp_path / "ctf", "-o", tmp_path / "o.parquet", "--format", "lttng", "--workload", "wget"]
    code, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert Trace.load(tmp_path / "o.parquet").metadata["workload"] == "wget"


def test_anonymize_cli(tmp_path: Path, capsys, monkeypatch) -> None:
    sample_trace().save(tmp_path / "t.parquet")
    code, err = run_cli(
        ["anonymize", tmp_path / "t.parquet", "-o", tmp_path / "a.parquet", "--salt", "s3"], capsys, monkeypatch
    )
    assert code == 0, err
    anon = Trace.load(tmp_path / "a.parquet")
    assert anon.column("comm").to_pylist()[1] == hash_comm("wget", "s3")
    assert "wget" not in anon.column("comm").to_pylist()
    assert "alice" not in str(anon.metadata)


# -- bad input: one line naming the file, exit 1, no output left ---------------------------------
def _assert_clean_failure(code: int, err: str, name: str, out_dir: Path, before: list[str]) -> None:
    assert code == 1
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and name in lines[0]
    assert "Traceback" not in err
    assert only(out_dir) == before  # no output and no temporary file


@pytest.mark.parametrize(
    "case",
    ["garbage", "empty_file", "no_trace_dir", "missing", "truncated_ctf", "corrupt_metadata", "no_events_ctf"],
)
def test_ingest_bad_input(case: str, tmp_path: Path, capsys, monkeypatch) -> None:
    if case.endswith("ctf") or case == "corrupt_metadata":
        if shutil.which("babeltrace2") is None:
            pytest.skip("babeltrace2 is not installed")
    bad = tmp_path / case
    if case == "garbage":
        bad.write_bytes(b"\x00\x01 this is not a trace\nreally not\n" * 10)
    elif case == "empty_file":
        bad.write_bytes(b"")
    elif case == "no_trace_dir":
        bad.mkdir()
        (bad / "notes.txt").write_text("hello")
    elif case == "truncated_ctf":
        write_ctf(sample_trace(), bad)
        stream = bad / "channel0_0"
        stream.write_bytes(stream.read_bytes()[:50])
    elif case == "corrupt_metadata":
        write_ctf(sample_trace(), bad)
        (bad / "metadata").write_text("/* CTF 1.8 */\ntrace { this is not tsdl")
    elif case == "no_events_ctf":
        write_ctf(sample_trace(), bad)
        for f in bad.iterdir():
            if f.name != "metadata":
                f.unlink()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, err = run_cli(["ingest", bad, "-o", out_dir / "t.parquet"], capsys, monkeypatch)
    _assert_clean_failure(code, err, case, out_dir, [])


@needs_bt2
def test_export_bad_event_names_leaves_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    Trace.from_columns([1, 2], ["ok_event", "bad event, really"], cpu=[0, 0]).save(tmp_path / "t.parquet")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, err = run_cli(["export", tmp_path / "t.parquet", "--to", "ctf", out_dir / "ctf"], capsys, monkeypatch)
    _assert_clean_failure(code, err, "bad event, really", out_dir, [])


def test_unknown_formats_are_one_line_errors(tmp_path: Path, capsys, monkeypatch) -> None:
    sample_trace().save(tmp_path / "t.parquet")
    code, err = run_cli(["export", tmp_path / "t.parquet", "--to", "xml", tmp_path / "o"], capsys, monkeypatch)
    assert code == 1 and "unknown export format 'xml'" in err
    code, err = run_cli(
        ["ingest", tmp_path / "t.parquet", "-o", tmp_path / "o", "--format", "foo"], capsys, monkeypatch
    )
    assert code == 1 and "unknown format 'foo'" in err
    assert only(tmp_path) == ["t.parquet"]


def test_console_script_error_has_no_traceback(tmp_path: Path) -> None:
    exe = REPO / ".venv" / "bin" / "tracesynth"
    if not exe.exists():
        pytest.skip("the console script is not installed in .venv")
    bad = tmp_path / "junk.txt"
    bad.write_text("nothing to see\n")
    proc = subprocess.run([exe, "ingest", bad, "-o", tmp_path / "o.parquet"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "junk.txt" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o.parquet").exists()


# -- the anonymiser -----------------------------------------------------------------------------
def test_relabel_tids_by_first_appearance_keeps_idle() -> None:
    tid = np.array([500, 0, 42, 500, 7, 42, 0, 9])
    valid = np.array([True, True, True, True, False, True, True, True])
    out = relabel_tids(tid, valid)
    assert out[valid].tolist() == [1, 0, 2, 1, 2, 0, 3]
    assert out[4] == 7  # invalid rows untouched (they are nulls)


def test_anonymize_hashes_relabels_and_scrubs() -> None:
    trace = sample_trace()
    a1, a2, b = anonymize(trace, "salt"), anonymize(trace, "salt"), anonymize(trace, "other")
    assert a1 == a2  # stable for a salt
    assert a1.column("comm").to_pylist() != b.column("comm").to_pylist()
    comm = a1.column("comm").to_pylist()
    assert comm[1] == comm[2] and comm[5] is None and all(c is None or len(c) <= 15 for c in comm)
    assert a1.column("tid").to_pylist() == [0, 1, 1, 0, 2, None]
    for col in ("ts", "event", "cpu", "ret"):
        assert a1.column(col).equals(trace.column(col))
    assert "source" not in a1.metadata and "hostname" not in a1.metadata
    assert a1.metadata["source_format"] == "lttng" and "anonymized" in a1.metadata


def test_anonymize_metadata_drops_nested_paths() -> None:
    meta = anonymize_metadata(
        {"workload": "wget", "perf": {"cmdline": "perf record", "version": "6.1"}, "files": ["/etc/x"], "x": "/root/y"}
    )
    assert meta["workload"] == "wget" and meta["perf"] == {"version": "6.1"}
    assert "files" not in meta and "x" not in meta


@needs_bt2
def test_anonymized_trace_exports_to_ctf(tmp_path: Path) -> None:
    anon = anonymize(sample_trace(), "k")
    write_ctf(anon, tmp_path / "c")
    assert read_lttng(tmp_path / "c") == anon


@needs_bt2
def test_ingest_wget_done_when(lttng_wget: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    code, err = run_cli(["ingest", lttng_wget, "-o", tmp_path / "w.parquet"], capsys, monkeypatch)
    assert code == 0, err
    w = Trace.load(tmp_path / "w.parquet")
    assert len(w) == 17_702 and w.summary()["with_ret"] > 4000
