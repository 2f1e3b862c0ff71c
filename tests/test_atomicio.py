"""atomicio.atomic_path: outputs appear whole or not at all, and never replace what is not theirs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from atomicio import OutputPathError, atomic_path

MODEL = ("config.json", "*.safetensors")


def _write_model(dest: Path, text: str) -> None:
    with atomic_path(dest, directory=True, contents=MODEL) as tmp:
        (tmp / "config.json").write_text(text)
        (tmp / "w.safetensors").write_bytes(b"x")


def test_replaces_an_output_of_the_same_kind(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    _write_model(dest, "one")
    _write_model(dest, "two")
    assert (dest / "config.json").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing set aside or left over


@pytest.mark.parametrize("directory", [True, False])
def test_refuses_what_is_not_its_output(tmp_path: Path, directory: bool) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "my_notes.txt").write_text("mine")
    with pytest.raises(OutputPathError, match="my_notes.txt" if directory else "is a directory"):
        with atomic_path(dest, directory=directory, contents=MODEL):
            raise AssertionError("must refuse before yielding")
    assert (dest / "my_notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_file_where_a_directory_goes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("mine")
    with pytest.raises(OutputPathError, match="not a directory"):
        _write_model(tmp_path / "out", "x")
    assert (tmp_path / "out").read_text() == "mine"


def test_failure_leaves_the_old_output_and_no_temporary(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    _write_model(dest, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(dest, directory=True, contents=MODEL) as tmp:
            (tmp / "config.json").write_text("half")
            raise RuntimeError("killed mid-write")
    assert (dest / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_leftovers_of_a_killed_run_are_recovered(tmp_path: Path) -> None:
    """SIGKILL between "rename aside" and "rename into place": the next write restores, then replaces."""
    dest = tmp_path / "model"
    _write_model(dest, "old")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    aside = tmp_path / f".model.{dead.pid}.abc.old"
    os.replace(dest, aside)
    (tmp_path / f".model.{dead.pid}.def.tmp").mkdir()
    with atomic_path(dest, directory=True, contents=MODEL) as tmp:
        # the swept set-aside copy is back in place before the new output is written
        assert (dest / "config.json").read_text() == "old"
        (tmp / "config.json").write_text("new")
    assert (dest / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_sigterm_removes_the_temporary(tmp_path: Path) -> None:
    """The CLIs turn SIGTERM into SystemExit, so the context manager's cleanup runs."""
    code = textwrap.dedent(
        f"""
        import signal, sys, time
        from atomicio import atomic_path
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
        with atomic_path({str(tmp_path / "out.txt")!r}) as tmp:
            tmp.write_text("partial")
            print("writing", flush=True)
            time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_place_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="cannot create the output's directory"):
        with atomic_path(tmp_path / "file" / "sub" / "out.txt"):
            pass
    assert (tmp_path / "file").read_text() == "x"
