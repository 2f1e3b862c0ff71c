"""Issue 43, reliability: ar and masked fits checkpoint and resume to the weights of an unkilled run; a saved
model's tensor files are checked (sha256, shapes) on load in one line; sample refuses an impossible --events
before any work and shows progress only when asked; usage errors are one line."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_run import SRC, one_line_error, tracesynth
from typer.testing import CliRunner

from atomicio import OutputPathError
from tracesynth.bounds import SampleProgress, check_sample_size
from tracesynth.cli import app
from tracesynth.errors import TraceSynthError
from tracesynth.generators import load_generator
from tracesynth.generators.ar import ARConfig, Autoregressive
from tracesynth.generators.masked import MaskedConfig, MaskedDiffusion
from tracesynth.generators.tokens import TRAIN_STATE
from tracesynth.io import read_trace

REPO = Path(__file__).resolve().parents[2]
TINY = dict(context=16, d_model=16, n_layers=1, n_heads=2, batch_size=4, overlap=4, chains=2, warmup=5)
KINDS = [(Autoregressive, ARConfig), (MaskedDiffusion, MaskedConfig)]
FIT = ["--context", "16", "--d-model", "16", "--layers", "1", "--batch-size", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def real():
    torch.set_num_threads(1)
    return read_trace(REPO / "data" / "sqlite.parquet").slice(20000, 21000)


class Killed(Exception):
    pass


def _kill_at(step: int):
    def progress(done: int, loss: float) -> None:
        if done == step:  # after the checkpoint of that step was written, as a SIGKILL would find it
            raise Killed

    return progress


@pytest.mark.parametrize("cls, cfg", KINDS)
def test_a_killed_fit_resumes_to_the_weights_of_an_unkilled_one(cls, cfg, real, tmp_path: Path) -> None:
    full = cls(cfg(**TINY, steps=40)).fit([real])
    with pytest.raises(Killed):
        cls(cfg(**TINY, steps=40)).fit([real], progress=_kill_at(25), checkpoint_dir=tmp_path / "m",
                                       checkpoint_every=10)
    back = cls.load(tmp_path / "m")  # the checkpoint is a model: it loads and samples
    assert back.history["steps"] == 20 and len(back.sample(40, seed=1)) == 40
    back.fit([real], checkpoint_dir=tmp_path / "m", checkpoint_every=10, resume=True)
    assert back.history["steps"] == full.history["steps"] == 40
    assert back.history["final_loss"] == pytest.approx(full.history["final_loss"])
    for (name, a), b in zip(full.model.state_dict().items(), back.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, msg=name)


def test_resume_refuses_other_data_a_model_without_state_and_a_finished_fit(real, tmp_path: Path) -> None:
    Autoregressive(ARConfig(**TINY, steps=4)).fit([real], checkpoint_dir=tmp_path / "m", checkpoint_every=2) \
        .save(tmp_path / "m")
    other = read_trace(REPO / "data" / "fio.parquet").slice(0, 1000)
    gen = Autoregressive.load(tmp_path / "m")
    gen.config.steps = 8
    with pytest.raises(TraceSynthError, match="vocabulary differs") as exc:
        gen.fit([other], resume=True)
    assert "\n" not in str(exc.value)
    with pytest.raises(TraceSynthError, match="already trained for 4 steps"):
        Autoregressive.load(tmp_path / "m").fit([real], resume=True)
    (tmp_path / "m" / TRAIN_STATE).unlink()
    with pytest.raises(TraceSynthError, match="no training state"):
        Autoregressive.load(tmp_path / "m").fit([real], resume=True)


def test_the_time_limit_of_a_resumed_fit_counts_the_seconds_before(real, tmp_path: Path) -> None:
    with pytest.raises(Killed):
        Autoregressive(ARConfig(**TINY, steps=40)).fit([real], progress=_kill_at(10), checkpoint_dir=tmp_path / "m",
                                                        checkpoint_every=10)
    gen = Autoregressive.load(tmp_path / "m")
    gen._train_state["meta"]["seconds"] = 1000.0  # as if the first run had trained that long
    gen.config.time_limit = 500.0
    gen.fit([real], resume=True)
    assert gen.history["steps"] == 10 and gen.history["train_seconds"] >= 1000.0


def test_cli_fit_killed_between_checkpoints_resumes_to_the_steps_asked(real, tmp_path: Path) -> None:
    out, data = tmp_path / "m", real.save(tmp_path / "t.parquet")
    env = dict(os.environ, PYTHONPATH=str(SRC), TRACESYNTH_SALT="x")
    args = [sys.executable, "-m", "tracesynth", "fit", str(data), "-o", str(out),
            "--kind", "ar", "--steps", "100000", "--checkpoint-every", "5", *FIT]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):  # a checkpoint appears whole (renamed into place) or not at all
            if (out / "config.json").exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = json.loads((out / "config.json").read_text())["history"]["steps"]
    assert done >= 5 and done % 5 == 0 and (out / TRAIN_STATE).exists()
    # the resume runs in this process, where torch is imported already: the kill above was the real one
    argv = ["fit", str(data), "-o", str(out), "--resume", "--steps", str(done + 3), *FIT]
    r = CliRunner().invoke(app, argv, env={"COLUMNS": "200", "TRACESYNTH_SALT": "x"})
    assert r.exit_code == 0, r.output
    assert f"resuming {out} at step {done}" in " ".join(r.output.split())
    assert load_generator(out).fit_info["train_steps"] == done + 3


def test_cli_fit_checks_its_output_before_training(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from tracesynth.cli import app

    def never(*args, **kwargs):
        raise AssertionError("trained before the output was checked")

    monkeypatch.setattr(Autoregressive, "fit", never)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    data = str(REPO / "data" / "sqlite.parquet")
    for dest in (tmp_path / "user", tmp_path / "file" / "m"):
        r = CliRunner().invoke(app, ["fit", data, "-o", str(dest), *FIT])
        assert isinstance(r.exception, OutputPathError), r.output
    r = CliRunner().invoke(app, ["fit", data, "-o", str(tmp_path / "k"), "--kind", "markov", "--resume"])
    assert isinstance(r.exception, TraceSynthError) and "fits in one pass" in str(r.exception)
    r = CliRunner().invoke(app, ["fit", "--help"], env={"COLUMNS": "300"})
    assert "ar, masked, block, diffusion: continue training" in " ".join(r.output.split())


@pytest.fixture(scope="module")
def saved(real, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("saved")
    Autoregressive(ARConfig(**TINY, steps=2)).fit([real]).save(d / "a")
    Autoregressive(ARConfig(**{**TINY, "max_tids": 5}, steps=2)).fit([real]).save(d / "b")  # other vocab sizes
    return d


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_damaged_tensor_file_is_one_line_naming_it(saved: Path, tmp_path: Path) -> None:
    m = _copy(saved / "a", tmp_path / "m")
    data = bytearray((m / "model.safetensors").read_bytes())
    data[-10] ^= 0x01  # one bit of one weight: safetensors reads it, only the hash sees it
    (m / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(TraceSynthError) as exc:
        load_generator(m)
    assert str(exc.value) == f"{m / 'model.safetensors'}: sha256 mismatch, the file is damaged (or not this model's)"


def test_foreign_tensor_files_are_one_line_naming_the_tensor(saved: Path, tmp_path: Path) -> None:
    for name in ("gaps.safetensors", "model.safetensors"):
        m = _copy(saved / "a", tmp_path / name)
        (m / name).write_bytes((saved / "b" / name).read_bytes())
        meta = json.loads((m / "config.json").read_text())
        del meta["sha256"]  # as a model saved before the hashes: the shapes still tell
        (m / "config.json").write_text(json.dumps(meta))
        with pytest.raises(TraceSynthError, match=rf"^{m / name}: tensor \S+ has shape \(\d+.*\), the config wants"):
            load_generator(m)


def test_the_shipped_model_holds_the_hashes_of_its_tensors() -> None:
    meta = json.loads((REPO / "models" / "all" / "config.json").read_text())
    assert set(meta["sha256"]) == {"model.safetensors", "gaps.safetensors"}


def test_sample_bounds_and_progress(tmp_path: Path, saved: Path) -> None:
    with pytest.raises(TraceSynthError, match="needs about .* GiB of memory"):
        check_sample_size(10**13, "ar")
    with pytest.raises(TraceSynthError, match="at least 1"):
        check_sample_size(0, "markov")
    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True)  # a bar (a log gets lines: the test below)
    with SampleProgress(100, True, show_after=0.0, console=console) as shown:
        shown.update(100)
    with SampleProgress(100, False, show_after=0.0, console=console) as hidden:  # not asked for: nothing at all
        hidden.update(50)
    with SampleProgress(100, True, show_after=3600.0, console=console) as quick:  # a quick sample: no bar
        quick.update(50)
    assert shown.bar.tasks[0].completed == 100 and hidden.bar is None and quick.bar is None
    r = tracesynth("sample", saved / "a", "--events", "10000000000", "-o", tmp_path / "s.parquet")
    assert "GiB of memory" in one_line_error(r) and not (tmp_path / "s.parquet").exists()


def test_a_sample_in_a_log_prints_a_line_at_least_once_a_minute(monkeypatch) -> None:
    """Off a terminal (a log, CI) no bar is drawn: a sample's progress is a line at the start, at least once a
    minute after and at the end, with the time left."""
    import time

    from rich.console import Console

    buf = io.StringIO()
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    with SampleProgress(1000, True, console=Console(file=buf, force_terminal=False, width=200)) as bar:
        for done, t in ((100, 1), (200, 3), (400, 40), (500, 70), (1000, 90)):
            now[0] = 1000.0 + t
            bar.update(done)
    lines = [ln.split(" ", 1)[1] for ln in buf.getvalue().splitlines()]
    assert lines == [  # nothing before 2 s (a quick sample prints nothing)
        "sample: 200/1,000 events, 3s elapsed, about 12s left",
        "sample: 500/1,000 events, 1m10s elapsed, about 1m10s left",
        "sample: 1,000/1,000 events, 1m30s elapsed",
    ]


@pytest.mark.parametrize("args", [["sample", "m", "--events", "0", "-o", "s"], ["sample", "m", "--events", "-5", "-o",
                                  "s"], ["fit", "--no-such-option"]])
def test_usage_errors_are_one_line(args: list[str], tmp_path: Path) -> None:
    r = tracesynth(*args, cwd=tmp_path)
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert r.code == 2 and len(lines) == 1 and lines[0].endswith("(see --help)"), r.err
    assert "--events" in lines[0] or "--no-such-option" in lines[0]
    env = dict(os.environ, PYTHONPATH=str(SRC))
    d = subprocess.run([sys.executable, "-m", "dooly", "profile", "--no-such-option"], capture_output=True, text=True,
                       env=env, stdin=subprocess.DEVNULL)
    assert d.returncode == 2 and len(d.stderr.strip().splitlines()) == 1, d.stderr
