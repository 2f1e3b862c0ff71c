"""ProfileStore: keys, idempotence, resume after SIGKILL, bad files."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dooly.errors import DoolyError
from dooly.store import Measurement, ProfileContext, ProfileStore, canonical_point, hardware_fingerprint

CTX = ProfileContext(hardware="cpu:test:cores2:threads1", engine="hf-eager", backend="eager", dtype="float32")
M = Measurement(median_s=1e-4, p10_s=9e-5, p90_s=1.2e-4, repeats=7, cost_s=2e-3)


def test_canonical_point_is_order_and_type_stable() -> None:
    assert canonical_point({"tokens": 4, "requests": 2.0}) == canonical_point({"requests": 2, "tokens": 4.0})
    assert json.loads(canonical_point({"kv_len": 0})) == {"kv_len": 0}


def test_fingerprint_names_cpu_and_threads() -> None:
    fp = hardware_fingerprint("cpu", threads=3)
    assert fp.startswith("cpu:") and fp.endswith("threads3")


def test_points_are_keyed_by_context_and_signature(tmp_path: Path) -> None:
    other = ProfileContext(hardware="cpu:other:cores2:threads1")
    with ProfileStore(tmp_path / "p.db") as st:
        st.register_signature(CTX, "sigA", '{"op":"mm"}', grid_size=2)
        st.put_point(CTX, "sigA", {"tokens": 1}, M)
        st.put_point(CTX, "sigA", {"tokens": 1}, M)  # idempotent: same key replaces
        st.put_point(CTX, "sigA", {"tokens": 8}, M)
        assert st.done_points(CTX, "sigA") == {canonical_point({"tokens": 1}), canonical_point({"tokens": 8})}
        assert st.done_points(other, "sigA") == set()
        assert not st.is_complete(CTX, "sigA")
        st.mark_complete(CTX, "sigA")
        assert st.complete_keys(CTX) == {"sigA"} and st.complete_keys(other) == set()
        assert st.signature_costs(CTX) == {"sigA": pytest.approx(4e-3)}
        # a larger grid re-opens the signature; the same grid does not
        st.register_signature(CTX, "sigA", '{"op":"mm"}', grid_size=2)
        assert st.is_complete(CTX, "sigA")
        st.register_signature(CTX, "sigA", '{"op":"mm"}', grid_size=5)
        assert not st.is_complete(CTX, "sigA")
        assert json.loads(st.signature_json(CTX, "sigA")) == {"op": "mm"}
    with ProfileStore(tmp_path / "p.db") as st:  # persisted
        pts = st.points(CTX, "sigA")
        assert [p for p, _ in pts] == [{"tokens": 1}, {"tokens": 8}]
        assert pts[0][1] == M


def test_forwards_and_traces_roundtrip(tmp_path: Path) -> None:
    with ProfileStore(tmp_path / "p.db") as st:
        st.put_forward(CTX, "m1", "decode", {"requests": 2, "kv_len": 16}, M)
        st.put_trace("hf-eager", "m1", "decode", '{"ops": []}')
        assert st.forwards(CTX, "m1")[0][:3] == ("m1", "decode", {"kv_len": 16, "requests": 2})
        assert st.forwards(CTX, "m2") == []
        assert st.get_trace("hf-eager", "m1", "decode") == '{"ops": []}'
        assert st.get_trace("hf-eager", "m1", "prefill") is None


def test_not_a_database_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(DoolyError, match="bad.db"):
        ProfileStore(bad)
    with pytest.raises(DoolyError, match="directory"):
        ProfileStore(tmp_path)


_WRITER = """
import sys, time
from dooly.store import Measurement, ProfileContext, ProfileStore
ctx = ProfileContext(hardware="cpu:test:cores2:threads1")
st = ProfileStore(sys.argv[1])
st.register_signature(ctx, "s", "{}", grid_size=100000)
for i in range(100000):
    st.put_point(ctx, "s", {"tokens": i}, Measurement(1e-4, 1e-4, 1e-4, 1, 1e-4))
    if i == 20:
        print("ready", flush=True)
"""


def test_sigkill_mid_write_loses_no_committed_point(tmp_path: Path) -> None:
    db = tmp_path / "kill.db"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(db)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with ProfileStore(db) as st:
        done = st.done_points(CTX.__class__(hardware="cpu:test:cores2:threads1"), "s")
        n = len(done)
        # every committed point is there, contiguous from 0 (none half-written, none lost in between)
        assert n > 20
        assert done == {canonical_point({"tokens": i}) for i in range(n)}
        assert st._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
