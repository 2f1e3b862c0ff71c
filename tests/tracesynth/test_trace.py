import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tracesynth import Trace, TraceSynthError


def small() -> Trace:
    return Trace.from_columns(
        ts=[10, 20, 20, 35],
        event=["syscall_entry_read", "syscall_exit_read", "sched_switch", "syscall_entry_write"],
        cpu=[0, 0, 1, 1],
        tid=[7, 7, None, 8],
        comm=["bash", "bash", None, "cat"],
        ret=[None, 5, None, None],
        metadata={"source_format": "test", "workload": "unit"},
    )


def test_schema_and_accessors():
    t = small()
    assert len(t) == 4
    assert t.table.schema.field("event").type == pa.dictionary(pa.int32(), pa.string())
    assert t.duration_ns == 25
    assert t.event_counts()["syscall_entry_read"] == 1
    codes, vocab = t.codes("comm")
    assert codes[2] == -1 and vocab[codes[0]] == "bash"
    assert t.numeric("ret").tolist() == [-1, 5, -1, -1]
    s = t.summary()
    assert s["cpus"] == [0, 1] and s["threads"] == 2 and s["with_ret"] == 1


def test_parquet_round_trip_keeps_rows_and_metadata(tmp_path):
    t = small()
    path = t.save(tmp_path / "t.parquet")
    back = Trace.load(path)
    assert back == t
    assert back.metadata == {"source_format": "test", "workload": "unit"}
    assert not list(tmp_path.glob(".*tmp"))  # no temporary left behind


def test_unsorted_timestamps_are_rejected_with_row():
    with pytest.raises(TraceSynthError, match="decrease at row 1"):
        Trace.from_columns(ts=[5, 3], event=["a", "b"])
    assert Trace.from_columns(ts=[5, 3], event=["a", "b"], sort=True).ts.tolist() == [3, 5]


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(TraceSynthError, match="bad.parquet: not a readable Parquet"):
        Trace.load(bad)
    with pytest.raises(TraceSynthError, match="no such file"):
        Trace.load(tmp_path / "missing.parquet")
    pq.write_table(pa.table({"ts": [1]}), tmp_path / "other.parquet")
    with pytest.raises(TraceSynthError, match="other.parquet: .*lacks column"):
        Trace.load(tmp_path / "other.parquet")


def test_concat_unifies_dictionaries():
    a = small()
    b = Trace.from_columns(ts=[40, 50], event=["sched_wakeup", "syscall_entry_read"], cpu=[0, 0])
    c = Trace.concat([a, b])
    assert len(c) == 6 and c.column("event").to_pylist()[-1] == "syscall_entry_read"
    assert c.n_event_types == 5
    assert np.all(np.diff(c.ts) >= 0)


def test_save_failure_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(OSError):
        small().save(tmp_path / "x.parquet")
    assert list(tmp_path.iterdir()) == []


def test_split_by_time_is_contiguous_and_complete():
    from tracesynth.splits import split_by_time

    t = Trace.from_columns(ts=np.arange(100), event=["e"] * 100)
    parts = split_by_time(t, (0.8, 0.1, 0.1))
    assert [len(p) for p in parts] == [80, 10, 10]
    assert parts[0].ts[-1] < parts[1].ts[0] < parts[2].ts[0]
    with pytest.raises(TraceSynthError):
        split_by_time(t, (0.5, 0.2))


def test_saved_file_has_normal_permissions(tmp_path):
    import os
    import stat

    mask = os.umask(0o022)
    try:
        path = small().save(tmp_path / "t.parquet")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
