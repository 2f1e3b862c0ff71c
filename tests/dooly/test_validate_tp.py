"""`dooly validate --tp 2`'s measurements: the real forwards of a TP=2 vLLM replica, both ranks in their own
processes (one per core) exchanging through vLLM's CPU communicator, rank 0's times scored like a one-device
validation's; and the same for a replica of two pipeline stages (PP=2), timed on the last stage.

A tiny llama (4 heads, 2 KV heads: both divide by 2). Starting the two ranks (each imports vLLM and builds its
shard) takes ~25 s, so the tests that start them share one run and are marked slow; no figure is compared with
another (no timing assertion).
"""

from __future__ import annotations

import importlib.util
import math
import multiprocessing
import os
import re
import tempfile
from pathlib import Path

import pytest

# found, not imported: collecting the suite must not pay vLLM's import in every worker
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (the vLLM engine is optional)", allow_module_level=True)

from dooly.core.errors import DoolyError  # noqa: E402
from dooly.db.store import ProfileStore  # noqa: E402
from dooly.engines import get_engine  # noqa: E402
from dooly.predict import validate_parallel as vp  # noqa: E402
from dooly.predict.validate import phase_mape, round_spread  # noqa: E402
from dooly.profile import parallel_forward  # noqa: E402

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 512}  # fmt: skip
SHAPES = {"prefill": [{"requests": 1, "tokens": 24}], "decode": [{"requests": 3, "kv_len": 40}]}


class _Pred:
    """A stand-in predictor: a name, and a fixed figure per phase (the measurements are what is tested)."""

    name = "tiny-llama"

    def forward_latency(self, phase: str, values: dict) -> float:
        return 1e-3 if phase == "prefill" else 2e-3


def _children() -> list[int]:
    """Live processes whose parent is this one (from /proc)."""
    me, out = str(os.getpid()), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        ppid = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")), None)
        state = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("State:")), "")
        if ppid == me and state != "Z":
            out.append(int(d.name))
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):  # type: ignore[no-untyped-def]
    """One validation of the TP=2 replica on two shapes in two rounds, kept in a store: (rows, DB, ranks' pids)."""
    db = tmp_path_factory.mktemp("tp2") / "p.db"
    pids: list[int] = []
    original = parallel_forward.ReplicaRanks.time

    def time_and_note(self, *a, **k):  # type: ignore[no-untyped-def]
        pids.extend(self.pids())
        return original(self, *a, **k)

    mp = pytest.MonkeyPatch()
    mp.setattr(parallel_forward.ReplicaRanks, "time", time_and_note)
    before = set(Path(tempfile.gettempdir()).iterdir())
    try:
        with ProfileStore(db) as store:
            rows = vp.validate_parallel(_Pred(), LLAMA, get_engine("vllm", dtype="float32", tp=2), SHAPES,
                                        repeats=2, rounds=2, store=store)  # fmt: skip
    finally:
        mp.undo()

    # the ranks' temp files (vLLM's IPC sockets) went with them; this process's own go at its exit, and those named
    # for another live process (a test beside this one, under xdist) are that process's
    def others(p: Path) -> bool:
        m = re.search(r"-(\d+)-", p.name)
        return m is not None and int(m[1]) not in pids and Path(f"/proc/{m[1]}").exists()

    new = set(Path(tempfile.gettempdir()).iterdir()) - before
    left = {p for p in new if f"-{os.getpid()}-" not in p.name and not others(p)}
    return rows, db, sorted(set(pids)), left


@pytest.mark.slow  # starting the two ranks takes ~25 s
def test_a_tp2_replica_s_forwards_are_timed_on_rank_0_per_shape_and_round(measured) -> None:  # type: ignore[no-untyped-def]
    rows, _, _, _ = measured
    assert [(r.phase, r.values) for r in rows] == [(ph, v) for ph, vs in SHAPES.items() for v in vs]
    for r in rows:
        assert len(r.rounds_s) == 2 and all(math.isfinite(x) and x > 0 for x in r.rounds_s)
        assert (
            math.isfinite(r.measured_s)
            and r.measured_s > 0
            and r.predicted_s == _Pred().forward_latency(r.phase, r.values)
        )
    assert math.isfinite(phase_mape(rows)) and math.isfinite(round_spread(rows))


