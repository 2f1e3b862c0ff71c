"""ProfileStore: the profile database, one SQLite file.

Every measurement is keyed by a :class:`ProfileContext` (hardware fingerprint, engine, attention backend,
dtype) and an operator signature key; each row is one point of request-symbol values with its timing
statistics. The file runs in WAL mode and every finished measurement is its own committed transaction, so a
profiling run killed at any instant (SIGKILL included) loses nothing it finished and resumes where it
stopped. Several processes (Ray workers on one host) may write to the same file; SQLite serialises them.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dooly.errors import DoolyError

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


class ProfileStore:
    """The profile database. Open it with ``ProfileStore(path)``; use as a context manager to close it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise DoolyError(f"{self.path}: is a directory, expected a profile database file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves so each measurement is one transaction.
            self._db = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process kills
            self._db.execute("PRAGMA busy_timeout=60000")
            with self._tx():
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        self._db.execute(stmt)
                self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise DoolyError(f"{self.path}: not a dooly profile database ({exc})") from None
        if row is None or int(row[0]) != SCHEMA_VERSION:
            raise DoolyError(f"{self.path}: profile database schema {row and row[0]}, expected {SCHEMA_VERSION}")

    # -- plumbing -----------------------------------------------------------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        else:
            self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ProfileStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
