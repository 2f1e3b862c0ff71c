"""Order-k Markov baseline: reproduces what it saw, round-trips through save/load, never leaks thread ids,
and with guide="kernel" keeps the kernel invariants."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tracesynth.constraints import check_trace, mine_rules
from tracesynth.errors import TraceSynthError
from tracesynth.generators import Generator
from tracesynth.generators.markov import MarkovChain
from tracesynth.trace import Trace


def cycle_trace(n: int = 400, names: tuple[str, ...] = ("a", "b", "c", "d")) -> Trace:
    ev = [names[i % len(names)] for i in range(n)]
    dt = np.asarray([10, 20, 30, 40] * (n // 4 + 1))[:n]
    ret = [0 if e == "b" else None for e in ev]
    return Trace.from_columns(
        ts=np.cumsum(dt),
        event=ev,
        cpu=[i % 2 for i in range(n)],
        tid=[7000 + i % 2 for i in range(n)],
        comm=["w"] * n,
        ret=ret,
    )


def test_order1_reproduces_deterministic_cycle() -> None:
    m = MarkovChain(order=1).fit([cycle_trace()])
    s = m.sample(200, seed=3)
    ev = s.column("event").to_pylist()
    order = ["a", "b", "c", "d"]
    # every transition is the cycle's: a->b->c->d->a
    assert all(order[(order.index(x) + 1) % 4] == y for x, y in zip(ev, ev[1:], strict=False))
    # dt per transition is the only one seen for it (gap before b is always 20 ns, ...)
    dt = np.diff(s.ts)
    nxt = np.asarray(ev[1:])
    assert set(dt[nxt == "b"]) == {20} and set(dt[nxt == "a"]) == {10}
    assert isinstance(m, Generator)


def test_higher_order_disambiguates_context() -> None:
    # "a x b" and "c x d": order 1 cannot know what follows x, order 2 can
    ev = ["a", "x", "b", "c", "x", "d"] * 100
    t = Trace.from_columns(ts=np.arange(len(ev)) * 5, event=ev)
    s2 = MarkovChain(order=2).fit([t]).sample(600, seed=0).column("event").to_pylist()
    pairs = {(s2[i], s2[i + 2]) for i in range(len(s2) - 2) if s2[i + 1] == "x"}
    assert pairs <= {("a", "b"), ("c", "d")}
    s1 = MarkovChain(order=1).fit([t]).sample(600, seed=0).column("event").to_pylist()
    pairs1 = {(s1[i], s1[i + 2]) for i in range(len(s1) - 2) if s1[i + 1] == "x"}
    assert len(pairs1) > 2  # order 1 mixes them up


def test_same_seed_same_trace_and_save_load(tmp_path) -> None:
    m = MarkovChain(order=3).fit([cycle_trace()])
    a, b = m.sample(300, seed=5), m.sample(300, seed=5)
    assert a == b
    m.save(tmp_path / "m")
    assert not list((tmp_path / "m").glob("*.pkl"))
    m2 = MarkovChain.load(tmp_path / "m")
    assert m2.sample(300, seed=5) == a


def test_saved_tables_carry_a_sha256_that_load_checks(tmp_path: Path) -> None:
    """As the token and diffusion models: config.json vouches for the tables file; a damaged one is one line
    naming it, and a chain saved before the hashes (none in config.json) still loads."""
    m = MarkovChain(order=2).fit([cycle_trace()])
    m.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert set(meta["sha256"]) == {"tables.safetensors"}
    tables = tmp_path / "m" / "tables.safetensors"
    good = tables.read_bytes()
    tables.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit: still a readable safetensors file
    with pytest.raises(TraceSynthError, match="tables.safetensors: sha256 mismatch"):
        MarkovChain.load(tmp_path / "m")
    tables.unlink()
    with pytest.raises(TraceSynthError, match="tables.safetensors: missing"):
        MarkovChain.load(tmp_path / "m")
    tables.write_bytes(good)
    del meta["sha256"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(meta))
    assert MarkovChain.load(tmp_path / "m").sample(50, seed=1) == m.sample(50, seed=1)


def test_threads_relabelled_and_ret_sampled() -> None:
    s = MarkovChain(order=1).fit([cycle_trace()]).sample(400, seed=1)
    tids = set(s.table["tid"].drop_null().to_pylist())
    assert tids <= {1, 2} and tids  # real ids 7000/7001 never leak
    ev = np.asarray(s.column("event").to_pylist())
    ret = s.table["ret"].to_pylist()
    assert all(r == 0 for r, e in zip(ret, ev, strict=True) if e == "b")
    assert all(r is None for r, e in zip(ret, ev, strict=True) if e != "b")
    # the idle task keeps tid 0 (every CPU's, exempt from the one-CPU invariant); other threads count from 1
    idle = cycle_trace().with_columns(tid=np.where(np.arange(400) % 2 == 0, 0, 7001))
    assert set(MarkovChain(order=1).fit([idle]).sample(400, seed=1).table["tid"].to_pylist()) == {0, 1}


def test_errors() -> None:
    with pytest.raises(TraceSynthError):
        MarkovChain(order=0)
    with pytest.raises(TraceSynthError):
        MarkovChain().sample(10)
    with pytest.raises(TraceSynthError):
        MarkovChain.load("/nonexistent/dir")


KERNEL = ("sched.consistency", "sched.one_cpu", "syscall.pairing", "time.monotonic", "ret.errno")


@pytest.fixture(scope="module")
def ffmpeg() -> Trace:
    """A real slice with many threads and CPUs (the workload whose plain Markov samples break most)."""
    return Trace.load(Path(__file__).resolve().parents[2] / "data" / "ffmpeg.parquet").slice(50_000, 58_000)


def test_guided_chain_breaks_no_kernel_invariant_the_plain_one_does(ffmpeg: Trace, tmp_path: Path) -> None:
    rules = mine_rules([ffmpeg])
    m = MarkovChain(order=4).fit([ffmpeg])
    for seed in range(3):
        guided = m.sample(4000, seed=seed, guide="kernel")
        rep = check_trace(guided, rules)
        assert {r: rep.counts[r] for r in KERNEL} == dict.fromkeys(KERNEL, 0), (seed, rep.counts)
        assert len(guided) == 4000 and guided.n_event_types > 10
    plain = check_trace(m.sample(4000, seed=0), rules)
    assert plain.counts["syscall.pairing"] > 100 and plain.counts["sched.consistency"] > 100, plain.counts
    m.save(tmp_path / "m")
    back = MarkovChain.load(tmp_path / "m")
    assert back.kernel == m.kernel and back.sample(500, seed=4, guide="kernel") == m.sample(500, seed=4, guide="kernel")
    with pytest.raises(TraceSynthError, match="no guide 'x'"):
        m.sample(10, guide="x")
