"""ProfileStore: keys, idempotence, resume after SIGKILL, bad files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dooly.core.errors import DoolyError
from dooly.db.store import (
    Measurement,
    ProfileContext,
    ProfileStore,
    canonical_point,
    hardware_fingerprint,
    open_readonly,
)

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
from dooly.db.store import Measurement, ProfileContext, ProfileStore
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


def _filled(path: Path) -> Path:
    """A DB with a row in every table, as `dooly profile` leaves it (calibration stores the config as a trace)."""
    with ProfileStore(path) as st:
        st.register_signature(CTX, "sigA", '{"op":"mm"}', grid_size=1)
        st.put_point(CTX, "sigA", {"tokens": 4}, M)
        st.put_forward(CTX, "m", "prefill", {"requests": 1, "tokens": 4}, M)
        st.put_trace("hf-eager/cpu:float32", "m@1", "prefill", '{"format": "dooly.trace/1", "records": []}')
        st.put_trace("config", "m", "config", '{"model_type": "llama"}')
    return path


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_a_file_is_created_on_the_first_write_only(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "p.db"
    with ProfileStore(path) as st:
        assert st.complete_keys(CTX) == set() and st.forwards(CTX) == []
    assert not path.exists() and not path.parent.exists()  # opened and read: nothing created
    with pytest.raises(RuntimeError), ProfileStore(path) as st:
        st.put_trace("e", "m", "prefill", "{}")
        raise RuntimeError("the run fails before measuring anything")
    assert not path.parent.exists() or _listing(path.parent) == []  # the file this run created is gone
    _filled(path)
    with pytest.raises(RuntimeError), ProfileStore(path) as st:
        raise RuntimeError("a later failed run keeps the measurements")
    with ProfileStore(path) as st:
        assert len(st.points(CTX, "sigA")) == 1


def test_readonly_store_never_writes_nor_creates(tmp_path: Path) -> None:
    path = _filled(tmp_path / "p.db")
    before, listing = path.read_bytes(), _listing(tmp_path)
    with ProfileStore(path, readonly=True) as st:
        assert [p for p, _ in st.points(CTX, "sigA")] == [{"tokens": 4}]
        st.put_trace("e", "m", "prefill", "{}")  # e.g. the trace cache: kept in memory for this run
        assert st.get_trace("e", "m", "prefill") == "{}"
    assert path.read_bytes() == before and _listing(tmp_path) == listing
    with ProfileStore(path, readonly=True) as st:
        assert st.get_trace("e", "m", "prefill") is None
    with ProfileStore(tmp_path / "absent.db", readonly=True) as st:
        assert st.summary()["points"] == 0
    assert _listing(tmp_path) == listing


def test_foreign_or_wrong_schema_sqlite_is_refused_untouched(tmp_path: Path) -> None:
    foreign = tmp_path / "f.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE points (x)")
    con.commit()
    con.close()
    wrong = _filled(tmp_path / "w.db")
    con = sqlite3.connect(wrong)
    con.execute("ALTER TABLE points DROP COLUMN cost_s")
    con.commit()
    con.close()
    for path, why in ((foreign, "not a dooly profile database"), (wrong, "table points")):
        before = path.read_bytes()
        for readonly in (False, True):
            with pytest.raises(DoolyError, match=why):
                ProfileStore(path, readonly=readonly)
        assert path.read_bytes() == before
    assert _listing(tmp_path) == ["f.db", "w.db"]


@pytest.mark.parametrize(
    ("update", "column"),
    [
        ("UPDATE points SET median_s = 1e300", "median_s"),
        ("UPDATE points SET median_s = 'NaN'", "median_s"),
        ("UPDATE points SET cost_s = -1", "cost_s"),
        ("UPDATE points SET repeats = -3", "repeats"),
        ("UPDATE points SET point = '{\"tokens\": '", "point"),
        ("UPDATE points SET point = '[1, 2]'", "point"),
        ("UPDATE points SET point = '{\"tokens\": 1e999}'", "point"),
        ("UPDATE points SET point = x'00ff'", "point"),
        ("UPDATE signatures SET complete = 7", "complete"),
        ("UPDATE signatures SET grid_size = 'big'", "grid_size"),
        ("UPDATE traces SET trace_json = '[]'", "trace_json"),
        ("UPDATE traces SET trace_json = '{\"records\": 5}'", "trace_json"),
        # nested past Python's recursion limit: SQLite's json_valid takes it, json.loads would not
        ("UPDATE signatures SET sig_json = '{\"op\": " + "[" * 1500 + "]" * 1500 + "}'", "sig_json"),
        ("UPDATE traces SET trace_json = '{\"records\": [" + "{\"a\":" * 65 + "1" + "}" * 65 + "]}'", "trace_json"),
    ],
)
def test_damaged_rows_are_refused_at_open_naming_file_row_and_column(tmp_path: Path, update: str, column: str) -> None:
    path = _filled(tmp_path / "c.db")
    con = sqlite3.connect(path)
    con.execute(update)
    con.commit()
    con.close()
    for readonly in (True, False):
        with pytest.raises(DoolyError, match=rf"c\.db: damaged profile database \(row 1 of \w+: bad {column}\)"):
            ProfileStore(path, readonly=readonly)


_READER = """
import sys
from dooly.core.errors import DoolyError
from dooly.db.store import ProfileContext, ProfileStore
ctx = ProfileContext(hardware="cpu:test:cores2:threads1")
with ProfileStore(sys.argv[1], readonly=True) as st:
    print("read", len(st.points(ctx, "sigA")))
