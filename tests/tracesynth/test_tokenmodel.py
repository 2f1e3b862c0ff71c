"""What the token generators share: one conditional model learns several workloads and draws the one asked for."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tracesynth.errors import TraceSynthError
from tracesynth.generators.ar import ARConfig, Autoregressive
from tracesynth.generators.masked import MaskedConfig, MaskedDiffusion
from tracesynth.io import read_trace

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


def test_cli_fit_defaults_to_the_shipped_checkpoints_kind_and_recipe(tmp_path: Path) -> None:
    """Without --kind a fit is an autoregressive model of the shipped checkpoint's size and optimiser settings
    (scripts/train_models.py); an option given still wins."""
    from typer.testing import CliRunner

    from tracesynth.cli import app

    shipped = json.loads((REPO / "models" / "all" / "config.json").read_text())
    sqlite = str(REPO / "data" / "sqlite.parquet")
    r = CliRunner().invoke(app, ["fit", sqlite, "-o", str(tmp_path / "m"), "--steps", "1", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert "fit: 1/1 steps, loss" in r.output  # off a terminal the bar is a plain line (at least once a minute)
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["format"] == shipped["format"]
    for key in ("context", "d_model", "n_layers", "batch_size", "lr"):
        assert meta["config"][key] == shipped["config"][key], key
    r = CliRunner().invoke(app, ["fit", sqlite, "-o", str(tmp_path / "n"), "--steps", "1", "--context", "32",
                                 "--d-model", "16", "--lr", "0.01", "--threads", "1"])  # fmt: skip
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "n" / "config.json").read_text())["config"]
    assert (cfg["context"], cfg["d_model"], cfg["lr"], cfg["batch_size"]) == (32, 16, 0.01, 32)


@pytest.mark.parametrize("kind", ["masked", "ar"])
def test_cli_fit_and_a_pipeline_config_build_the_same_model(kind: str, tmp_path: Path) -> None:
    """`tracesynth fit --kind K` and {"kind": K} in a pipeline config take every default from one place, the
    kind's config class: the same config, apart from the steps asked for."""
    from dataclasses import replace

    from typer.testing import CliRunner

    from tracesynth.cli import app
    from tracesynth.generators import load_generator, make_generator

    args = ["fit", str(REPO / "data" / "sqlite.parquet"), "-o", str(tmp_path / "m"), "--kind", kind]
    r = CliRunner().invoke(app, [*args, "--steps", "1", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert load_generator(tmp_path / "m").config == replace(make_generator({"kind": kind}).config, steps=1)


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
    from tracesynth.generators.tokens import SEAM_TRIM, _seam_ends

    ev = np.array([[1, 2, 3, 9, 1, 2, 3, 4],   # ends on 4; 4 -> 9 never occurs, 3 -> 9 does (inside chain 0)
                   [9, 1, 2, 3, 4, 1, 2, 4],   # ends on 4 too, and chain 2 starts with 1: 4 -> 1 occurs
                   [1, 2, 3, 4, 1, 2, 3, 4]])
    assert _seam_ends(ev, 10).tolist() == [7, 8, 8]
    never = np.array([[1, 1, 1, 1], [7, 7, 7, 7]])  # 1 -> 7 occurs nowhere: the seam is left as it is
    assert _seam_ends(never, 10).tolist() == [4, 4]
    far = np.array([[5, 6] + [1] * (SEAM_TRIM + 1), [6] * (SEAM_TRIM + 3)])  # the mending cut is out of reach
    assert _seam_ends(far, 10).tolist() == [SEAM_TRIM + 3, SEAM_TRIM + 3]


@pytest.mark.parametrize("cls, cfg", [(Autoregressive, ARConfig), (MaskedDiffusion, MaskedConfig)])
def test_a_warm_start_computes_what_the_model_it_starts_from_computed(cls, cfg, two) -> None:
    """fit(init=) on other traces (other token ids: sqlite's events, errnos and commands come first), zero steps:
    on the windows both know, every token both vocabularies hold gets the start model's logit, its workload
    vector (one workload) folded into the unconditional network's positions."""
    torch.set_num_threads(1)
    fields = {k: v for k, v in TINY.items() if k in cfg.__dataclass_fields__}
    fio = two[1]
    start = cls(cfg(**fields, steps=20, conditional=True)).fit([fio])
    new = cls(cfg(**fields, steps=0)).fit(two, init=start)
    assert new.codec.events != start.codec.events  # the ids differ: the rows were carried over by name
    with torch.no_grad():
        was = start.model({c: torch.from_numpy(v[:4]) for c, v in start.windows([fio]).items()})
        now = new.model({c: torch.from_numpy(v[:4]) for c, v in new.windows([fio]).items()})
    for c, logits in was.items():
        names = start.token_names(c)
        mine = {n: i for i, n in enumerate(new.token_names(c))}
        both = [i for i, n in enumerate(names) if n in mine]
        assert len(both) > 1, c
        torch.testing.assert_close(now[c][..., [mine[names[i]] for i in both]], logits[..., both],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
    with pytest.raises(TraceSynthError, match="the size of the one it starts from .d_model 16 vs 32"):
        cls(cfg(**{**fields, "d_model": 16}, steps=0)).fit(two, init=start)


def test_a_warm_start_learns_a_short_trace_faster_than_random_weights(two) -> None:
    """The same 10 steps on 1,500 events of sqlite: from a model fitted on other sqlite and fio events the
    held-out loss is far below that of the same network from random weights."""
    torch.set_num_threads(1)
    fields = {k: v for k, v in TINY.items() if k in ARConfig.__dataclass_fields__}
    start = Autoregressive(ARConfig(**fields, steps=150, conditional=True)).fit(two)
    sqlite = read_trace(REPO / "data" / "sqlite.parquet")
    short, held = sqlite.slice(40000, 41500), sqlite.slice(42000, 44000)
    losses = {}
    for how, init in (("scratch", None), ("warm", start)):
        model = Autoregressive(ARConfig(**fields, steps=10)).fit([short], init=init)
        torch.manual_seed(0)
        with torch.no_grad():
            losses[how] = float(model.loss({c: torch.from_numpy(v) for c, v in model.windows([held]).items()}))
    assert losses["warm"] < 0.7 * losses["scratch"], losses


def test_cli_fit_init_keeps_the_size_and_kind_of_the_model_it_starts_from(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tracesynth.cli import app

    sqlite, fio = (str(REPO / "data" / f"{w}.parquet") for w in ("sqlite", "fio"))
    run = CliRunner().invoke
    r = run(app, ["fit", sqlite, "-o", str(tmp_path / "a"), "--kind", "ar", "--context", "32", "--d-model", "16",
                  "--layers", "1", "--steps", "2", "--batch-size", "2"])  # fmt: skip
    assert r.exit_code == 0, r.output
    r = run(app, ["fit", fio, "-o", str(tmp_path / "b"), "--init", str(tmp_path / "a"), "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert "started from" in " ".join(r.output.split())  # the console may wrap the line
    b = Autoregressive.load(tmp_path / "b")
    assert (b.config.context, b.config.d_model, b.config.batch_size) == (32, 16, 2)
    r = run(app, ["fit", fio, "-o", str(tmp_path / "c"), "--init", str(tmp_path / "a"), "--context", "64"])
    assert isinstance(r.exception, TraceSynthError) and "drop the option" in str(r.exception)
    r = run(app, ["fit", fio, "-o", str(tmp_path / "c"), "--init", str(tmp_path / "a"), "--kind", "masked"])
    assert isinstance(r.exception, TraceSynthError) and "fit it with --kind ar" in str(r.exception)
    assert not (tmp_path / "c").exists()
