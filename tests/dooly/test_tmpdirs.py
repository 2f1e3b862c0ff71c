"""The vLLM engine's temporary directories leave nothing in the temp dir: removed at exit, and a killed process's
swept by the next one (the mechanism, without starting vLLM; test_vllm_engine runs the engine itself)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dooly.engines._tmpdirs import owned_tmpdir, sweep_stale

MAKE = (
    "import sys\n"
    "from dooly.engines._tmpdirs import owned_tmpdir\n"
    "class Engine: pass\n"
    "e = Engine()\n"
    "a = owned_tmpdir('dooly-vllm-', owner=e)\n"
    "b = owned_tmpdir('dooly-vllm-dist-')\n"
    "(a / 'config.json').write_text('{}'); (b / 'init').write_text('x')\n"
    "print(a, b, flush=True)\n"
    "if sys.argv[1] == 'wait': sys.stdin.read()\n"
)


def _run(tmp_path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-c", MAKE, mode], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_a_clean_exit_leaves_no_directory(tmp_path):
    proc = _run(tmp_path, "exit")
    a, b = proc.stdout.readline().split()
    assert proc.wait(60) == 0
    assert a.startswith(str(tmp_path / f"dooly-vllm-{proc.pid}-"))
    assert b.startswith(str(tmp_path / f"dooly-vllm-dist-{proc.pid}-"))
    assert list(tmp_path.iterdir()) == []


def test_a_killed_process_directories_are_swept_by_the_next(tmp_path):
    proc = _run(tmp_path, "wait")
    proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    assert len(list(tmp_path.iterdir())) == 2  # nothing could remove them
    mine = tmp_path / f"dooly-vllm-{os.getpid()}-live"  # a live owner's (this process)
    other = tmp_path / "dooly-vllm-notapid"  # not named by dooly
    mine.mkdir()
    other.mkdir()
    removed = sweep_stale("dooly-vllm-", tmp_path) + sweep_stale("dooly-vllm-dist-", tmp_path)
    assert len(removed) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])
    # the next process sweeps on its first directory, and removes its own at exit
    proc = _run(tmp_path, "exit")
    proc.stdout.readline()
    assert proc.wait(60) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


def test_a_collected_owner_removes_its_directory(tmp_path, monkeypatch):
    import gc
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    class Owner:
        pass

    owner = Owner()
    d = owned_tmpdir("dooly-test-", owner=owner)
    assert d.is_dir() and d.name.startswith(f"dooly-test-{os.getpid()}-")
    del owner
    gc.collect()
    assert not d.exists()
