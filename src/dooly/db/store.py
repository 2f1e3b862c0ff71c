"""ProfileStore: the profile database, one SQLite file.

Every measurement is keyed by a :class:`ProfileContext` (hardware fingerprint, engine, attention backend,
dtype) and an operator signature key; each row is one point of request-symbol values with its timing
statistics. The file runs in WAL mode and every finished measurement is its own committed transaction, so a
profiling run killed at any instant (SIGKILL included) loses nothing it finished and resumes where it
stopped. Several processes (Ray workers on one host) may write to the same file; SQLite serialises them.

A database a user received from elsewhere is input, not trusted: an existing file is checked to be a dooly
profile database (its tables and schema marker, every column) before anything is written, and a foreign
SQLite file is refused untouched. ``ProfileStore(path, readonly=True)`` (the commands that only read) never
writes the file nor creates one: the database is copied into memory, where the trace cache may still be
filled for the run. A writable store creates its file on the first write only, whole (schema included, made
under a temporary name and linked into place, so a kill never leaves a 0-byte or schema-less file), and
removes a file it created when the run fails before measuring anything.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from atomicio import pid_alive
from dooly.core.errors import DoolyError

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS signatures (
    hardware TEXT NOT NULL, engine TEXT NOT NULL, backend TEXT NOT NULL, dtype TEXT NOT NULL,
    sig_key TEXT NOT NULL,
    sig_json TEXT NOT NULL,          -- the full signature, so the DB is readable without the tracer
    grid_size INTEGER,               -- points planned for this signature (NULL until planned)
    complete INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (hardware, engine, backend, dtype, sig_key)
);
CREATE TABLE IF NOT EXISTS points (
    hardware TEXT NOT NULL, engine TEXT NOT NULL, backend TEXT NOT NULL, dtype TEXT NOT NULL,
    sig_key TEXT NOT NULL,
    point TEXT NOT NULL,             -- canonical JSON of the request-symbol values
    median_s REAL NOT NULL, p10_s REAL NOT NULL, p90_s REAL NOT NULL,
    repeats INTEGER NOT NULL,
    cost_s REAL NOT NULL,            -- device seconds spent measuring this point (warm-up included)
    created REAL NOT NULL,
    PRIMARY KEY (hardware, engine, backend, dtype, sig_key, point)
);
CREATE TABLE IF NOT EXISTS forwards (  -- real end-to-end forward passes, for the framework-overhead fit
    hardware TEXT NOT NULL, engine TEXT NOT NULL, backend TEXT NOT NULL, dtype TEXT NOT NULL,
    model TEXT NOT NULL, phase TEXT NOT NULL,
    point TEXT NOT NULL,
    median_s REAL NOT NULL, p10_s REAL NOT NULL, p90_s REAL NOT NULL,
    repeats INTEGER NOT NULL, cost_s REAL NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (hardware, engine, backend, dtype, model, phase, point)
);
CREATE TABLE IF NOT EXISTS traces (   -- a model's traced operator list per phase (JSON from the tracer)
    engine TEXT NOT NULL, model TEXT NOT NULL, phase TEXT NOT NULL,
    trace_json TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (engine, model, phase)
);
"""


def canonical_point(values: Mapping[str, int | float]) -> str:
    """The one JSON spelling of a point (sorted keys, ints kept ints) used as its primary key."""
    return json.dumps(
        {str(k): (int(v) if float(v).is_integer() else float(v)) for k, v in values.items()},
        sort_keys=True,
        separators=(",", ":"),
    )


def hardware_fingerprint(device: str = "cpu", threads: int | None = None) -> str:
    """Name the hardware a timing is valid for: CPU model + cores + torch threads, or the GPU's name."""
    import torch

    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        return f"cuda:{props.name}:sm{props.major}{props.minor}:{props.total_memory // 2**30}GiB"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = threads if threads is not None else torch.get_num_threads()
    return f"cpu:{cpu}:cores{os.cpu_count()}:threads{threads}"


@dataclass(frozen=True)
class ProfileContext:
    """Everything besides the signature that a timing depends on."""

    hardware: str
    engine: str = "hf-eager"
    backend: str = "eager"
    dtype: str = "float32"

    def as_tuple(self) -> tuple[str, str, str, str]:
        return (self.hardware, self.engine, self.backend, self.dtype)


