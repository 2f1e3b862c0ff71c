"""anonymize leaves no real thread id behind: id-valued syscall returns are relabelled with the tids."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_run import tracesynth

from tracesynth.anonymize import ID_SYSCALLS, anonymize, id_valued_exits
from tracesynth.io import read_trace
from tracesynth.trace import Trace

DATA = Path(__file__).resolve().parents[2] / "data"
SAMPLES = sorted(DATA.glob("*.parquet"))


def _real_ids(t: Trace) -> set[int]:
    """Every real id in a trace: the tid column and the ids syscalls returned (0, the idle task, excluded)."""
    ids = set(t.table["tid"].drop_null().to_pylist()) | set(t.numeric("ret")[id_valued_exits(t)].tolist())
    return ids - {0}


def _check(real: Trace, anon: Trace) -> None:
    rows = id_valued_exits(real)
    assert np.array_equal(id_valued_exits(anon), rows)  # the same rows, still positive
    real_ids = _real_ids(real)
    labels = set(range(1, len(real_ids) + 1))
    got = set(anon.numeric("ret")[rows].tolist())
    assert got <= labels
    # a real id can only show up where it happens to equal a label, never from outside the label range
    assert not (got & (real_ids - labels))
    # one map for both: a real id gets the same label in the tid column and as a return value
    mapping: dict[int, int] = {}
    for r, a in zip(real.numeric("tid", -1).tolist(), anon.numeric("tid", -1).tolist(), strict=True):
        assert mapping.setdefault(r, a) == a
    for r, a in zip(real.numeric("ret")[rows].tolist(), anon.numeric("ret")[rows].tolist(), strict=True):
        assert mapping.setdefault(r, a) == a
    assert len(set(mapping.values())) == len(mapping)  # a bijection: distinct ids stay distinct
    # other return values are untouched
    other = ~rows
    assert np.array_equal(real.numeric("ret")[other], anon.numeric("ret")[other])


def test_lttng_wget_id_returns_are_relabelled(lttng_wget: Path) -> None:
    real = read_trace(lttng_wget)
    rows = id_valued_exits(real)
    assert rows.sum() > 50  # the trace has plenty of clone/getpid/... exits to leak through
    anon = anonymize(real, "s")
    _check(real, anon)
    # gettid returns the caller's own tid: after anonymising it still does
    codes, vocab = anon.codes("event")
    gettid = np.isin(codes, [i for i, v in enumerate(vocab) if v == "syscall_exit_gettid"])
    assert np.array_equal(anon.numeric("ret")[gettid], anon.numeric("tid")[gettid])


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_sample_traces_keep_no_real_id(path: Path) -> None:
    real = Trace.load(path)
    anon = anonymize(real, "s")
    _check(real, anon)
    # in these traces every real id is above the label range: nothing real is left at all
    assert not (set(anon.numeric("ret")[id_valued_exits(anon)].tolist()) & _real_ids(real))
    assert not (set(anon.table["tid"].drop_null().to_pylist()) & _real_ids(real))


def test_id_returns_of_threads_outside_the_trace_get_new_labels() -> None:
    t = Trace.from_columns(
        ts=[1, 2, 3, 4, 5, 6],
        event=["syscall_exit_getppid", "syscall_exit_clone", "syscall_exit_clone", "x", "syscall_exit_wait4", "y"],
        tid=[500, 500, 501, 501, 500, None],
        ret=[400, 501, 0, None, -10, 7],
    )
    a = anonymize(t, "k")
    assert a.table["tid"].to_pylist() == [1, 1, 2, 2, 1, None]
    # parent 400 never ran here: label 3; clone's child 501 -> 2; 0 and -ECHILD stay; "y" is not an id syscall
    assert a.table["ret"].to_pylist() == [3, 2, 0, None, -10, 7]
    assert {"gettid", "getpid", "clone3", "set_tid_address", "getpgrp"} <= ID_SYSCALLS


def test_shift_time_starts_at_zero_and_drops_the_clock_offset() -> None:
    t = Trace.from_columns(
        ts=[1_533_216_425_000_000_000, 1_533_216_425_000_000_500],
        event=["a", "b"],
        metadata={"clock": {"name": "monotonic", "offset": 1533216425226747410, "offset_s": 5}},
    )
    a = anonymize(t, "k", shift_time=True)
    assert a.ts.tolist() == [0, 500]
    assert a.metadata["clock"] == {"name": "monotonic"}
    assert anonymize(t, "k").ts.tolist() == t.ts.tolist()  # without the option times are kept


def test_anonymize_cli_shift_time(tmp_path: Path) -> None:
    Trace.from_columns(
        ts=[10**18, 10**18 + 7], event=["syscall_exit_gettid", "b"], tid=[900, 900], ret=[900, None]
    ).save(tmp_path / "t.parquet")
    r = tracesynth("anonymize", tmp_path / "t.parquet", "-o", tmp_path / "a.parquet", "--shift-time")
    assert r.code == 0, r.err
    a = Trace.load(tmp_path / "a.parquet")
    assert a.ts.tolist() == [0, 7] and a.table["ret"].to_pylist() == [1, None]
    assert "--shift-time" in tracesynth("anonymize", "--help").out


def test_fit_anonymize_keeps_no_real_comm_or_tid(tmp_path: Path, capsys, monkeypatch) -> None:
    from tracesynth.cli import main

    comms = ["secret-prog", "other-prog"]
    n = 400
    rng = np.random.default_rng(0)
    tids = rng.choice([4242, 4343], n)
    ev = np.where(np.arange(n) % 2, "syscall_exit_gettid", "syscall_entry_gettid")
    real = Trace.from_columns(
        ts=np.arange(n) * 1000,
        event=ev,
        cpu=np.zeros(n, int),
        tid=tids,
        comm=[comms[int(t == 4343)] for t in tids],
        ret=[int(t) if e.startswith("syscall_exit") else None for e, t in zip(ev, tids, strict=True)],
    )
    real.save(tmp_path / "t.parquet")
    args = ["fit", tmp_path / "t.parquet", "-o", tmp_path / "m", "--anonymize", "--kind", "diffusion"]
    args += ["--context", "32", "--steps", "1"]
    args += ["--d-model", "16", "--layers", "1", "--batch-size", "2", "--checkpoint-every", "1", "--threads", "1"]
    monkeypatch.setattr(sys, "argv", ["tracesynth", *map(str, args)])
    try:
        main()
    except SystemExit as exc:
        assert not exc.code, capsys.readouterr().err
    vocab = (tmp_path / "m" / "vocab.json").read_text()
    assert "secret-prog" not in vocab and "other-prog" not in vocab
    # a real tid as a token of its own; the hashed names (random salt) are hex and may hold "4242" by chance
    assert not re.search(r"(?<![0-9a-f])(4242|4343)(?![0-9a-f])", vocab), vocab
    json.loads(vocab)
    assert "real command names" in tracesynth("fit", "--help").out
