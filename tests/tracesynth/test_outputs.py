"""No command loses a user's file: outputs onto occupied paths are refused in one line, earlier
outputs of the same kind are replaced, and no temporary is left behind (issue 14, data loss)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from cli_run import Result, one_line_error, tracesynth

from tracesynth.cli import main
from tracesynth.io.strace import read_strace
from tracesynth.trace import Trace

STRACE = Path(__file__).resolve().parents[1] / "fixtures" / "strace" / "strace-f-ttt-T.txt"
needs_bt2 = pytest.mark.skipif(shutil.which("babeltrace2") is None, reason="babeltrace2 is not installed")
NOTES = "my notes: do not lose me\n"
# the smallest fit that writes a model (about a second once torch is imported)
TINY_FIT = ["--kind", "diffusion", "--context", "32", "--steps", "2", "--batch-size", "2", "--d-model", "16"]
TINY_FIT += ["--layers", "1", "--checkpoint-every", "2", "--threads", "1"]


def _user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "mine"
    d.mkdir()
    (d / "my_notes.txt").write_text(NOTES)
    return d


def _no_temporaries(parent: Path) -> None:
    left = [p.name for p in parent.iterdir() if p.name.startswith(".") and p.name.endswith((".tmp", ".old"))]
    assert left == []


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    p = tmp_path / "t.parquet"
    read_strace(STRACE).save(p)
    return p


def test_ingest_onto_a_directory_is_refused(tmp_path: Path) -> None:
    d = _user_dir(tmp_path)
    line = one_line_error(tracesynth("ingest", STRACE, "-o", d))
    assert str(d) in line and "directory" in line
    assert (d / "my_notes.txt").read_text() == NOTES and [p.name for p in d.iterdir()] == ["my_notes.txt"]
    _no_temporaries(tmp_path)


def test_ingest_rerun_replaces_its_parquet(tmp_path: Path, trace_file: Path) -> None:
    out = tmp_path / "o.parquet"
    assert tracesynth("ingest", STRACE, "-o", out).code == 0
    first = Trace.load(out)
    small = tmp_path / "small.txt"
    small.write_text("".join(STRACE.read_text().splitlines(keepends=True)[:40]))
    r = tracesynth("ingest", small, "-o", out)
    assert r.code == 0, r.err
    second = Trace.load(out)
    assert len(second) < len(first)  # the new content, not the old
    _no_temporaries(tmp_path)


@needs_bt2
def test_export_ctf_onto_a_user_directory_is_refused(tmp_path: Path, trace_file: Path) -> None:
    d = _user_dir(tmp_path)
    line = one_line_error(tracesynth("export", trace_file, "--to", "ctf", d))
    assert str(d) in line and "my_notes.txt" in line
    assert (d / "my_notes.txt").read_text() == NOTES and [p.name for p in d.iterdir()] == ["my_notes.txt"]
    _no_temporaries(tmp_path)


@needs_bt2
def test_export_ctf_rerun_replaces_the_earlier_trace(tmp_path: Path, trace_file: Path) -> None:
    out = tmp_path / "ctf"
    assert tracesynth("export", trace_file, "--to", "ctf", out).code == 0
    first = sorted(p.name for p in out.iterdir())
    half = Trace.load(trace_file).slice(0, 100)
    half.save(tmp_path / "half.parquet")
    r = tracesynth("export", tmp_path / "half.parquet", "--to", "ctf", out)
    assert r.code == 0, r.err
    assert sorted(p.name for p in out.iterdir()) == first
    r = tracesynth("ingest", out, "-o", tmp_path / "back.parquet")
    assert r.code == 0, r.err
    assert len(Trace.load(tmp_path / "back.parquet")) == 100
    _no_temporaries(tmp_path)


def _fit_in_process(args: list[object], capsys, monkeypatch) -> Result:
    """fit through the real entry point in this process (torch is imported once, not per run)."""
    monkeypatch.setattr(sys, "argv", ["tracesynth", "fit", *map(str, args)])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return Result(code, "", capsys.readouterr().err)


def test_fit_onto_a_user_directory_is_refused(tmp_path: Path, trace_file: Path, capsys, monkeypatch) -> None:
    d = _user_dir(tmp_path)
    line = one_line_error(_fit_in_process([trace_file, "-o", d, *TINY_FIT], capsys, monkeypatch))
    assert str(d) in line and "my_notes.txt" in line
    assert (d / "my_notes.txt").read_text() == NOTES and [p.name for p in d.iterdir()] == ["my_notes.txt"]
    _no_temporaries(tmp_path)


def test_fit_rerun_replaces_the_earlier_model(tmp_path: Path, trace_file: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "model"
    assert _fit_in_process([trace_file, "-o", out, *TINY_FIT], capsys, monkeypatch).code == 0
    r = _fit_in_process([trace_file, "-o", out, *TINY_FIT, "--steps", "3", "--seed", "1"], capsys, monkeypatch)
    assert r.code == 0, r.err
    meta = json.loads((out / "config.json").read_text())
    assert meta["step"] == 3 and meta["config"]["seed"] == 1
    _no_temporaries(tmp_path)