@dataclass(frozen=True)
class Measurement:
    """Timing statistics of one point (seconds)."""

    median_s: float
    p10_s: float
    p90_s: float
    repeats: int
    cost_s: float

    def row(self) -> tuple[float, float, float, int, float, float]:
        """The statistics as stored, followed by the time they are written."""
        return (self.median_s, self.p10_s, self.p90_s, self.repeats, self.cost_s, time.time())


def _schema_columns(con: sqlite3.Connection) -> dict[str, list[str]]:
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
    return {t: [r[1] for r in con.execute(f"PRAGMA table_info({t})")] for t in tables}


def _expected_columns() -> dict[str, list[str]]:
    con = sqlite3.connect(":memory:")
    con.executescript(_SCHEMA)
    try:
        return _schema_columns(con)
    finally:
        con.close()


_EXPECTED = _expected_columns()


def _json(col: str, kind: str, extra: str = "1") -> str:
    # CASE evaluates lazily: json_* is only applied to text that parses (it raises on a BLOB).
    return f"CASE WHEN typeof({col})='text' AND json_valid({col}) AND json_type({col})='{kind}' THEN {extra} ELSE 0 END"


#: JSON in a row nests at most this deep (a signature: 4, a trace: 6); past about 1000 Python's json.loads fails
#: with a RecursionError, while SQLite's json_valid accepts 2000
MAX_JSON_DEPTH = 64
# the depth of a container is the number of steps in its full path ($.a[0].b: 3)
_SHALLOW = (
    "NOT EXISTS (SELECT 1 FROM json_tree({c}) WHERE type IN ('array','object') AND "
    "(length(fullkey) - length(replace(fullkey, '[', ''))) + (length(fullkey) - length(replace(fullkey, '.', '')))"
    f" > {MAX_JSON_DEPTH})"
)
_TEXT = "typeof({c})='text'"
_TIMING = "typeof({c}) IN ('real','integer') AND {c} >= 0 AND {c} < 1e6"  # seconds: no NaN, inf or negative
_POINT = _json(
    "point",
    "object",
    "NOT EXISTS (SELECT 1 FROM json_each(point) WHERE type NOT IN ('integer','real') OR abs(value) >= 9.2e18)",
)
_CONTEXT = {c: _TEXT for c in ("hardware", "engine", "backend", "dtype")}
_MEASURED = {
    **{c: _TIMING for c in ("median_s", "p10_s", "p90_s", "cost_s")},
    "repeats": "typeof({c})='integer' AND {c} BETWEEN 1 AND 2147483647",
    "created": "typeof({c}) IN ('real','integer')",
    "point": _POINT,
}
#: What every stored value must look like, per table and column. Checked once when a file is opened, so every
#: reader (the raw SQL of the report included) can trust the types: a damaged or hand-edited row is refused.
_ROW_CHECKS: dict[str, dict[str, str]] = {
    "points": {**_CONTEXT, "sig_key": _TEXT, **_MEASURED},
    "forwards": {**_CONTEXT, "model": _TEXT, "phase": _TEXT, **_MEASURED},
    "signatures": {
        **_CONTEXT,
        "sig_key": _TEXT,
        "sig_json": _json("sig_json", "object", _SHALLOW.format(c="sig_json")),
        "grid_size": "{c} IS NULL OR (typeof({c})='integer' AND {c} BETWEEN 0 AND 2147483647)",
        "complete": "{c} IN (0, 1)",
    },
    "traces": {
        "engine": _TEXT,
        "model": _TEXT,
        "phase": _TEXT,
        "created": "typeof({c}) IN ('real','integer')",
        # a tracer trace (records: a list) or the config the calibration stored (no records)
        "trace_json": _json(
            "trace_json",
            "object",
            "COALESCE(json_type(trace_json, '$.records'), 'array') = 'array' AND " + _SHALLOW.format(c="trace_json"),
        ),
    },
}


