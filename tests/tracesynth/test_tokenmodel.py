"""What the token generators share: one conditional model learns several workloads and draws the one asked for."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tracesynth.autoregressive import ARConfig, Autoregressive
from tracesynth.errors import TraceSynthError
from tracesynth.io import read_trace
from tracesynth.masked import MaskedConfig, MaskedDiffusion

REPO = Path(__file__).resolve().parents[2]
TINY = dict(context=32, d_model=32, n_layers=1, n_heads=2, batch_size=16, overlap=8, chains=4, sample_steps=8)


@pytest.fixture(scope="module")
def two():
    return [read_trace(REPO / "data" / f"{w}.parquet").slice(20000, 23000) for w in ("sqlite", "fio")]


def _tv(a, b) -> float:
    """Total variation distance of the event-type histograms of two traces."""
    p, q = Counter(a.table["event"].to_pylist()), Counter(b.table["event"].to_pylist())
    return 0.5 * sum(abs(p[k] / len(a) - q[k] / len(b)) for k in set(p) | set(q))


@pytest.mark.parametrize("cls, cfg", [(Autoregressive, ARConfig), (MaskedDiffusion, MaskedConfig)])
def test_a_conditional_model_draws_the_workload_asked_for(cls, cfg, two, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    fields = {k: v for k, v in TINY.items() if k in cfg.__dataclass_fields__}
    model = cls(cfg(**fields, steps=150, conditional=True)).fit(two)
    assert model.workloads == ["fio", "sqlite"]
    model.save(tmp_path / "m")
    back = cls.load(tmp_path / "m")
    for real, other in (two, two[::-1]):
        name = real.metadata["workload"]
        s = back.sample(400, seed=0, workload=name)
        assert s.metadata["workload"] == name and s == model.sample(400, seed=0, workload=name)
        assert _tv(s, real) < _tv(s, other) - 0.15, (name, _tv(s, real), _tv(s, other))
    with pytest.raises(TraceSynthError, match="no workload 'stream' .it knows fio, sqlite"):
        back.sample(10, workload="stream")
    nameless = two[0].slice(0, 100)
    nameless.metadata.pop("workload")
    with pytest.raises(TraceSynthError, match="workload name"):
        cls(cfg(**fields, steps=1, conditional=True)).fit([nameless])


def test_cli_conditional_fit_and_workload_sample(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tracesynth.cli import app

    data = [str(REPO / "data" / f"{w}.parquet") for w in ("sqlite", "fio")]
    r = CliRunner().invoke(app, ["fit", *data, "-o", str(tmp_path / "m"), "--kind", "ar", "--conditional",
                                 "--context", "32", "--d-model", "16", "--layers", "1", "--steps", "2",
                                 "--batch-size", "2"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "s.parquet"
    r = CliRunner().invoke(app, ["sample", str(tmp_path / "m"), "--events", "50", "--workload", "fio", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert len(read_trace(out)) == 50 and read_trace(out).metadata["workload"] == "fio"
    r = CliRunner().invoke(app, ["sample", str(tmp_path / "m"), "--events", "5", "--workload", "x", "-o", str(out)])
    assert isinstance(r.exception, TraceSynthError) and "no workload 'x'" in str(r.exception)
    r = CliRunner().invoke(app, ["fit", data[0], "-o", str(tmp_path / "k"), "--kind", "markov", "--conditional"])
    assert isinstance(r.exception, TraceSynthError) and "--conditional applies to masked" in str(r.exception)


@pytest.mark.parametrize("kind", ["masked", "ar"])
def test_cli_fits_and_samples_a_token_model(tmp_path: Path, kind: str) -> None:
    from typer.testing import CliRunner

    from tracesynth.cli import app

    sqlite = REPO / "data" / "sqlite.parquet"
    r = CliRunner().invoke(app, ["fit", str(sqlite), "-o", str(tmp_path / "m"), "--kind", kind, "--context", "32",
                                 "--d-model", "16", "--layers", "1", "--steps", "3", "--batch-size", "2"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["sample", str(tmp_path / "m"), "--events", "100", "-o", str(tmp_path / "s.parquet")])
    assert r.exit_code == 0, r.output
    assert len(read_trace(tmp_path / "s.parquet")) == 100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls, cfg", [(Autoregressive, ARConfig), (MaskedDiffusion, MaskedConfig)])
def test_trains_on_cuda_as_on_the_cpu_and_samples_on_the_cpu(cls, cfg, two) -> None:
    fields = {k: v for k, v in TINY.items() if k in cfg.__dataclass_fields__}
    data = {c: torch.from_numpy(v[:64]) for c, v in cls(cfg(**fields, steps=0)).fit(two[:1]).windows(two[:1]).items()}
    losses = {}
    for dev in ("cpu", "cuda"):
        torch.manual_seed(0)
        gen = cls(cfg(**fields, steps=100, device=dev)).fit(two[:1])
        assert next(gen.model.parameters()).device.type == "cpu"
        with torch.no_grad():
            torch.manual_seed(1)
            losses[dev] = float(gen.loss(data))
        assert len(gen.sample(64, seed=1)) == 64
    assert abs(losses["cuda"] - losses["cpu"]) < 0.25 * losses["cpu"], losses  # the same training, other kernels


@pytest.mark.parametrize("cls, cfg", [(Autoregressive, ARConfig), (MaskedDiffusion, MaskedConfig)])
def test_a_cuda_fit_without_a_gpu_is_refused_in_one_line(cls, cfg, two) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    fields = {k: v for k, v in TINY.items() if k in cfg.__dataclass_fields__}
    with pytest.raises(TraceSynthError, match="no CUDA GPU"):
        cls(cfg(**fields, steps=1, device="cuda")).fit(two[:1])


def test_chains_are_cut_where_the_next_one_can_follow() -> None:
    from tracesynth.tokenmodel import SEAM_TRIM, _seam_ends

    ev = np.array([[1, 2, 3, 9, 1, 2, 3, 4],   # ends on 4; 4 -> 9 never occurs, 3 -> 9 does (inside chain 0)
                   [9, 1, 2, 3, 4, 1, 2, 4],   # ends on 4 too, and chain 2 starts with 1: 4 -> 1 occurs
                   [1, 2, 3, 4, 1, 2, 3, 4]])
    assert _seam_ends(ev, 10).tolist() == [7, 8, 8]
    never = np.array([[1, 1, 1, 1], [7, 7, 7, 7]])  # 1 -> 7 occurs nowhere: the seam is left as it is
    assert _seam_ends(never, 10).tolist() == [4, 4]
    far = np.array([[5, 6] + [1] * (SEAM_TRIM + 1), [6] * (SEAM_TRIM + 3)])  # the mending cut is out of reach
    assert _seam_ends(far, 10).tolist() == [SEAM_TRIM + 3, SEAM_TRIM + 3]