from dooly.report import savings_from_db  # reads the file with its own SQL
print("report rows", len(savings_from_db(sys.argv[1])))
try:
    ProfileStore(sys.argv[1])
except DoolyError as exc:
    print("write:", exc)
"""


def _in_readonly_dir(d: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """Run argv with ``d`` read-only: chmod for a user; root ignores modes, so a read-only bind mount in a
    private mount namespace (gone when the process ends)."""
    if os.geteuid() != 0:
        d.chmod(0o555)
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=120)
        finally:
            d.chmod(0o755)
    if shutil.which("unshare") is None:
        pytest.skip("running as root without unshare: cannot make a directory read-only")
    script = 'mount --bind -o ro "$1" "$1" || exit 99; shift; exec "$@"'
    res = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(d), *argv], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    if res.returncode == 99 or "unshare failed" in res.stderr:
        pytest.skip(f"cannot mount a read-only directory here: {res.stderr.strip()[:80]}")
    return res


def test_a_db_in_a_readonly_directory_reads_and_says_why_it_cannot_be_written(tmp_path: Path) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    path = _filled(d / "p.db")
    before = path.read_bytes()
    res = _in_readonly_dir(d, [sys.executable, "-c", _READER, str(path)])
    assert res.returncode == 0, res.stderr
    # the report's reader opens it too (no models are recorded as profiled in this DB, so no savings rows)
    assert "read 1" in res.stdout and "report rows 0" in res.stdout
    assert "is read-only" in res.stdout and "not a dooly profile database" not in res.stdout
    assert path.read_bytes() == before and _listing(d) == ["p.db"]


_KILLED_AFTER_FIRST_WRITE = """
import os, sys
from dooly.db.store import ProfileStore
st = ProfileStore(sys.argv[1])
st.put_trace("hf-eager/cpu", "m", "prefill", '{"records": []}')  # what a profile writes first, while tracing
os._exit(9)  # killed: no close, no checkpoint
"""


def test_a_run_killed_after_its_first_write_leaves_a_whole_database(tmp_path: Path) -> None:
    db = tmp_path / "p.db"
    subprocess.run([sys.executable, "-c", _KILLED_AFTER_FIRST_WRITE, str(db)], check=False)
    assert db.stat().st_size > 0
    alone = tmp_path / "alone" / "p.db"  # the main file without its -wal: the schema is in it, not only in the WAL
    alone.parent.mkdir()
    shutil.copy(db, alone)
    open_readonly(alone).close()
    with ProfileStore(db, readonly=True) as st:  # the -wal's commit is read too
        assert st.get_trace("hf-eager/cpu", "m", "prefill") == '{"records": []}'
    assert [p.name for p in tmp_path.glob(".*")] == []  # no temporary file left beside it


def test_the_file_appears_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "p.db"

    def killed(*a: object) -> None:
        raise KeyboardInterrupt  # the run stops while the file is being made

    monkeypatch.setattr(os, "link", killed)
    with pytest.raises(KeyboardInterrupt), ProfileStore(db) as st:
        st.put_trace("e", "m", "prefill", "{}")
    assert _listing(tmp_path) == []
    monkeypatch.undo()
    db.write_bytes(b"")  # an older dooly's 0-byte file: replaced by a whole database
    with ProfileStore(db) as st:
        st.put_point(CTX, "sigA", {"tokens": 4}, M)
    assert _listing(tmp_path) == ["p.db"]
    with ProfileStore(db, readonly=True) as st:
        assert len(st.points(CTX, "sigA")) == 1