def _check_rows(con: sqlite3.Connection, path: Path) -> None:
    for table, checks in _ROW_CHECKS.items():
        conds = {col: f"COALESCE(({cond.format(c=col)}), 0)" for col, cond in checks.items()}  # NULL is bad
        try:
            bad = con.execute(
                f"SELECT rowid FROM {table} WHERE NOT ({' AND '.join(conds.values())}) LIMIT 1"
            ).fetchone()
            if bad is None:
                continue
            row = con.execute(f"SELECT {', '.join(conds.values())} FROM {table} WHERE rowid=?", bad).fetchone()
            cols = [c for c, ok in zip(conds, row, strict=True) if not ok]
        except sqlite3.DatabaseError as exc:
            raise DoolyError(f"{path}: damaged profile database ({exc})") from None
        raise DoolyError(f"{path}: damaged profile database (row {bad[0]} of {table}: bad {', '.join(cols)})")


def _writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK)


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute().parent
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_dooly(con: sqlite3.Connection, path: Path) -> None:
    """Raise a one-line DoolyError unless ``con`` holds a dooly profile database of this schema version."""
    try:
        cols = _schema_columns(con)
    except sqlite3.OperationalError as exc:
        if "unable to open" in str(exc):
            raise  # the file could not be opened at all: the caller knows why (read-only directory)
        raise DoolyError(f"{path}: not a dooly profile database ({exc})") from None
    except sqlite3.DatabaseError as exc:
        raise DoolyError(f"{path}: not a dooly profile database ({exc})") from None
    if "meta" not in cols:
        have = ", ".join(sorted(cols)) or "no tables"
        raise DoolyError(f"{path}: not a dooly profile database ({have}); refusing to touch it")
    try:
        row = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.DatabaseError as exc:
        raise DoolyError(f"{path}: not a dooly profile database ({exc})") from None
    if row is None:
        raise DoolyError(f"{path}: not a dooly profile database (no schema_version in its meta table)")
    if str(row[0]) != str(SCHEMA_VERSION):
        raise DoolyError(f"{path}: profile database schema {row[0]!r}, expected {SCHEMA_VERSION}")
    for table, want in _EXPECTED.items():
        if cols.get(table) != want:
            raise DoolyError(
                f"{path}: not a dooly profile database of schema {SCHEMA_VERSION} (table {table}: columns "
                f"{cols.get(table)}, expected {want})"
            )
    try:
        ok = con.execute("PRAGMA quick_check(1)").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        ok = str(exc)
    if ok != "ok":
        raise DoolyError(f"{path}: damaged profile database ({' '.join(str(ok).split())[:160]})")  # one line
    _check_rows(con, path)


def _text(raw: bytes) -> str:
    # A damaged file may hold invalid UTF-8 where text belongs; it then fails as bad JSON, in one line.
    return raw.decode("utf-8", "replace")


def _connect(target: str, **kw: Any) -> sqlite3.Connection:
    con = sqlite3.connect(target, **kw)
    con.text_factory = _text
    return con


def _uri(path: Path, **params: str) -> str:
    return f"file:{urllib.parse.quote(str(path.absolute()))}?" + urllib.parse.urlencode(params)


def open_readonly(path: str | Path) -> sqlite3.Connection:
    """A read-only connection to the dooly profile database at ``path`` (which must exist), checked.

    Nothing is written to the file, and no file is created beside it: without a ``-wal`` file (no writer
    active, no killed run's commits pending) the file holds the whole database and is opened as immutable.
    With one, SQLite must read it (and add the ``-shm`` index next to it), unless the directory is read-only:
    then no one can be writing there and the file alone is read.
    """
    path = Path(path)
    if not os.access(path, os.R_OK):
        raise DoolyError(f"{path}: cannot read the profile database (permission denied)")
    wal = Path(f"{path}-wal")
    if wal.exists() and wal.stat().st_size > 0:
        con = _connect(_uri(path, mode="ro"), uri=True, timeout=60.0)
        try:
            _check_dooly(con, path)
            return con
        except sqlite3.OperationalError as exc:
            con.close()
            if _writable(path.parent):
                raise DoolyError(f"{path}: cannot open the profile database ({exc})") from None
        except BaseException:
            con.close()
            raise
    con = _connect(_uri(path, mode="ro", immutable="1"), uri=True)
    try:
        _check_dooly(con, path)
    except sqlite3.DatabaseError as exc:
        con.close()
        raise DoolyError(f"{path}: cannot open the profile database ({exc})") from None
    except BaseException:
        con.close()
        raise
    return con


