"""Fidelity / privacy metrics on tiny traces built in code, with known answers."""

from __future__ import annotations

import math

import numpy as np

from tracesynth.evaluate import metrics
from tracesynth.trace import Trace


def trace(events: list[str], dt: int | list[int] = 10, tid: list[int] | None = None) -> Trace:
    gaps = np.full(len(events), dt) if isinstance(dt, int) else np.asarray(dt)
    return Trace.from_columns(ts=np.cumsum(gaps), event=events, tid=tid)


def test_jsd_identical_zero_disjoint_one() -> None:
    assert metrics.jsd(np.array([1, 2, 3]), np.array([2, 4, 6])) == 0.0
    assert math.isclose(metrics.jsd(np.array([1, 0]), np.array([0, 1])), 1.0)
    a = trace(["a", "b"] * 50)
    assert metrics.ngram_jsd(a, a, 1) == 0.0 and metrics.ngram_jsd(a, a, 3) == 0.0
    assert math.isclose(metrics.ngram_jsd(a, trace(["c", "d"] * 50), 1), 1.0)


def test_ngram_jsd_sees_order_that_unigrams_miss() -> None:
    a = trace(["a", "b"] * 100)
    b = trace(["a"] * 100 + ["b"] * 100)  # same event counts, different order
    assert metrics.ngram_jsd(a, b, 1) == 0.0
    assert metrics.ngram_jsd(a, b, 2) > 0.3


def test_ngram_jsd_terms_name_the_ngrams_that_carry_it() -> None:
    real = trace(["a", "b", "c"] * 100)
    synth = trace(["a", "b", "c"] * 80 + ["a"] * 60)  # a run of "a" that real data never has
    terms = metrics.ngram_jsd_terms(real, synth, 3, top=100)
    assert terms[0]["ngram"] == ["a", "a", "a"] and terms[0]["real"] == 0.0 and terms[0]["synth"] > 0.15
    assert math.isclose(sum(t["bits"] for t in terms), metrics.ngram_jsd(real, synth, 3))
    assert [t["bits"] for t in terms] == sorted((t["bits"] for t in terms), reverse=True)
    assert metrics.ngram_jsd_terms(real, real, 3, top=2)[0]["bits"] == 0.0


def test_pieces_ngram_jsd_is_high_for_few_pieces_of_a_trace_with_long_phases() -> None:
    """Real data cut into a sampler's chains: two pieces of a two-phase trace often miss a phase, many pieces
    cover both in about their proportions; a trace without phases scores about 0 either way."""
    phases = trace(["a", "b"] * 2000 + ["c", "d", "e"] * 1000)
    rng = np.random.default_rng(0)
    few = [metrics.pieces_ngram_jsd(phases, 2, 500, 3, rng) for _ in range(20)]
    many = [metrics.pieces_ngram_jsd(phases, 100, 40, 3, rng) for _ in range(20)]
    assert max(few) > 0.3 and np.mean(few) > 4 * np.mean(many), (few, many)
    steady = trace(["a", "b", "c"] * 2000)
    assert metrics.pieces_ngram_jsd(steady, 2, 500, 3, rng) < 0.01


def test_dt_wasserstein() -> None:
    ev = ["a", "b"] * 100
    assert metrics.dt_wasserstein(trace(ev, 10), trace(ev, 10))["mean"] == 0.0
    # a tenfold gap shift is ~1 in log10 units
    d = metrics.dt_wasserstein(trace(ev, 999), trace(ev, 9999))["mean"]
    assert 0.95 < d < 1.05


def test_syscall_latencies_pair_entry_and_exit_on_the_same_thread() -> None:
    ev = ["syscall_entry_read", "syscall_entry_read", "syscall_exit_read", "syscall_exit_read", "sched_switch"]
    t = Trace.from_columns(ts=[0, 5, 100, 305, 400], event=ev, tid=[1, 2, 1, 2, 1])
    lat = metrics.syscall_latencies(t)
    assert sorted(lat["read"].tolist()) == [100, 300]


def test_memorisation() -> None:
    train = np.array([5, 1, 2, 3, 4, 9, 9, 7, 7])
    assert metrics.longest_shared_run(np.array([0, 1, 2, 3, 4, 0]), train) == 4
    assert metrics.longest_shared_run(np.array([11, 12]), train) == 0
    rng = np.random.default_rng(0)
    tr = rng.integers(0, 50, 5000)
    assert metrics.copied_window_share(tr[1000:2000], tr, 32) == 1.0  # a copy of training data
    assert metrics.copied_window_share(rng.integers(0, 50, 1000), tr, 32) == 0.0
    # within one trace: a repeated stretch is found elsewhere, a unique one is not, and the slice is not
    # matched against itself
    loop = np.tile(np.arange(3), 400)
    assert metrics.copied_within(np.concatenate([loop, loop]), 1000, 200, 32) == 1.0
    assert metrics.copied_within(tr, 1000, 1000, 32) == 0.0
    m = metrics.memorisation(trace(["a", "b", "c"] * 20), trace(["a", "b", "c"] * 30), window=8)
    assert m["copied_window_share"] == 1.0 and m["longest_shared_run"] == 60


def test_fidelity_keys_and_zero_on_self() -> None:
    t = trace(["syscall_entry_read", "syscall_exit_read", "x"] * 40, dt=[3, 50, 7] * 40, tid=[1] * 120)
    f = metrics.fidelity(t, t)
    assert set(f) == {"jsd_event", "jsd_2gram", "jsd_3gram", "dt_wasserstein", "latency_wasserstein"}
    assert all(v == 0.0 for v in f.values())
