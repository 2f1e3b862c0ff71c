"""A damaged model config.json is one TraceSynthError naming the model directory, never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_run import one_line_error, tracesynth

from tracesynth.errors import TraceSynthError
from tracesynth.generators.diffusion import GaussianDiffusion, GaussianDiffusionConfig
from tracesynth.io.strace import read_strace

STRACE = Path(__file__).resolve().parents[1] / "fixtures" / "strace" / "strace-f-ttt-T.txt"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("model") / "m"
    cfg = GaussianDiffusionConfig(context=32, d_model=16, n_layers=1, n_heads=2, steps=1, batch_size=2, timesteps=20,
                           sampling_steps=2, checkpoint_every=1, calibrate=False)  # fmt: skip
    GaussianDiffusion(cfg).fit([read_strace(STRACE)], checkpoint_dir=d)
    return d


def _damaged(model: Path, tmp_path: Path, edit) -> Path:  # noqa: ANN001
    d = tmp_path / "m"
    shutil.copytree(model, d)
    meta = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit(meta)))
    return d


def _set(key: str, value: object):  # noqa: ANN202
    def edit(meta: dict) -> dict:
        meta["config"][key] = value
        return meta

    return edit


CASES = {
    "list": lambda m: [],
    "null": lambda m: None,
    "config-null": lambda m: {**m, "config": None},
    "n_heads=0": _set("n_heads", 0),
    "timesteps=0": _set("timesteps", 0),
    "timesteps-huge": _set("timesteps", 10**12),
    "d_model-huge": _set("d_model", 2**40),
    "context-str": _set("context", "32"),
    "lr-nan": _set("lr", float("nan")),
    "calibrate-int": _set("calibrate", 3),
    "step-float": lambda m: {**m, "step": 1.5},
    "step-str": lambda m: {**m, "step": "many"},
    "step-list": lambda m: {**m, "step": []},
    "history-list": lambda m: {**m, "history": [1]},
}


@pytest.mark.parametrize("name", list(CASES))
def test_damaged_config_is_one_error_naming_the_directory(model: Path, tmp_path: Path, name: str) -> None:
    d = _damaged(model, tmp_path, CASES[name])
    with pytest.raises(TraceSynthError) as err:
        GaussianDiffusion.load(d)
    assert err.value.path == str(d)


def test_the_undamaged_model_loads(model: Path) -> None:
    assert GaussianDiffusion.load(model).step == 1


def test_sample_on_a_damaged_model_is_one_line(model: Path, tmp_path: Path) -> None:
    d = _damaged(model, tmp_path, _set("n_heads", 0))
    line = one_line_error(tracesynth("sample", d, "--events", "10", "-o", tmp_path / "s.parquet"))
    assert str(d) in line and "n_heads" in line
    assert not (tmp_path / "s.parquet").exists()
