"""Constraint-guided decoding (tracesynth.generators.guide): the guide's masks on a hand-made state, and a tiny
trained autoregressive model whose guided samples break no kernel invariant while unguided ones do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tracesynth.channels import ChannelCodec
from tracesynth.cli import app
from tracesynth.constraints import check_trace, mine_rules
from tracesynth.errors import TraceSynthError
from tracesynth.generators import load_generator
from tracesynth.generators.ar import ARConfig, Autoregressive
from tracesynth.generators.guide import KernelFacts, KernelGuide
from tracesynth.generators.masked import MaskedConfig, MaskedDiffusion
from tracesynth.io import read_trace
from tracesynth.trace import Trace

REPO = Path(__file__).resolve().parents[2]
KERNEL = ("sched.consistency", "sched.one_cpu", "syscall.pairing", "time.monotonic", "ret.errno")
TINY = dict(context=32, d_model=32, n_layers=2, n_heads=2, batch_size=8, overlap=8, chains=4)
EVENTS = ["<unk>", "sched_switch", "syscall_entry_read", "syscall_exit_read", "foo", "syscall_entry_exit_group"]


def _guide(convention: str, chains: int = 1) -> KernelGuide:
    """A guide over a 5-event vocabulary, 2 CPUs (tokens 2, 3), 4 thread labels."""
    codec = ChannelCodec(events=EVENTS, cpus=[0, 1], max_tids=4)
    return KernelGuide(codec, KernelFacts(convention), chains, window=8)


def _step(g: KernelGuide, j: int, cpu: int, tid: int, event: str) -> None:
    drawn = {"cpu": torch.tensor([cpu]), "tid": torch.tensor([tid])}
    assert g.allowed("tid", drawn)[0, tid], (cpu, tid, event)  # the test only takes allowed steps
    drawn["event"] = torch.tensor([EVENTS.index(event)])
    g.commit(j, drawn)


def _tids(g: KernelGuide, cpu: int) -> list[int]:
    return np.flatnonzero(g.allowed("tid", {"cpu": torch.tensor([cpu])})[0].numpy()).tolist()


def _events(g: KernelGuide, cpu: int, tid: int) -> set[str]:
    m = g.allowed("event", {"cpu": torch.tensor([cpu]), "tid": torch.tensor([tid])})[0]
    return {EVENTS[i] for i in np.flatnonzero(m.numpy()).tolist()}


@pytest.mark.parametrize("convention", ["prev", "next"])
def test_guide_masks_follow_the_cpu_and_the_open_call(convention: str) -> None:
    g = _guide(convention)
    assert _tids(g, 2) == [0, 1]  # an empty window: a thread-less event or the first new thread
    _step(g, 0, 2, 1, "syscall_entry_read")
    assert _tids(g, 2) == [1]  # CPU 0 runs thread 1
    assert _tids(g, 3) == [0, 2]  # thread 1 is current on CPU 0: CPU 1 gets a new thread
    assert _events(g, 2, 1) == {"<unk>", "sched_switch", "syscall_exit_read", "foo"}  # inside read: no entry
    _step(g, 1, 2, 1, "syscall_exit_read")
    assert "syscall_exit_read" not in _events(g, 2, 1) and "syscall_entry_read" in _events(g, 2, 1)
    _step(g, 2, 2, 1, "sched_switch")
    if convention == "prev":  # thread 1 switched out: CPU 0 is free, thread 1 may run on CPU 1
        assert _tids(g, 2) == [0, 1, 2] and _tids(g, 3) == [0, 1, 2]
    else:  # the switch handed CPU 0 to thread 1 (the incoming one)
        assert _tids(g, 2) == [1] and _tids(g, 3) == [0, 2]
    assert g.glob[0, :3].tolist() == [1, 1, 1]
    # a call whose exit was never seen (exit_group) stays open, as the checker has it: no entry after it
    _step(g, 3, 2, 1, "syscall_entry_exit_group")
    assert _events(g, 2, 1) == {"<unk>", "sched_switch", "foo"}


def test_an_event_refused_inside_a_call_becomes_the_calls_exit() -> None:
    g = _guide("prev")
    on = {"cpu": torch.tensor([2]), "tid": torch.tensor([1])}
    assert g.instead("event", on).tolist() == [-1] and g.instead("tid", on) is None  # no call open: a redraw
    _step(g, 0, 2, 1, "syscall_entry_read")
    assert g.instead("event", on).tolist() == [EVENTS.index("syscall_exit_read")]
    _step(g, 1, 2, 1, "syscall_exit_read")
    assert g.instead("event", on).tolist() == [-1]
    _step(g, 2, 2, 1, "syscall_entry_exit_group")  # a call that never returns: the thread ends, it switches out
    assert g.instead("event", on).tolist() == [EVENTS.index("sched_switch")]


@pytest.mark.parametrize("convention", ["prev", "next"])
def test_a_thread_inside_exit_group_ends_there(convention: str) -> None:
    """After exit_group a thread's last event is sched_process_exit and its tid is never seen again: a refused
    draw for it becomes that event, and no free CPU may run it (the shipped model kept drawing events for such
    threads, 28% of a long guided stream sample's event draws, and the guide let them do nothing but timers)."""
    events = [*EVENTS, "sched_process_exit"]
    codec = ChannelCodec(events=events, cpus=[0, 1], max_tids=4)
    g = KernelGuide(codec, KernelFacts(convention), 1, window=8)
    for j, (cpu, ev) in enumerate(((2, "syscall_entry_read"), (2, "syscall_exit_read"))):
        g.commit(j, {"cpu": torch.tensor([cpu]), "tid": torch.tensor([1]), "event": torch.tensor([events.index(ev)])})
    on = {"cpu": torch.tensor([2]), "tid": torch.tensor([1])}
    g.commit(2, {**on, "event": torch.tensor([events.index("syscall_entry_exit_group")])})
    assert g.instead("event", on).tolist() == [events.index("sched_process_exit")]
    free_cpu = g.allowed("tid", {"cpu": torch.tensor([3])})[0].numpy()
    assert not free_cpu[1] and free_cpu[2]  # not thread 1; a new thread may run there


@pytest.mark.parametrize("convention", ["prev", "next"])
def test_joined_chains_hand_each_cpu_over_with_a_switch(convention: str) -> None:
    g = _guide(convention, chains=2)
    sw, foo = EVENTS.index("sched_switch"), EVENTS.index("foo")
    # chain 0 (threads 1, 2) leaves thread 1 on CPU 0 (token 2) and switches thread 2 out of CPU 1 (token 3);
    # chain 1 (threads 3, 4) runs thread 3 on CPU 1, then thread 4 on CPU 0; its last event is cut off
    seqs = {
        "event": np.array([[foo, foo, sw, foo], [foo, foo, foo, foo]]),
        "cpu": np.array([[2, 3, 3, 2], [3, 2, 2, 3]]),
        "tid": np.array([[1, 2, 2, 1], [3, 4, 4, 3]]),
        "comm": np.array([[5, 6, 6, 5], [7, 8, 8, 7]]),
        "dt": np.array([[3, 3, 3, 3], [3, 3, 3, 3]]),
        "ret": np.zeros((2, 4), np.int64),
    }
    out = g.join_chains(seqs, ends=np.array([4, 3]))
    if convention == "prev":  # CPU 1 was left free; thread 1 switches out of CPU 0 before thread 4 runs there
        assert out["event"].tolist() == [foo, foo, sw, foo, foo, sw, foo, foo]
        assert out["tid"].tolist() == [1, 2, 2, 1, 3, 1, 4, 4]
        assert out["comm"][5] == 5 and out["cpu"][5] == 2
    else:  # "next": chain 0's switch handed CPU 1 to thread 2; switches hand both CPUs to chain 1's threads
        assert out["event"].tolist() == [foo, foo, sw, foo, sw, foo, sw, foo, foo]
        assert out["tid"].tolist() == [1, 2, 2, 1, 3, 3, 4, 4, 4]
        assert out["cpu"].tolist() == [2, 3, 3, 2, 3, 3, 2, 2, 2]
    assert _guide(convention, chains=2).join_chains(seqs, ends=np.array([4, 0]))["tid"].tolist() == [1, 2, 2, 1]


@pytest.fixture(scope="module")
def real():
    return read_trace(REPO / "data" / "sqlite.parquet").slice(20000, 24000)


@pytest.fixture(scope="module")
def fitted(real):
    torch.set_num_threads(1)
    return Autoregressive(ARConfig(**TINY, steps=40)).fit([real])


def test_guided_samples_break_no_kernel_invariant_unguided_ones_do(fitted, real) -> None:
    rules = mine_rules([real])
    unguided = {r: 0 for r in KERNEL}
    for seed in range(3):
        guided = fitted.sample(800, seed=seed)  # guide="kernel" is the config's default
        rep = check_trace(guided, rules)
        assert {r: rep.counts[r] for r in KERNEL} == dict.fromkeys(KERNEL, 0), seed
        assert guided.metadata["guide"] == "kernel" and len(guided) == 800
        plain = check_trace(fitted.sample(800, seed=seed, guide="none"), rules)
        for r in KERNEL:
            unguided[r] += plain.counts[r]
    # the same network unguided breaks threads and syscalls (about 150 events of 800 per seed here)
    assert unguided["syscall.pairing"] > 100 and unguided["sched.consistency"] > 10, unguided


def test_guide_is_stored_and_kept_through_save_load(fitted, tmp_path: Path) -> None:
    fitted.save(tmp_path / "m")
    back = load_generator(tmp_path / "m")
    assert back.kernel == fitted.kernel and back.config.guide == "kernel"
    for seed in (0, 5):
        assert back.sample(400, seed=seed) == fitted.sample(400, seed=seed)
    assert back.sample(400, seed=0, guide="none") == fitted.sample(400, seed=0, guide="none")
    assert back.sample(400, seed=0, guide="none") != back.sample(400, seed=0)
    out = tmp_path / "s.parquet"
    res = CliRunner().invoke(
        app, ["sample", str(tmp_path / "m"), "--events", "300", "-o", str(out), "--guide", "none", "--seed", "2"]
    )
    assert res.exit_code == 0, res.output
    assert Trace.load(out) == fitted.sample(300, seed=2, guide="none")
    res = CliRunner().invoke(app, ["sample", str(tmp_path / "m"), "--events", "3", "-o", str(out), "--guide", "x"])
    assert isinstance(res.exception, TraceSynthError) and "no guide 'x'" in str(res.exception)
    assert not out.exists() or Trace.load(out) == fitted.sample(300, seed=2, guide="none")  # nothing half-written


def test_a_model_without_a_guide_refuses_one(real) -> None:
    m = MaskedDiffusion(MaskedConfig(**TINY, steps=2, sample_steps=2)).fit([real])
    with pytest.raises(TraceSynthError, match="no guide 'kernel'"):
        m.sample(64, guide="kernel")
    with pytest.raises(TraceSynthError, match="guide in"):
        ARConfig(guide="yes")