def _memory_db() -> sqlite3.Connection:
    con = _connect(":memory:", isolation_level=None)
    con.executescript(_SCHEMA)
    con.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    return con


def _empty(path: Path) -> bool:
    """A 0-byte file with no committed writes beside it (an older dooly's, killed as it created the file)."""
    wal = Path(f"{path}-wal")
    return path.stat().st_size == 0 and not (wal.exists() and wal.stat().st_size > 0)


def _create_atomically(path: Path) -> bool:
    """Make the database file with its whole schema under a temporary name beside it, then link it into place:
    a run killed at any instant leaves either no file or a valid empty database, never a 0-byte file or one
    whose schema sits only in a ``-wal`` file. Returns whether this call created it (another process may have
    meanwhile: its file is kept). A 0-byte file at ``path`` is replaced."""
    for stale in path.parent.glob(f".{path.name}.*.new"):  # left by a run killed within the few ms below
        pid = stale.name[len(path.name) + 2 : -len(".new")]
        if pid.isdigit() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.new"
    tmp.unlink(missing_ok=True)
    try:
        con = _connect(str(tmp), isolation_level=None)
        try:
            con.executescript(_SCHEMA)
            con.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            con.execute("PRAGMA journal_mode=WAL")  # kept in the file's header; the -wal file goes on close
        finally:
            con.close()
        if path.exists():  # a 0-byte file: nothing to keep
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)  # fails where the file appeared meanwhile: never replace another run's database
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links
            if path.exists():
                return False
            os.rename(tmp, path)
        return True
    except sqlite3.DatabaseError as exc:
        raise DoolyError(f"{path}: cannot create the profile database ({exc})") from None
    finally:
        tmp.unlink(missing_ok=True)


