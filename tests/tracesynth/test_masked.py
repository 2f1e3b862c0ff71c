"""Masked discrete diffusion: training lowers the loss, sampling is seeded and chained, save/load is exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tracesynth.errors import TraceSynthError
from tracesynth.generators.masked import MaskedConfig, MaskedDiffusion
from tracesynth.generators.tokens import N_DT, dt_bucket
from tracesynth.io import read_trace

REPO = Path(__file__).resolve().parents[2]
TINY = dict(context=32, d_model=32, n_layers=1, n_heads=2, batch_size=8, sample_steps=4, overlap=8, chains=2)


@pytest.fixture(scope="module")
def real():
    return read_trace(REPO / "data" / "sqlite.parquet").slice(20000, 24000)


@pytest.fixture(scope="module")
def fitted(real):
    torch.set_num_threads(1)
    return MaskedDiffusion(MaskedConfig(**TINY, steps=40)).fit([real])


def test_dt_buckets_are_monotone_and_bounded() -> None:
    g = np.array([0, 1, 2, 3, 1000, 10**6, 10**12, 2**62])
    b = dt_bucket(g)
    assert b[0] == 0 and (np.diff(b) >= 0).all() and b.max() <= N_DT - 1
    assert dt_bucket(np.array([1000]))[0] != dt_bucket(np.array([2000]))[0]  # a factor of two moves the bucket


def test_training_lowers_the_masked_loss(real) -> None:
    torch.manual_seed(0)
    short = MaskedDiffusion(MaskedConfig(**TINY, steps=1)).fit([real])
    longer = MaskedDiffusion(MaskedConfig(**TINY, steps=80)).fit([real])
    data = {c: torch.from_numpy(v[:64]) for c, v in longer.windows([real]).items()}
    torch.manual_seed(1)
    with torch.no_grad():
        before = float(short.loss(data))
        torch.manual_seed(1)
        after = float(longer.loss(data))
    assert after < before - 0.3, (before, after)


def test_sample_is_seeded_long_and_decodes_real_gaps(fitted, real) -> None:
    a = fitted.sample(300, seed=3)
    assert len(a) == 300 and a == fitted.sample(300, seed=3) and a != fitted.sample(300, seed=4)
    assert (np.diff(a.ts) >= 0).all()
    # a gap bucket seen with an event type decodes to one of the training block's own gaps for it
    ev = fitted.codec.encode(real)["event"]
    gaps = np.concatenate([[0], np.diff(real.ts)])
    drawn = fitted.decode_gaps(ev, dt_bucket(gaps), np.random.default_rng(0))
    assert np.isin(drawn, gaps).all() and (dt_bucket(drawn) == dt_bucket(gaps)).all()
    # an unseen cell draws inside its bucket
    lone = fitted.decode_gaps(np.array([0]), np.array([N_DT - 2]), np.random.default_rng(0))
    assert dt_bucket(lone)[0] == N_DT - 2
    assert set(a.table["event"].to_pylist()) <= set(real.table["event"].to_pylist())


def test_windows_are_chained_on_their_overlap(fitted) -> None:
    """Each new window is conditioned on the last `overlap` events: they are kept, not resampled."""
    cfg = fitted.config
    gen = torch.Generator().manual_seed(0)
    tokens = {c: torch.zeros(1, cfg.context, dtype=torch.long) for c in fitted.vocab}
    known = torch.zeros(1, cfg.context, dtype=torch.bool)
    fitted._fill(tokens, known, gen)
    first = {c: v.clone() for c, v in tokens.items()}
    known[:, :8] = True
    for c in tokens:
        tokens[c][:, 8:] = 0
    fitted._fill(tokens, known, gen)
    for c in tokens:
        assert torch.equal(tokens[c][:, :8], first[c][:, :8])
        assert (tokens[c] < fitted.vocab[c]).all()  # nothing left masked


def test_save_load_roundtrip_and_bad_models(fitted, tmp_path: Path) -> None:
    fitted.save(tmp_path / "m")
    back = MaskedDiffusion.load(tmp_path / "m")
    assert back.sample(200, seed=1) == fitted.sample(200, seed=1)
    cfg = tmp_path / "m" / "config.json"
    meta = json.loads(cfg.read_text())
    for bad in ([], None, {**meta, "format": "x"}, {**meta, "config": {**meta["config"], "n_heads": 0}}):
        cfg.write_text(json.dumps(bad))
        with pytest.raises(TraceSynthError, match=str(tmp_path / "m")):
            MaskedDiffusion.load(tmp_path / "m")
    with pytest.raises(TraceSynthError):
        MaskedDiffusion.load(tmp_path / "nowhere")


def test_bad_config_and_short_traces_are_clear_errors(real) -> None:
    with pytest.raises(TraceSynthError, match="overlap"):
        MaskedConfig(context=32, overlap=32)
    with pytest.raises(TraceSynthError, match="context"):
        MaskedDiffusion(MaskedConfig(**{**TINY, "context": 64})).fit([real.slice(0, 50)])


def test_left_unmasking_reveals_the_earliest_events_first(fitted) -> None:
    """unmask="left" with one step per event: before step s exactly the events < s are revealed."""
    import dataclasses

    L = fitted.config.context
    left = MaskedDiffusion(dataclasses.replace(fitted.config, unmask="left", sample_steps=L))
    left.codec, left.model, left.seen = fitted.codec, fitted.model, fitted.seen
    seen_masks = []

    def spy(tokens):
        seen_masks.append((tokens["event"] == left.vocab["event"])[0].clone())
        return fitted.model(tokens)

    left.model = spy
    tokens = {c: torch.zeros(1, L, dtype=torch.long) for c in fitted.vocab}
    left._fill(tokens, torch.zeros(1, L, dtype=torch.bool), torch.Generator().manual_seed(0))
    for s, m in enumerate(seen_masks):
        assert torch.equal(m, torch.arange(L) >= s), s