@pytest.mark.slow  # starting the two ranks takes ~25 s
def test_the_ranks_are_gone_after_the_validation(measured) -> None:  # type: ignore[no-untyped-def]
    _, _, pids, left = measured
    assert len(pids) == 2 and not left, left
    assert not set(pids) & set(_children()) and not multiprocessing.active_children()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    assert not list(Path("/dev/shm").glob(f"dooly-{os.getpid()}-*"))  # vLLM's segments of the ranks' group


@pytest.mark.slow  # starting the two ranks takes ~25 s
def test_kept_measurements_are_rescored_without_starting_the_ranks(measured, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    rows, db, _, _ = measured

    def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the ranks were started again")

    monkeypatch.setattr(parallel_forward, "ReplicaRanks", refuse)
    with ProfileStore(db) as store:
        again = vp.validate_parallel(_Pred(), LLAMA, get_engine("vllm", dtype="float32", tp=2), SHAPES, rounds=2,
                                     store=store)  # fmt: skip
        kept = {m for m, *_ in store.forwards(_ctx(store))}
    assert [r.rounds_s for r in again] == [r.rounds_s for r in rows]
    assert kept == {"tiny-llama#holdout-tp2", "tiny-llama#holdout2-tp2"}  # apart from the one-device holdouts


def _ctx(store: ProfileStore):  # type: ignore[no-untyped-def]
    from dooly.profile import context_for

    return context_for(get_engine("vllm", dtype="float32", tp=2), 1)


def test_a_model_whose_heads_do_not_divide_by_2_is_refused_in_one_line_before_any_rank_starts() -> None:
    bad = {**LLAMA, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 32, "hidden_size": 288}
    before = set(_children())
    with pytest.raises(DoolyError) as exc:
        parallel_forward.ReplicaRanks(bad, tp=2)
    msg = str(exc.value)
    assert "\n" not in msg and "attention heads (9)" in msg and "tensor parallel size (2)" in msg
    assert set(_children()) <= before


def test_validation_of_a_replica_needs_the_vllm_engine_split_two_ways_or_more() -> None:
    for engine in (get_engine("vllm"), get_engine("hf-eager")):
        with pytest.raises(DoolyError, match="--tp or --pp of 2 or more"):
            vp.validate_parallel(_Pred(), LLAMA, engine, SHAPES)
    with pytest.raises(DoolyError, match="at least 2 ranks"):
        parallel_forward.ReplicaRanks(LLAMA, tp=1)
    with pytest.raises(DoolyError, match="one predictor per stage, not 1"):  # before any rank starts
        vp.validate_parallel(_Pred(), LLAMA, get_engine("vllm", pp=2), SHAPES)


@pytest.mark.slow  # starting the two stages takes ~30-60 s
def test_a_pp2_replica_is_timed_on_its_last_stage_and_predicted_as_the_sum_of_its_stages() -> None:
    shapes = {"prefill": [{"requests": 1, "tokens": 24}], "decode": []}
    rows = vp.validate_parallel([_Pred(), _Pred()], LLAMA, get_engine("vllm", dtype="float32", pp=2), shapes,
                                repeats=1, rounds=1)  # fmt: skip
    assert len(rows) == 1 and rows[0].predicted_s == 2 * _Pred().forward_latency("prefill", {})
    assert math.isfinite(rows[0].measured_s) and rows[0].measured_s > 0
    assert not multiprocessing.active_children()


def test_validate_cli_takes_the_pipeline_stages_and_refuses_an_engine_without_them(tmp_path: Path) -> None:
    """`dooly validate --pp 2` reaches the stages' path; on an engine without pipeline ranks it is one error line."""
    import json

    from typer.testing import CliRunner

    from dooly.cli import app

    cfg, db = tmp_path / "llama.json", tmp_path / "p.db"
    cfg.write_text(json.dumps({**LLAMA, "num_hidden_layers": 4}))
    db.write_bytes(b"")  # an empty DB: a new SQLite database to dooly
    res = CliRunner().invoke(app, ["validate", str(cfg), "--db", str(db), "--engine", "hf-eager", "--pp", "2"])
    assert isinstance(res.exception, DoolyError) and "no tensor or pipeline parallelism" in str(res.exception)
    res = CliRunner().invoke(app, ["validate", str(cfg), "--db", str(db), "--engine", "vllm", "--pp", "2"])
    assert isinstance(res.exception, DoolyError) and "have no profile" in str(res.exception)  # a stage's own