class ProfileStore:
    """The profile database. Open it with ``ProfileStore(path)``; use as a context manager to close it.

    ``readonly=True``: read the file (which may be absent: an empty store) without ever writing it.
    """

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self._created = False  # this run created the file (removed again if the run fails before measuring)
        self._pending = False  # the file does not exist yet: created on the first write
        if self.path.is_dir():
            raise DoolyError(f"{self.path}: is a directory, expected a profile database file")
        exists = self.path.exists()
        empty = exists and _empty(self.path)  # e.g. left behind by an older dooly: nothing to keep
        if readonly:
            self._db = _memory_db() if not exists or empty else self._snapshot()
            return
        if not exists or empty:
            parent = self.path.parent if exists else _existing_ancestor(self.path)
            if not _writable(parent):
                raise DoolyError(
                    f"{self.path}: cannot create the profile database: {parent} is read-only "
                    "(pass --db a path in a writable directory)"
                )
            self._db, self._pending = _memory_db(), True
            return
        open_readonly(self.path).close()  # a foreign or damaged file is refused before anything is written
        if not os.access(self.path, os.W_OK):
            raise DoolyError(
                f"{self.path}: the profile database is read-only (file permissions or a read-only file system); "
                "commands that only read it work, to profile into it make it writable or copy it"
            )
        if not _writable(self.path.parent):
            raise DoolyError(
                f"{self.path}: its directory {self.path.parent} is read-only, and SQLite must create "
                f"{self.path.name}-wal beside the database to write it; commands that only read it work, "
                "to profile into it copy it to a writable directory"
            )
        self._db = self._connect_rw()

    def _snapshot(self) -> sqlite3.Connection:
        src = open_readonly(self.path)  # checked, quick_check included
        mem = _connect(":memory:", isolation_level=None)
        try:
            src.backup(mem)
        except sqlite3.DatabaseError as exc:
            mem.close()
            raise DoolyError(f"{self.path}: damaged profile database ({exc})") from None
        finally:
            src.close()
        return mem

    def _connect_rw(self) -> sqlite3.Connection:
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves so each measurement is one transaction.
            db = _connect(str(self.path), timeout=60.0, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process kills
            db.execute("PRAGMA busy_timeout=60000")
            return db
        except sqlite3.DatabaseError as exc:
            raise DoolyError(f"{self.path}: cannot open the profile database for writing ({exc})") from None

    def _materialise(self) -> None:
        """Create the file on the first write (nothing was written to the in-memory stand-in)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or _empty(self.path):
            self._created = _create_atomically(self.path)
        db = self._connect_rw()
        try:
            db.execute("BEGIN IMMEDIATE")  # one transaction: a kill leaves either no schema or all of it
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            db.close()
            raise DoolyError(f"{self.path}: cannot create the profile database ({exc})") from None
        self._db.close()
        self._db, self._pending = db, False

    # -- plumbing -----------------------------------------------------------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        if self._pending:
            try:
                self._materialise()
            except OSError as exc:
                raise DoolyError(f"{self.path}: cannot create the profile database ({exc.strerror})") from None
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as exc:
            raise DoolyError(f"{self.path}: cannot write the profile database ({exc})") from None
        try:
            yield self._db
        except sqlite3.DatabaseError as exc:
            self._db.execute("ROLLBACK")
            raise DoolyError(f"{self.path}: cannot write the profile database ({exc})") from None
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        else:
            self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ProfileStore:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and self._created and not self._measured():
            self.close()
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            return
        self.close()

    def _measured(self) -> bool:
        """Whether the file holds a measurement (a failed first run that holds none leaves no file behind)."""
        try:
            return any(self._db.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone() for t in ("points", "forwards"))
        except sqlite3.DatabaseError:
            return True

    # -- signatures ---------------------------------------------------------------------------------------
    def register_signature(self, ctx: ProfileContext, sig_key: str, sig_json: str, grid_size: int | None) -> None:
        """Record a signature (idempotent); a new grid size re-opens it if the grid grew."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO signatures VALUES (?,?,?,?,?,?,?,0) ON CONFLICT DO UPDATE SET "
                "grid_size=excluded.grid_size, complete=CASE WHEN excluded.grid_size > COALESCE(grid_size, 0) "
                "THEN 0 ELSE complete END",
                (*ctx.as_tuple(), sig_key, sig_json, grid_size),
            )

    def mark_complete(self, ctx: ProfileContext, sig_key: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE signatures SET complete=1 WHERE hardware=? AND engine=? AND backend=? AND dtype=? "
                "AND sig_key=?",
                (*ctx.as_tuple(), sig_key),
            )

    def is_complete(self, ctx: ProfileContext, sig_key: str) -> bool:
        row = self._db.execute(
            "SELECT complete FROM signatures WHERE hardware=? AND engine=? AND backend=? AND dtype=? AND sig_key=?",
            (*ctx.as_tuple(), sig_key),
        ).fetchone()
        return bool(row and row[0])

    def complete_keys(self, ctx: ProfileContext) -> set[str]:
        rows = self._db.execute(
            "SELECT sig_key FROM signatures WHERE hardware=? AND engine=? AND backend=? AND dtype=? AND complete=1",
            ctx.as_tuple(),
        )
        return {r[0] for r in rows}

    def signature_json(self, ctx: ProfileContext, sig_key: str) -> str | None:
        row = self._db.execute(
            "SELECT sig_json FROM signatures WHERE hardware=? AND engine=? AND backend=? AND dtype=? AND sig_key=?",
            (*ctx.as_tuple(), sig_key),
        ).fetchone()
        return row[0] if row else None

    # -- points -------------------------------------------------------------------------------------------
    def put_point(self, ctx: ProfileContext, sig_key: str, values: Mapping[str, int | float], m: Measurement) -> None:
        """Store one finished measurement in its own committed transaction."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO points VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    *ctx.as_tuple(),
                    sig_key,
                    canonical_point(values),
                    *m.row(),
                ),
            )

    def done_points(self, ctx: ProfileContext, sig_key: str) -> set[str]:
        rows = self._db.execute(
            "SELECT point FROM points WHERE hardware=? AND engine=? AND backend=? AND dtype=? AND sig_key=?",
            (*ctx.as_tuple(), sig_key),
        )
        return {r[0] for r in rows}

    def points(self, ctx: ProfileContext, sig_key: str) -> list[tuple[dict[str, float], Measurement]]:
        rows = self._db.execute(
            "SELECT point, median_s, p10_s, p90_s, repeats, cost_s FROM points WHERE hardware=? AND engine=? "
            "AND backend=? AND dtype=? AND sig_key=? ORDER BY point",
            (*ctx.as_tuple(), sig_key),
        )
        return [(json.loads(p), Measurement(*rest)) for p, *rest in rows]

    def all_points(self, ctx: ProfileContext) -> dict[str, list[tuple[dict[str, float], Measurement]]]:
        """Every point of every signature under ``ctx`` (one query, for loading a predictor)."""
        out: dict[str, list[tuple[dict[str, float], Measurement]]] = {}
        rows = self._db.execute(
            "SELECT sig_key, point, median_s, p10_s, p90_s, repeats, cost_s FROM points WHERE hardware=? AND "
            "engine=? AND backend=? AND dtype=?",
            ctx.as_tuple(),
        )
        for key, p, *rest in rows:
            out.setdefault(key, []).append((json.loads(p), Measurement(*rest)))
        return out

    def signature_costs(self, ctx: ProfileContext) -> dict[str, float]:
        """Measured profiling cost (device seconds) per signature under ``ctx``."""
        rows = self._db.execute(
            "SELECT sig_key, SUM(cost_s) FROM points WHERE hardware=? AND engine=? AND backend=? AND dtype=? "
            "GROUP BY sig_key",
            ctx.as_tuple(),
        )
        return {k: float(c) for k, c in rows}

    # -- end-to-end forwards ------------------------------------------------------------------------------
    def put_forward(
        self, ctx: ProfileContext, model: str, phase: str, values: Mapping[str, Any], m: Measurement
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO forwards VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    *ctx.as_tuple(),
                    model,
                    phase,
                    canonical_point(values),
                    *m.row(),
                ),
            )

    def forwards(self, ctx: ProfileContext, model: str | None = None) -> list[tuple[str, str, dict, Measurement]]:
        """Stored forward measurements: (model, phase, point values, measurement)."""
        q = (
            "SELECT model, phase, point, median_s, p10_s, p90_s, repeats, cost_s FROM forwards WHERE hardware=? "
            "AND engine=? AND backend=? AND dtype=?"
        )
        args: tuple = ctx.as_tuple()
        if model is not None:
            q += " AND model=?"
            args = (*args, model)
        return [
            (mo, ph, json.loads(p), Measurement(*rest))
            for mo, ph, p, *rest in self._db.execute(q + " ORDER BY 1,2,3", args)
        ]

    # -- traces -------------------------------------------------------------------------------------------
    def put_trace(self, engine: str, model: str, phase: str, trace_json: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO traces VALUES (?,?,?,?,?)", (engine, model, phase, trace_json, time.time())
            )

    def get_trace(self, engine: str, model: str, phase: str) -> str | None:
        row = self._db.execute(
            "SELECT trace_json FROM traces WHERE engine=? AND model=? AND phase=?", (engine, model, phase)
        ).fetchone()
        return row[0] if row else None

    # -- summaries ----------------------------------------------------------------------------------------
    def contexts(self) -> list[ProfileContext]:
        rows = self._db.execute("SELECT DISTINCT hardware, engine, backend, dtype FROM signatures ORDER BY 1,2,3,4")
        return [ProfileContext(*r) for r in rows]

    def summary(self) -> dict[str, Any]:
        n_sig = self._db.execute("SELECT COUNT(*), SUM(complete) FROM signatures").fetchone()
        n_pts, cost = self._db.execute("SELECT COUNT(*), COALESCE(SUM(cost_s), 0) FROM points").fetchone()
        return {
            "signatures": n_sig[0],
            "complete": n_sig[1] or 0,
            "points": n_pts,
            "cost_s": cost,
            "contexts": [asdict(c) for c in self.contexts()],
        }


def profile_command(model: object, db: str | Path, name: str) -> str:
    """The `dooly profile` command line that fills ``db`` for ``model`` as the user gave it: a zoo name or a path
    (a config's file stem is no model name), or ``name`` for a config dict, which has no command-line spelling."""
    import shlex

    from dooly.core.zoo import ModelSpec

    if isinstance(model, ModelSpec):  # resolved once: the argument it came from
        model = model.source
    arg = str(model) if isinstance(model, str | Path) else name
    return f"dooly profile {shlex.quote(arg)} --db {shlex.quote(str(db))}"
