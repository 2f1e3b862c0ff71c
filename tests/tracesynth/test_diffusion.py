"""The diffusion generator: schedule and samplers, fit / sample / save / load, CLI, errors."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from tracesynth.errors import TraceSynthError
from tracesynth.generators import Generator
from tracesynth.generators.diffusion import (
    DDIMSampler,
    GaussianDiffusion,
    GaussianDiffusionConfig,
    NoiseSchedule,
    make_sampler,
)
from tracesynth.generators.diffusion.gaussian import CALIBRATION_TEMPERATURES
from tracesynth.generators.diffusion.samplers import AncestralSampler
from tracesynth.trace import Trace

TINY = dict(
    context=32,
    d_model=32,
    n_layers=1,
    n_heads=2,
    steps=6,
    batch_size=4,
    sampling_steps=4,
    checkpoint_every=3,
    timesteps=100,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: thread hand-offs cost more than they save, badly so on a shared, busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pattern_trace(n: int = 600, seed: int = 0) -> Trace:
    """A strongly patterned trace: enter/exit pairs and a context switch every 10 events."""
    rng = np.random.default_rng(seed)
    cycle = ["sys_enter_read", "sys_exit_read"] * 4 + ["sys_enter_write", "sched_switch"]
    events = [cycle[i % len(cycle)] for i in range(n)]
    ret = [
        (-11 if rng.random() < 0.2 else int(rng.integers(1, 4096))) if e.startswith("sys_exit") else None
        for e in events
    ]
    tid = rng.choice([10, 11, 12], n)
    return Trace.from_columns(
        np.cumsum(rng.integers(50, 5000, n)),
        events,
        cpu=rng.integers(0, 2, n),
        tid=tid,
        comm=np.where(tid == 10, "a", "b"),
        ret=ret,
        metadata={"workload": "pattern"},
    )


@pytest.fixture(scope="module")
def fitted() -> GaussianDiffusion:
    return GaussianDiffusion(GaussianDiffusionConfig(**TINY)).fit([pattern_trace()])


def test_schedule_add_noise_inverts_through_predict_x0() -> None:
    s = NoiseSchedule(1000)
    assert s.alphas_cumprod[0] > 0.999 and s.alphas_cumprod[-1] < 1e-3
    x0, noise = torch.randn(3, 8, 5), torch.randn(3, 8, 5)
    t = torch.tensor([0, 500, 999])
    xt = s.add_noise(x0, noise, t)
    assert torch.allclose(s.predict_x0(xt, noise, t), x0, atol=1e-3)
    assert NoiseSchedule(100, "cosine").betas.max() <= 0.999


@pytest.mark.parametrize("kind", ["ddim", "ancestral"])
def test_samplers_recover_x0_from_an_oracle_denoiser(kind: str) -> None:
    """Fed the exact noise of a fixed x0, every sampler must land on that x0."""
    s = NoiseSchedule(1000)
    smp = make_sampler(kind, s, 10)
    assert len(smp.timesteps) == (10 if kind == "ddim" else 1000)
    x0 = torch.randn(2, 4, 3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 3, generator=g)
    for t in smp.timesteps:
        a = float(s.alphas_cumprod[t])
        eps = (x - a**0.5 * x0) / (1 - a) ** 0.5  # what a perfect network would predict
        x = smp.step(eps, t, x, g)
    assert torch.allclose(x, x0, atol=1e-3)
    assert isinstance(make_sampler("ddim", s, 5), DDIMSampler) and isinstance(
        make_sampler("ancestral", s), AncestralSampler
    )
    with pytest.raises(ValueError):
        make_sampler("euler", s)


def test_fit_sample_produces_valid_traces(fitted: GaussianDiffusion) -> None:
    assert isinstance(fitted, Generator) and fitted.name == "diffusion"
    assert fitted.step == TINY["steps"] and np.isfinite(fitted.history["loss"])
    # the soft-clamp temperature was picked on the validation windows, among the candidates
    assert len(fitted.history["calibration"]) == len(CALIBRATION_TEMPERATURES)
    assert fitted.config.clamp_temperature in CALIBRATION_TEMPERATURES
    out = fitted.sample(100, seed=1)
    assert len(out) == 100
    out.validate()
    assert set(out.event_counts()) <= set(pattern_trace().event_counts())
    tids = out.column("tid").drop_null().to_pylist()
    assert tids and max(tids) <= 3  # relabelled, never the real 10/11/12
    assert out.metadata["generator"] == "diffusion" and out.metadata["workload"] == "pattern"
    assert len(fitted.sample(0)) == 0


def test_same_seed_same_events_and_survives_save_load(fitted: GaussianDiffusion, tmp_path: Path) -> None:
    a = fitted.sample(70, seed=5)
    assert fitted.sample(70, seed=5) == a
    assert fitted.sample(70, seed=6) != a
    fitted.save(tmp_path / "m")
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert files == ["config.json", "model.safetensors", "optimizer.safetensors", "vocab.json"]
    assert not list(tmp_path.glob(".m.*"))  # no temporary left behind
    loaded = GaussianDiffusion.load(tmp_path / "m")
    assert loaded.sample(70, seed=5) == a
    anc = loaded.sample(32, seed=5, sampler="ancestral")
    assert len(anc) == 32 and anc.metadata["sampling_steps"] == 100 and anc.metadata["sampler"] == "ancestral"


def test_two_channel_model_and_patching() -> None:
    cfg = GaussianDiffusionConfig(**{**TINY, "channels": 2, "patch": 4, "prediction": "x0"})
    synth = GaussianDiffusion(cfg).fit([pattern_trace(300)])
    assert synth.model.patch == 4 and set(synth.codec.channels) == {"event", "dt"}
    out = synth.sample(40, seed=0)
    assert len(out) == 40 and out.column("cpu").null_count == 40


def test_resume_continues_from_the_checkpoint(tmp_path: Path) -> None:
    tr = pattern_trace(300)
    synth = GaussianDiffusion(GaussianDiffusionConfig(**{**TINY, "steps": 3})).fit([tr], checkpoint_dir=tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["step"] == 3
    assert load_file(str(tmp_path / "m" / "optimizer.safetensors"))  # AdamW moments are saved
    again = GaussianDiffusion.load(tmp_path / "m")
    again.config.steps = 5
    again.fit([tr], checkpoint_dir=tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["step"] == 5
    assert synth.codec == again.codec


def test_time_limit_stops_training_early() -> None:
    cfg = GaussianDiffusionConfig(**{**TINY, "steps": 10_000, "time_limit": 1e-6})
    synth = GaussianDiffusion(cfg).fit([pattern_trace(300)])
    assert synth.step < 10_000 and synth.history["steps"] == synth.step


def test_sample_only_samples(fitted: GaussianDiffusion) -> None:
    # repair is its own step (tracesynth.constraints.repair_trace), not an option of sample()
    assert "repair" not in inspect.signature(fitted.sample).parameters
    assert not hasattr(fitted, "last_repair_report")
    assert fitted.sample(50, seed=4) == fitted.sample(50, seed=4)


def test_errors_name_the_model_directory(fitted: GaussianDiffusion, tmp_path: Path) -> None:
    with pytest.raises(TraceSynthError, match="no such model directory"):
        GaussianDiffusion.load(tmp_path / "absent")
    fitted.save(tmp_path / "m")
    (tmp_path / "m" / "vocab.json").unlink()
    with pytest.raises(TraceSynthError, match=r"m: not a tracesynth model: missing vocab.json"):
        GaussianDiffusion.load(tmp_path / "m")
    fitted.save(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(TraceSynthError, match=r"m/model.safetensors: sha256 mismatch"):
        GaussianDiffusion.load(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    del meta["sha256"]  # a model saved before the hashes: the file itself is then found unreadable
    (tmp_path / "m" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(TraceSynthError, match="unreadable model"):
        GaussianDiffusion.load(tmp_path / "m")


def test_a_foreign_optimizer_state_and_a_resumed_time_limit(fitted: GaussianDiffusion, tmp_path: Path) -> None:
    """Tensors of another model are one line naming file and tensor; a resume counts the seconds trained before."""
    tr = pattern_trace(300)
    GaussianDiffusion(GaussianDiffusionConfig(**{**TINY, "steps": 3})).fit([tr], checkpoint_dir=tmp_path / "a")
    cfg = GaussianDiffusionConfig(**{**TINY, "steps": 3, "d_model": 16})
    GaussianDiffusion(cfg).fit([tr], checkpoint_dir=tmp_path / "b")
    meta = json.loads((tmp_path / "a" / "config.json").read_text())
    del meta["sha256"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(meta))
    good = (tmp_path / "a" / "optimizer.safetensors").read_bytes()
    (tmp_path / "a" / "optimizer.safetensors").write_bytes((tmp_path / "b" / "optimizer.safetensors").read_bytes())
    with pytest.raises(TraceSynthError, match=r"a/optimizer.safetensors: tensor state\.\d+\.exp_avg has shape"):
        GaussianDiffusion.load(tmp_path / "a")
    (tmp_path / "a" / "optimizer.safetensors").write_bytes(good)
    again = GaussianDiffusion.load(tmp_path / "a")
    again.history["train_seconds"] = 1000.0  # as if the first run had trained that long
    again.config.steps, again.config.time_limit = 10, 500.0
    again.fit([tr])
    assert again.step == 3 and again.history["train_seconds"] >= 1000.0
    with pytest.raises(TraceSynthError, match="no training window"):
        GaussianDiffusion(GaussianDiffusionConfig(**{**TINY, "context": 512})).fit([pattern_trace(100)])
    with pytest.raises(TraceSynthError, match="not fitted"):
        GaussianDiffusion().sample(5)
    with pytest.raises(TraceSynthError, match="channels"):
        GaussianDiffusionConfig(channels=3)


def test_cli_fit_and_sample(tmp_path: Path) -> None:
    from tracesynth.cli import app

    pattern_trace(300).save(tmp_path / "real.parquet")
    runner = CliRunner()
    args = ["fit", str(tmp_path / "real.parquet"), "-o", str(tmp_path / "m"), "--kind", "diffusion", "--context", "32"]
    args += ["--steps", "3"]
    res = runner.invoke(app, args + ["--d-model", "32", "--layers", "1", "--channels", "2"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sample", str(tmp_path / "m"), "--events", "50", "-o", str(tmp_path / "s.parquet")])
    assert res.exit_code == 0, res.output
    assert len(Trace.load(tmp_path / "s.parquet")) == 50
    res = runner.invoke(app, ["sample", str(tmp_path / "nope"), "--events", "5", "-o", str(tmp_path / "x.parquet")])
    assert isinstance(res.exception, TraceSynthError) and not (tmp_path / "x.parquet").exists()


def test_cli_sample_with_repair_rules(fitted: GaussianDiffusion, tmp_path: Path) -> None:
    from tracesynth import constraints
    from tracesynth.cli import app

    constraints.mine_rules([pattern_trace()]).save(tmp_path / "rules.json")
    fitted.save(tmp_path / "m")
    args = ["sample", str(tmp_path / "m"), "--events", "64", "-o", str(tmp_path / "s.parquet"), "--seed", "2"]
    res = CliRunner().invoke(app, args + ["--repair", str(tmp_path / "rules.json")])
    assert res.exit_code == 0, res.output
    assert re.search(r"repair: violations \d+ -> 0", res.output), res.output
    fixed = Trace.load(tmp_path / "s.parquet")
    assert constraints.check_trace(fixed, constraints.Rules.load(tmp_path / "rules.json")).total == 0


def test_registry_loads_the_diffusion_model(fitted: GaussianDiffusion, tmp_path: Path) -> None:
    from tracesynth.generators import KINDS, load_generator, saved_kind

    fitted.save(tmp_path / "m")
    assert saved_kind(tmp_path / "m") is KINDS["diffusion"]
    back = load_generator(tmp_path / "m")
    assert isinstance(back, GaussianDiffusion) and back.sample(40, seed=2) == fitted.sample(40, seed=2)
    assert back.n_params == sum(p.numel() for p in fitted.model.parameters()) > 0
    assert back.fit_info["train_steps"] == fitted.step and back.fit_info["train_windows"] > 0
