"""Channel encoding: vocabularies, lossless round trips, per-window tid relabelling, windows."""

from __future__ import annotations

import numpy as np
import pytest

from tracesynth.channels import CHANNELS_2, ChannelCodec, _log2_bin
from tracesynth.errors import TraceSynthError
from tracesynth.trace import Trace


def make_trace(n: int = 400, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    events = np.array(["sys_enter_read", "sys_exit_read", "sched_switch", "sys_enter_openat"])[rng.integers(0, 4, n)]
    ts = 1_000_000 + np.cumsum(rng.integers(0, 5_000_000, n))
    tid = rng.choice([4242, 77, 9001], n).astype(object)
    tid[::17] = None
    comm = np.where(tid == 77, "bash", "fio").astype(object)
    comm[::13] = None
    # ret: null, zero, errnos, other negatives and positives whose log2 bins each hold one value
    pool = [None, 0, -2, -11, -9999, 1, 3, 4096, 1 << 40]
    ret = [pool[i] for i in rng.integers(0, len(pool), n)]
    cpu = rng.integers(0, 3, n).astype(object)
    cpu[::11] = None
    return Trace.from_columns(ts, events, cpu=cpu, tid=tid, comm=comm, ret=ret, metadata={"workload": "t"})


def test_round_trip_is_lossless_where_the_channel_allows() -> None:
    tr = make_trace()
    codec = ChannelCodec.fit([tr])
    enc = codec.encode(tr)
    win = codec.windows(enc, len(tr))
    assert win["event"].shape == (1, len(tr))
    back = codec.decode(win, t0=int(tr.ts[0]))
    for col in ("ts", "event", "cpu", "comm", "ret"):
        assert back.column(col).equals(tr.column(col)), col
    # tids come back as small labels in order of first appearance, nulls stay null
    tid = tr.column("tid").to_pylist()
    got = back.column("tid").to_pylist()
    order = list(dict.fromkeys(t for t in tid if t is not None))
    assert got == [None if t is None else order.index(t) + 1 for t in tid]
    assert max(x for x in got if x is not None) == 3


def test_tids_are_relabelled_per_window_and_capped() -> None:
    codec = ChannelCodec(max_tids=3)
    raw = np.array([[50, 10, 50, -1, 30, 20, 40], [7, 7, 8, 9, 9, 10, 10]])
    assert codec.relabel_tids(raw).tolist() == [[1, 2, 1, 0, 3, 3, 3], [1, 1, 2, 3, 3, 3, 3]]


def test_windows_overlap_keep_the_tail_and_stay_inside_a_block() -> None:
    tr = make_trace(100)
    codec = ChannelCodec.fit([tr])
    enc = codec.encode(tr)
    w = codec.windows(enc, 32, 16)
    starts = [0, 16, 32, 48, 64, 68]  # the last window is moved back to end at the block's end
    assert w["event"].shape == (len(starts), 32)
    for i, s in enumerate(starts):
        assert np.array_equal(w["event"][i], enc["event"][s : s + 32])
    assert w["dt"].dtype == np.float32
    assert codec.windows(enc, 200)["event"].shape == (0, 200)


def test_unknown_values_map_to_unknown_tokens() -> None:
    codec = ChannelCodec.fit([make_trace(50)])
    other = Trace.from_columns([1, 2], ["never_seen", "sched_switch"], cpu=[99, 0], comm=["zzz", "fio"], ret=[-5, 7])
    enc = codec.encode(other)
    assert enc["event"][0] == 0 and enc["event"][1] > 0
    assert enc["cpu"].tolist()[0] == 1 and enc["comm"].tolist()[0] == 1
    dec = codec.decode({c: enc[c][None] for c in ("event", "dt", "cpu", "comm")})
    assert dec.column("event").to_pylist()[0] == "<unk>"
    assert dec.column("cpu").to_pylist() == [None, 0]


def test_two_channel_mode_and_json_round_trip() -> None:
    tr = make_trace()
    codec = ChannelCodec.fit([tr], CHANNELS_2)
    assert set(codec.encode(tr)) >= {"event", "dt"} and set(codec.vocab_sizes) == {"event"}
    w = codec.windows(codec.encode(tr), 64, 64)
    assert set(w) == {"event", "dt"}
    back = ChannelCodec.from_json(codec.to_json())
    assert back == codec
    dec = back.decode(w)
    assert dec.column("tid").null_count == len(dec) and len(dec) == w["event"].size


def test_log2_bins_are_exact_at_powers_of_two() -> None:
    v = np.array([1, 2, 3, 4, 7, 8, (1 << 53) - 1, 1 << 53, (1 << 53) + 1, 2**63 - 1], dtype=np.int64)
    assert _log2_bin(v).tolist() == [0, 1, 1, 2, 2, 3, 52, 53, 53, 62]


def test_fit_needs_events() -> None:
    with pytest.raises(TraceSynthError):
        ChannelCodec.fit([])


def test_the_idle_task_is_no_thread() -> None:
    """tid 0 is each CPU's own idle task, current on several CPUs at once (a system-wide LTTng trace): it gets no
    thread label, so neither the model nor the guide takes it for one thread running on two CPUs."""
    t = Trace.from_columns(np.arange(6) * 10, ["irq_handler_entry", "irq_handler_entry", "sched_switch",
                                               "syscall_entry_read", "syscall_exit_read", "sched_wakeup"],
                           cpu=[0, 1, 0, 0, 0, 1], tid=[0, 0, 0, 42, 42, 0],
                           comm=["swapper/0", "swapper/1", "swapper/0", "wget", "wget", "swapper/1"])  # fmt: skip
    codec = ChannelCodec.fit([t])
    enc = codec.encode(t)
    assert enc["tid"].tolist() == [-1, -1, -1, 42, 42, -1]
    assert codec.windows(enc, 6)["tid"][0].tolist() == [0, 0, 0, 1, 1, 0]
