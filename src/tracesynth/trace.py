"""The Trace table: the one currency between readers, writers, models and evaluation.

Columns (pyarrow, one row per kernel event, sorted by time):

    ts     int64, ns, non-decreasing, never null
    event  dictionary<int32, string>, never null   e.g. syscall_entry_openat, sched_switch
    cpu    int32, null where the source has no CPU (strace)
    tid    int64, null where the thread is unknown (before a CPU's first sched_switch)
    comm   dictionary<int32, string>, null where unknown
    ret    int64, null except on syscall exits

Trace metadata (source format, workload, clock, host, ...) rides in the Parquet schema as one
JSON object under the key ``tracesynth``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracesynth.errors import TraceSynthError

_DICT = pa.dictionary(pa.int32(), pa.string())

SCHEMA = pa.schema(
    [
        pa.field("ts", pa.int64(), nullable=False),
        pa.field("event", _DICT, nullable=False),
        pa.field("cpu", pa.int32()),
        pa.field("tid", pa.int64()),
        pa.field("comm", _DICT),
        pa.field("ret", pa.int64()),
    ]
)
COLUMNS = tuple(SCHEMA.names)
METADATA_KEY = b"tracesynth"


def _as_arrow(values: Any, type_: pa.DataType, n: int) -> pa.Array | pa.ChunkedArray:
    if values is None:
        return pa.nulls(n, type=type_)
    if isinstance(values, pa.ChunkedArray | pa.Array):
        arr = values
    elif pa.types.is_dictionary(type_):
        arr = pa.array(values, type=pa.string())
    else:
        arr = pa.array(values, type=type_)
    if pa.types.is_dictionary(type_) and not pa.types.is_dictionary(arr.type):
        arr = pc.dictionary_encode(arr.cast(pa.string()))
    return arr.cast(type_)


class Trace:
    """A kernel execution trace as a columnar table plus its metadata."""

    def __init__(self, table: pa.Table, metadata: Mapping[str, Any] | None = None, validate: bool = True):
        meta = dict(_read_metadata(table.schema))
        meta.update(metadata or {})
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise TraceSynthError(f"trace table lacks column(s) {', '.join(missing)}")
        table = table.select(list(COLUMNS))
        if table.schema.remove_metadata() != SCHEMA:
            table = pa.table([_as_arrow(table[c], SCHEMA.field(c).type, len(table)) for c in COLUMNS], schema=SCHEMA)
        self.table = table.replace_schema_metadata(None).cast(SCHEMA)
        self.metadata: dict[str, Any] = meta
        if validate:
            self.validate()

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_columns(
        cls,
        ts: Any,
        event: Any,
        cpu: Any = None,
        tid: Any = None,
        comm: Any = None,
        ret: Any = None,
        metadata: Mapping[str, Any] | None = None,
        sort: bool = False,
    ) -> Trace:
        """Build a trace from column-like values (numpy arrays, lists or arrow arrays).

        With sort=True rows are stably sorted by ts (readers that merge per-CPU streams use it).
        """
        n = len(ts)
        cols = [
            _as_arrow(ts, pa.int64(), n),
            _as_arrow(event, _DICT, n),
            _as_arrow(cpu, pa.int32(), n),
            _as_arrow(tid, pa.int64(), n),
            _as_arrow(comm, _DICT, n),
            _as_arrow(ret, pa.int64(), n),
        ]
        table = pa.table(cols, schema=SCHEMA)
        if sort:
            order = np.argsort(table["ts"].to_numpy(), kind="stable")
            table = table.take(pa.array(order))
        return cls(table, metadata)

    @classmethod
    def concat(cls, traces: Sequence[Trace], metadata: Mapping[str, Any] | None = None) -> Trace:
        """Concatenate traces in order (callers keep time non-decreasing)."""
        if not traces:
            raise TraceSynthError("nothing to concatenate")
        table = pa.concat_tables([t.table for t in traces]).unify_dictionaries().combine_chunks()
        meta = dict(traces[0].metadata)
        meta.update(metadata or {})
        return cls(table, meta)

    # -- checks -------------------------------------------------------------------------------
    def validate(self, source: str | Path | None = None) -> None:
        """Raise TraceSynthError (naming `source`) unless the table obeys the Trace contract."""
        t = self.table
        for c in ("ts", "event"):
            if t[c].null_count:
                raise TraceSynthError(f"column {c!r} has {t[c].null_count} null value(s)", source)
        ts = self.ts
        if len(ts) > 1:
            bad = np.flatnonzero(ts[1:] < ts[:-1])  # not np.diff: it overflows on spans beyond 2**63 ns
            if len(bad):
                raise TraceSynthError(
                    f"timestamps decrease at row {int(bad[0]) + 1} ({int(ts[bad[0]])} -> {int(ts[bad[0] + 1])} ns)",
                    source,
                )

    # -- access -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.table.num_rows

    def __repr__(self) -> str:
        return f"Trace({len(self)} events, {self.n_event_types} event types, {self.duration_ns / 1e9:.3f} s)"

    def __eq__(self, other: object) -> bool:
        """Same rows, comparing decoded values (dictionary layouts may differ)."""
        if not isinstance(other, Trace) or len(self) != len(other):
            return False
        return all(self.column(c).equals(other.column(c)) for c in COLUMNS)

    def column(self, name: str) -> pa.Array:
        """One column as a single arrow array, dictionaries decoded to plain strings."""
        col = self.table[name].combine_chunks()
        if pa.types.is_dictionary(col.type):
            col = col.cast(pa.string())
        return col

    @property
    def ts(self) -> np.ndarray:
        return self.table["ts"].to_numpy()

    def codes(self, name: str = "event") -> tuple[np.ndarray, list[str]]:
        """(int32 codes, vocabulary) for a dictionary column; nulls get code -1."""
        col = self.table[name].unify_dictionaries().combine_chunks() if self.table[name].num_chunks else None
        if col is None or len(col) == 0:
            return np.zeros(0, dtype=np.int32), []
        codes = col.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
        return codes, col.dictionary.to_pylist()

    def numeric(self, name: str, fill: int = -1) -> np.ndarray:
        """A numeric column as int64 numpy, nulls replaced by `fill`."""
        return self.table[name].fill_null(fill).to_numpy().astype(np.int64, copy=False)

    @property
    def duration_ns(self) -> int:
        if len(self) == 0:
            return 0
        ts = self.ts
        return int(ts[-1]) - int(ts[0])  # Python ints: a span may exceed int64

    @property
    def n_event_types(self) -> int:
        return len(np.unique(self.codes("event")[0])) if len(self) else 0

    def event_counts(self) -> dict[str, int]:
        """Event type -> count, most frequent first."""
        vc = pc.value_counts(self.column("event"))
        pairs = [(v.as_py(), c.as_py()) for v, c in zip(vc.field("values"), vc.field("counts"), strict=True)]
        return dict(sorted(pairs, key=lambda p: (-p[1], p[0])))

    def slice(self, start: int, stop: int | None = None) -> Trace:
        stop = len(self) if stop is None else stop
        return Trace(self.table.slice(start, max(0, stop - start)), self.metadata, validate=False)

    def with_columns(self, **columns: Any) -> Trace:
        """A copy with some columns replaced (values as in from_columns)."""
        n = len(self)
        arrays = [_as_arrow(columns[c], SCHEMA.field(c).type, n) if c in columns else self.table[c] for c in COLUMNS]
        return Trace(pa.table(arrays, schema=SCHEMA), self.metadata)

    def summary(self) -> dict[str, Any]:
        """Numbers a person looks at first: size, span, vocabulary, threads, CPUs."""
        cpus = pc.unique(self.table["cpu"].drop_null()).to_pylist()
        tids = pc.unique(self.table["tid"].drop_null()).to_pylist()
        comms = pc.unique(self.column("comm").drop_null()).to_pylist()
        ret = self.table["ret"]
        return {
            "events": len(self),
            "duration_s": self.duration_ns / 1e9,
            "event_types": self.n_event_types,
            "cpus": sorted(cpus),
            "threads": len(tids),
            "commands": sorted(comms),
            "with_tid": len(self) - self.table["tid"].null_count,
            "with_ret": len(ret) - ret.null_count,
            "metadata": dict(self.metadata),
        }

    # -- storage ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write compressed Parquet atomically (no half-written file on failure)."""
        import pyarrow.parquet as pq  # here, not at import: a process that only reads a trace never loads it

        from atomicio import atomic_path

        path = Path(path)
        table = self.table.replace_schema_metadata({METADATA_KEY: json.dumps(self.metadata, sort_keys=True)})
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp, compression="zstd", compression_level=9)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read and validate a Parquet trace; any problem is one TraceSynthError naming the file."""
        import pyarrow.parquet as pq

        path = Path(path)
        if not path.is_file():
            raise TraceSynthError("no such file" if not path.exists() else "not a file", path)
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            raise TraceSynthError(f"not a readable Parquet file ({' '.join(str(exc).split())})", path) from None
        try:
            trace = cls(table, validate=False)
            trace.validate(path)
        except TraceSynthError as exc:
            if exc.path:
                raise
            raise TraceSynthError(str(exc), path) from None
        except (pa.ArrowException, ValueError) as exc:
            raise TraceSynthError(f"not a tracesynth trace ({' '.join(str(exc).split())})", path) from None
        return trace


def _read_metadata(schema: pa.Schema) -> dict[str, Any]:
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}
