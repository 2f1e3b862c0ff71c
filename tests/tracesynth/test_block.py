"""Block diffusion (issue 45): the cached sampling pass is the training pass, blocks are causal, a tiny model
fits, saves, loads, samples N events within the kernel invariants when guided, resumes to the weights of an
unkilled fit, starts from the AR checkpoint with a lower first loss than random weights, and the registry and the
CLI know it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tracesynth.cli import app
from tracesynth.constraints import check_trace, mine_rules
from tracesynth.errors import TraceSynthError
from tracesynth.generators import get_kind, load_generator, make_generator
from tracesynth.generators.ar import ARConfig, Autoregressive
from tracesynth.generators.block import BlockConfig, BlockDiffusion
from tracesynth.generators.masked import MaskedConfig, MaskedDiffusion
from tracesynth.io import read_trace

REPO = Path(__file__).resolve().parents[2]
KERNEL = ("sched.consistency", "sched.one_cpu", "syscall.pairing", "time.monotonic", "ret.errno")
TINY = dict(context=32, d_model=32, n_layers=2, n_heads=2, batch_size=8, overlap=8, chains=2, block=8,
            block_steps=4, warmup=5)


@pytest.fixture(scope="module")
def real():
    torch.set_num_threads(1)
    return read_trace(REPO / "data" / "scimark2.parquet").slice(20000, 23000)


@pytest.fixture(scope="module")
def fitted(real):
    return BlockDiffusion(BlockConfig(**TINY, steps=30)).fit([real])


def _windows(gen, real, n: int = 3) -> dict[str, torch.Tensor]:
    return {c: torch.from_numpy(v[:n]) for c, v in gen.windows([real]).items()}


def test_the_cached_pass_of_a_block_is_the_training_pass(fitted, real) -> None:
    net, clean = fitted.model, _windows(fitted, real)
    noisy = {c: v.clone() for c, v in clean.items()}
    for c in fitted.vocab:
        noisy[c][:, 19:24] = fitted.vocab[c]  # block 2 (events 16..23): its last five events masked
    with torch.no_grad():
        full = net.denoise(noisy, clean)
        cache = net.new_cache(3, 32)
        cached = net.run(noisy, 0, 24, cache)[:, 16:]  # blocks 0, 1 clean, block 2 as the sampler has it
        again = net.run(noisy, 16, 24, cache)  # a later pass of the same block: the cache alone before it
    torch.testing.assert_close(cached, full[:, 16:24], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(again, cached, atol=1e-5, rtol=1e-4)
    # blocks are causal: changing events 24.. (inputs of positions 25.., block 3) changes no hidden state before
    later = {c: v.clone() for c, v in clean.items()}
    later["event"][:, 24:] = (later["event"][:, 24:] + 1) % fitted.vocab["event"]
    with torch.no_grad():
        assert torch.equal(net.denoise(later, later)[:, :24], net.denoise(clean, clean)[:, :24])


@pytest.mark.parametrize("passes", [1, 4])  # 1: the next block's first pass computes the finished one's cache
def test_the_cached_sampler_draws_what_recomputing_every_pass_draws(fitted, passes: int, monkeypatch) -> None:
    monkeypatch.setattr(fitted.config, "block_steps", passes)
    cached = fitted.sample(200, seed=5)
    run = fitted.model.run

    def recompute(tokens, start, end, cache):  # every pass from position 0 on a fresh cache
        return run(tokens, 0, end, fitted.model.new_cache(cache[0][0].shape[0], cache[0][0].shape[2]))[:, start:]

    monkeypatch.setattr(fitted.model, "run", recompute)
    assert fitted.sample(200, seed=5) == cached


def test_sample_has_n_events_is_seeded_and_survives_save_load(fitted, real, tmp_path: Path) -> None:
    a = fitted.sample(300, seed=3, guide="none")
    assert len(a) == 300 and a == fitted.sample(300, seed=3, guide="none") and a != fitted.sample(300, seed=4)
    assert set(a.table["event"].to_pylist()) <= set(real.table["event"].to_pylist())
    fitted.save(tmp_path / "m")
    back = load_generator(tmp_path / "m")
    assert isinstance(back, BlockDiffusion) and back.config == fitted.config
    assert back.sample(200, seed=1) == fitted.sample(200, seed=1)


def test_guided_samples_keep_the_kernel_invariants(fitted, real) -> None:
    rules = mine_rules([real])
    for seed in range(2):
        guided = fitted.sample(400, seed=seed)  # guide="kernel" is the config's default
        rep = check_trace(guided, rules)
        assert len(guided) == 400 and guided.metadata["guide"] == "kernel"
        assert {r: rep.counts[r] for r in KERNEL} == dict.fromkeys(KERNEL, 0), seed
    plain = check_trace(fitted.sample(400, seed=0, guide="none"), rules)
    assert plain.counts["syscall.pairing"] > 0  # the same network unguided breaks them


def test_a_killed_fit_resumes_to_the_weights_of_an_unkilled_one(real, tmp_path: Path) -> None:
    small = {**TINY, "context": 16, "d_model": 16, "n_layers": 1, "batch_size": 4, "overlap": 4}
    full = BlockDiffusion(BlockConfig(**small, steps=20)).fit([real])

    def kill(step: int, loss: float) -> None:
        if step == 15:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        BlockDiffusion(BlockConfig(**small, steps=20)).fit([real], progress=kill, checkpoint_dir=tmp_path / "m",
                                                           checkpoint_every=10)
    back = BlockDiffusion.load(tmp_path / "m")
    assert back.history["steps"] == 10
    back.fit([real], resume=True)
    assert back.history["steps"] == 20 and back.history["final_loss"] == pytest.approx(full.history["final_loss"])
    for (name, a), b in zip(full.model.state_dict().items(), back.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, msg=name)


def test_a_start_from_the_ar_checkpoint_has_a_lower_first_loss(real) -> None:
    init = load_generator(REPO / "models" / "all")

    def first_loss(start) -> float:
        gen = BlockDiffusion(BlockConfig(steps=0, batch_size=4)).fit([real.slice(0, 1000)], init=start)
        torch.manual_seed(0)  # the same mask rates and masks for both
        with torch.no_grad():
            return float(gen.loss(_windows(gen, real.slice(0, 1000), 4)))

    warm, cold = first_loss(init), first_loss(None)
    assert warm < cold - 0.5, (warm, cold)


def test_init_takes_an_ar_or_block_model_of_the_same_size(fitted, real) -> None:
    ar = Autoregressive(ARConfig(**{k: v for k, v in TINY.items() if k not in ("block", "block_steps")},
                                 steps=2)).fit([real])
    BlockDiffusion(BlockConfig(**TINY, steps=2)).fit([real], init=ar)
    BlockDiffusion(BlockConfig(**TINY, steps=2)).fit([real], init=fitted)
    masked = MaskedDiffusion(MaskedConfig(context=32, d_model=32, n_heads=2, steps=1, batch_size=2)).fit([real])
    with pytest.raises(TraceSynthError, match="only start from a fitted ar or block model"):
        BlockDiffusion(BlockConfig(**TINY, steps=2)).fit([real], init=masked)
    with pytest.raises(TraceSynthError, match="d_model 16 vs 32"):
        BlockDiffusion(BlockConfig(**{**TINY, "d_model": 16}, steps=2)).fit([real], init=ar)


@pytest.mark.parametrize("bad", [{"block": 3}, {"block": 128, "context": 256}, {"context": 36},
                                 {"block_steps": 9}, {"mask_low": 0.9, "mask_high": 0.5}, {"guide": "x"}])
def test_bad_config_is_one_line(bad: dict) -> None:
    with pytest.raises(TraceSynthError) as err:
        BlockConfig(**{"context": 32, "block": 8, **bad})
    assert "\n" not in str(err.value) and str(err.value).startswith("block diffusion config: need")


def test_registry_and_cli_fit_and_sample(real, tmp_path: Path) -> None:
    gen = make_generator({"kind": "block", "config": {"block": 4}})
    assert isinstance(gen, BlockDiffusion) and gen.config.block == 4 and gen.config.context == 256
    assert isinstance(make_generator(get_kind("block").config({"block": 8})), BlockDiffusion)
    data = tmp_path / "t.parquet"
    real.save(data)
    out = tmp_path / "m"
    opts = ["--context", "32", "--d-model", "16", "--layers", "1", "--batch-size", "2", "--steps", "3"]
    res = CliRunner().invoke(app, ["fit", str(data), "-o", str(out), "--kind", "block", *opts])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["sample", str(out), "--events", "50", "-o", str(tmp_path / "s.parquet")])
    assert res.exit_code == 0, res.output
    assert len(read_trace(tmp_path / "s.parquet")) == 50
