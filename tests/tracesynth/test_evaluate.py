"""Evaluation harness: time splits leak nothing, the tasks score what they should on tiny data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracesynth.errors import TraceSynthError
from tracesynth.evaluate.classifier import ClassifierConfig
from tracesynth.evaluate.tasks import (
    discriminator_auc,
    interleaved_roles,
    next_event_scores,
    same_phase_discriminator,
    workload_id_scores,
)
from tracesynth.evaluate.windows import Vocab, dedup, make_windows, split_trace, window_hashes
from tracesynth.trace import Trace

CFG = ClassifierConfig(embed=8, hidden=16, steps=60, batch=32, lr=1e-2)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rand_trace(n: int, names: list[str], seed: int, dt: int = 100) -> Trace:
    rng = np.random.default_rng(seed)
    ev = rng.choice(names, n)
    return Trace.from_columns(ts=np.cumsum(rng.integers(1, dt, n)), event=ev.tolist())


def test_split_windows_never_overlap_test_block() -> None:
    n = 3000
    t = Trace.from_columns(ts=np.arange(n) * 10, event=[f"e{i}" for i in range(n)])  # every event unique
    sp = split_trace(t)
    assert len(sp.train) + len(sp.val) + len(sp.test) == n
    assert sp.train.ts[-1] < sp.val.ts[0] <= sp.val.ts[-1] < sp.test.ts[0]
    v = Vocab.from_traces([sp.train, sp.test])
    tr, te = make_windows(sp.train, v, 16), make_windows(sp.test, v, 16)
    train_events = set(tr.events.ravel().tolist()) | set(tr.labels.tolist())
    test_events = set(te.events.ravel().tolist()) | set(te.labels.tolist())
    assert not train_events & test_events  # no test event (so no overlap of a test window) reaches training


def test_dedup_drops_repeats_and_test_copies() -> None:
    t = Trace.from_columns(ts=np.arange(400), event=["a", "b", "c", "d"] * 100)
    v = Vocab.from_traces([t])
    w = make_windows(t, v, 8)
    d = dedup(w)
    assert len(d) == 4  # a 4-cycle has 4 distinct windows
    assert len(dedup(w, exclude=d.take(np.arange(2)))) == 2
    assert len(np.unique(window_hashes(d))) == len(d)


def test_vocab_maps_unseen_to_unk() -> None:
    v = Vocab(["a", "b"])
    assert v.encode(Trace.from_columns(ts=[0, 1, 2], event=["a", "z", "b"])).tolist() == [1, 0, 2]


def test_next_event_learns_a_cycle() -> None:
    t = Trace.from_columns(ts=np.arange(600), event=["a", "b", "c", "d", "e"] * 120)
    sp = split_trace(t)
    v = Vocab.from_traces([sp.train])
    cfg = ClassifierConfig(embed=8, hidden=16, steps=30, batch=32, lr=3e-2)
    s = next_event_scores(make_windows(sp.train, v, 8), make_windows(sp.test, v, 8), len(v), cfg, seed=0)
    assert s["accuracy"] > 0.95 and s["macro_f1"] > 0.95


def test_discriminator_auc_same_vs_different() -> None:
    names = [f"e{i}" for i in range(6)]
    v = Vocab(names + ["z0", "z1"])
    a = make_windows(rand_trace(1500, names, 1), v, 16, stride=4)
    b = make_windows(rand_trace(1500, names, 2), v, 16, stride=4)
    c = make_windows(rand_trace(1500, ["z0", "z1"], 3, dt=10**6), v, 16, stride=4)
    same = discriminator_auc(a, b, len(v), CFG, seed=0)
    diff = discriminator_auc(a, c, len(v), CFG, seed=0)
    assert 0.35 < same < 0.65
    assert diff > 0.95


def test_interleaved_roles_disjoint_spread_and_gapped() -> None:
    ctx, n = 16, 5000
    roles = interleaved_roles(n, 4 * ctx, ctx, 4, seed=3)
    allidx = np.concatenate(roles)
    assert len(np.unique(allidx)) == len(allidx) and allidx.max() < n
    for r in roles:  # every role spans the whole period, not one end of it
        assert r.min() < n // 4 and r.max() > 3 * n // 4
    # windows of different roles (window i covers events i..i+ctx, label included) share no event
    owner = np.full(n, -1)
    for k, r in enumerate(roles):
        owner[r] = k
    for k, r in enumerate(roles):
        near = (r[:, None] + np.arange(-ctx, ctx + 1)[None, :]).ravel()
        near = near[(near >= 0) & (near < n)]
        assert set(owner[near].tolist()) <= {k, -1}
    with pytest.raises(TraceSynthError):
        interleaved_roles(n, ctx, ctx, 2)


def phase_trace(n: int, seed: int) -> Trace:
    """A trace that changes phase half-way: different event types and pace before and after."""
    rng = np.random.default_rng(seed)
    h = n // 2
    ev = np.concatenate([rng.choice(["e0", "e1", "e2"], h), rng.choice(["e3", "e4", "e5"], n - h)])
    dt = np.concatenate([rng.integers(1, 100, h), rng.integers(1, 10_000, n - h)])
    return Trace.from_columns(ts=np.cumsum(dt), event=ev.tolist())


def test_same_phase_reference_is_near_half_where_contiguous_blocks_are_not() -> None:
    ctx = 16
    names = [f"e{i}" for i in range(6)]
    v = Vocab(names + ["z0", "z1"])
    real = make_windows(phase_trace(6000, 1), v, ctx)
    # the old protocol: a later real block against an earlier one of the same trace tells phases apart
    assert discriminator_auc(real.take(np.arange(3000, 6000 - ctx)), real.take(np.arange(3000)), len(v), CFG) > 0.9
    stationary = make_windows(rand_trace(6000, names, 7), v, ctx)  # a phase-less mix, wrong pace
    alien = make_windows(rand_trace(6000, ["z0", "z1"], 3, dt=10**6), v, ctx)  # nothing like the real trace
    res = same_phase_discriminator(
        real, {"stationary": stationary, "alien": alien}, len(v), CFG, seed=0, gap=ctx, max_windows=800
    )
    assert 0.35 < res["reference"] < 0.65  # two real samples of the same phase mix: indistinguishable
    assert res["alien"] > 0.95
    assert res["windows_fit"] == 400 and res["windows_score"] == 400


def test_same_phase_discriminator_stationary_sample_scores_like_real() -> None:
    names = [f"e{i}" for i in range(6)]
    v = Vocab(names)
    real = make_windows(rand_trace(5000, names, 1), v, 16)
    twin = make_windows(rand_trace(5000, names, 2), v, 16)  # the same stationary process
    cache: dict = {}
    res = same_phase_discriminator(real, {"twin": twin}, len(v), CFG, seed=0, gap=16, max_windows=800, ref_cache=cache)
    assert 0.35 < res["reference"] < 0.65 and 0.35 < res["twin"] < 0.65
    assert len(cache) == 1
    again = same_phase_discriminator(
        real, {"twin": twin}, len(v), CFG, seed=0, gap=16, max_windows=800, ref_cache=cache
    )
    assert again["reference"] == res["reference"]
    with pytest.raises(TraceSynthError, match="too few windows"):
        same_phase_discriminator(real, {"short": twin.take(np.arange(40))}, len(v), CFG, gap=16)


def test_workload_id() -> None:
    v = Vocab(["a", "b", "c", "d"])
    x = {
        "ab": make_windows(rand_trace(600, ["a", "b"], 1), v, 8, 2),
        "cd": make_windows(rand_trace(600, ["c", "d"], 2), v, 8, 2),
    }
    y = {
        "ab": make_windows(rand_trace(300, ["a", "b"], 3), v, 8),
        "cd": make_windows(rand_trace(300, ["c", "d"], 4), v, 8),
    }
    s = workload_id_scores(x, y, len(v), CFG, seed=0)
    assert s["accuracy"] > 0.95
    with pytest.raises(TraceSynthError):
        workload_id_scores({"ab": x["ab"]}, {"ab": y["ab"]}, len(v), CFG)


def test_split_rejects_tiny_trace() -> None:
    with pytest.raises(TraceSynthError):
        split_trace(Trace.from_columns(ts=[0, 1], event=["a", "b"]))
