"""Autoregressive transformer: the KV cache matches the full causal pass, training lowers the loss,
sampling is seeded and chained, save/load is exact, the registry and CLI know it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracesynth.errors import TraceSynthError
from tracesynth.generators import load_generator, make_generator
from tracesynth.generators.ar import ORDER, ARConfig, Autoregressive
from tracesynth.io import read_trace

REPO = Path(__file__).resolve().parents[2]
TINY = dict(context=32, d_model=32, n_layers=2, n_heads=2, batch_size=8, overlap=8, chains=2)


@pytest.fixture(scope="module")
def real():
    return read_trace(REPO / "data" / "sqlite.parquet").slice(20000, 24000)


@pytest.fixture(scope="module")
def fitted(real):
    torch.set_num_threads(1)
    return Autoregressive(ARConfig(**TINY, steps=40)).fit([real])


def test_kv_cache_matches_the_full_causal_pass(fitted, real) -> None:
    net = fitted.model
    data = {c: torch.from_numpy(v[:3]) for c, v in fitted.windows([real]).items()}
    with torch.no_grad():
        full = net.hidden(data)
        x = net.embed_tokens(data)
        x = torch.cat([net.bos.expand(3, 1, -1), x[:, :-1]], dim=1)
        cache = net.new_cache(3, 32)
        steps = [net.step(x[:, :10], 0, cache)] + [net.step(x[:, j : j + 1], j, cache) for j in range(10, 32)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    # causal: changing the last event changes no hidden state (h[:, p] sees events < p only)
    later = {c: v.clone() for c, v in data.items()}
    later["event"][:, -1] = (later["event"][:, -1] + 1) % fitted.vocab["event"]
    with torch.no_grad():
        assert torch.equal(net.hidden(later), full)


def test_a_channel_head_sees_the_channels_drawn_before_it(fitted, real) -> None:
    net = fitted.model
    h = torch.zeros(2, 32)
    given = {c: torch.tensor([1, 2]) for c in ORDER}
    other = {**given, "cpu": torch.tensor([0, 0])}
    assert ORDER[:3] == ("cpu", "tid", "event")  # the kernel's order: the guide masks tid by CPU, event by tid
    with torch.no_grad():
        assert not torch.allclose(net.head(h, 1, given), net.head(h, 1, other))  # tid given the CPU
        assert torch.equal(net.head(h, 0, given), net.head(h, 0, other))  # the CPU is drawn first


def test_training_lowers_the_loss(real) -> None:
    torch.manual_seed(0)
    short = Autoregressive(ARConfig(**TINY, steps=1)).fit([real])
    longer = Autoregressive(ARConfig(**TINY, steps=80)).fit([real])
    data = {c: torch.from_numpy(v[:64]) for c, v in longer.windows([real]).items()}
    with torch.no_grad():
        before, after = float(short.loss(data)), float(longer.loss(data))
    assert after < before - 0.3, (before, after)
    assert longer.fit_info["train_steps"] == 80 and longer.fit_info["train_events_per_s"] > 0


def test_sample_is_seeded_chained_and_in_vocabulary(fitted, real) -> None:
    a = fitted.sample(300, seed=3)  # 2 chains of 150 events: windows of 32 chained on 8
    assert len(a) == 300 and a == fitted.sample(300, seed=3) and a != fitted.sample(300, seed=4)
    assert set(a.table["event"].to_pylist()) <= set(real.table["event"].to_pylist())
    tokens = {c: torch.zeros(1, 32, dtype=torch.long) for c in fitted.vocab}
    known = torch.zeros(1, 32, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    fitted._fill(tokens, known, gen, None)
    first = {c: v.clone() for c, v in tokens.items()}
    known[:, :8] = True
    for c in tokens:
        tokens[c][:, 8:] = 0
    fitted._fill(tokens, known, gen, None)
    for c in tokens:
        assert torch.equal(tokens[c][:, :8], first[c][:, :8])  # the known prefix is kept
        assert (tokens[c] < fitted.vocab[c]).all()


def test_save_load_roundtrip_through_the_registry(fitted, tmp_path: Path) -> None:
    fitted.save(tmp_path / "m")
    back = load_generator(tmp_path / "m")
    assert isinstance(back, Autoregressive) and back.sample(200, seed=1) == fitted.sample(200, seed=1)
    (tmp_path / "m" / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(TraceSynthError, match="model.safetensors: sha256 mismatch"):
        Autoregressive.load(tmp_path / "m")
    gen = make_generator({"kind": "ar", "config": {"context": 64, "d_model": 32, "n_heads": 2}})
    assert isinstance(gen, Autoregressive) and gen.config.overlap == 16
    with pytest.raises(TraceSynthError, match="autoregressive model config"):
        make_generator({"kind": "ar", "config": {"sample_steps": 3}})


def test_two_channels_learn_event_and_gap_alone(real) -> None:
    """The paper's ablation: with channels=2 the network sees event and gap only; a sample has no cpu, thread,
    command or return value, and the kernel guide (which reads cpu and thread) is refused."""
    two = Autoregressive(ARConfig(**TINY, steps=5, channels=2)).fit([real])
    assert two.config.guide == "none" and ARConfig(**TINY).guide == "kernel"
    s = two.sample(200, seed=0)
    assert len(s) == 200 and set(s.table["event"].to_pylist()) <= set(real.table["event"].to_pylist())
    for col in ("cpu", "tid", "comm", "ret"):
        assert s.table[col].null_count == len(s), col
    with pytest.raises(TraceSynthError, match="no guide 'kernel'"):
        two.sample(100, guide="kernel")
    with pytest.raises(TraceSynthError, match="kernel guide only with channels=6"):
        ARConfig(**TINY, channels=2, guide="kernel")
    with pytest.raises(TraceSynthError, match="channels 2 or 6"):
        ARConfig(**TINY, channels=3)
