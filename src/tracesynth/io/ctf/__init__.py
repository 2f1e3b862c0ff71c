"""A native CTF reader: CTF 1.8 (TSDL) and CTF 2 (JSON) metadata, data streams decoded by a
compiled core (tracesynth.io.ctf.fast: Cython, or numba) or by Python functions generated per
stream and event class, streams muxed into time order as babeltrace2 does, chunk by chunk
(tracesynth.io.ctf.stream), so memory does not grow with the trace beyond its output.

    from tracesynth.io.ctf import iter_native_batches, native_ctf_metadata

`iter_native_batches(path, fields)` yields the same pyarrow batches as
tracesynth.io.babeltrace.iter_ctf_batches (ts, event, cpu, one column per Field) and
`native_ctf_metadata(path)` the same dict as its ctf_metadata; both raise TraceSynthError naming
the damaged file. `decode_trace(path, wants)` is the layer below (ts may be null: a trace
without a clock).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracesynth.errors import TraceSynthError
from tracesynth.io.ctf import fast, stream
from tracesynth.io.ctf.compile import Unsupported
from tracesynth.io.ctf.ctf2 import is_ctf2, parse_ctf2
from tracesynth.io.ctf.decode import Want, compile_stream, member_names
from tracesynth.io.ctf.model import Clock, TraceClass
from tracesynth.io.ctf.stream import StreamFile, mux
from tracesynth.io.ctf.tsdl import TsdlError, depacketize, parse_tsdl

__all__ = [
    "Unsupported",
    "Want",
    "decode_trace",
    "iter_native_batches",
    "load_metadata",
    "native_batches",
    "native_ctf_metadata",
]
_DICT = pa.dictionary(pa.int32(), pa.string())
_I64 = (-(1 << 63), (1 << 63) - 1)


# the latest parses, by the metadata's bytes: a read asks twice (its fields, then its streams), and
# an LTTng kernel trace's metadata (~350 KB of TSDL) takes ~0.1 s to parse. Nothing changes a
# TraceClass once parsed, so the same one is handed out.
_PARSED: dict[bytes, TraceClass] = {}


def load_metadata(trace_dir: Path) -> TraceClass:
    """The TraceClass of one CTF trace directory (TraceSynthError naming `metadata` if it is bad)."""
    meta = trace_dir / "metadata"
    try:
        data = meta.read_bytes()
    except OSError as exc:
        raise TraceSynthError(f"cannot read ({exc.strerror})", meta) from None
    tc = _PARSED.get(data)
    if tc is not None:
        return tc
    try:
        text = depacketize(data)
        tc = parse_ctf2(text) if is_ctf2(text) else parse_tsdl(data)
    except (TsdlError, RecursionError) as exc:
        raise TraceSynthError(f"bad CTF metadata: {exc}", meta) from None
    for sc in tc.streams.values():  # ids are int64 in the columns (babeltrace2's go to 2**64, none that big is seen)
        if not all(_I64[0] <= i <= _I64[1] for i in (sc.id, *sc.events)):
            raise TraceSynthError("bad CTF metadata: a stream or event class id past the int64 range", meta)
    for name, clock in tc.clocks.items():  # timestamps are int64 ns from the clock's origin
        s, c = clock.normalised()
        if clock.freq > 0 and not _I64[0] <= s * 1_000_000_000 + c * 1_000_000_000 // clock.freq <= _I64[1]:
            raise TraceSynthError(f"bad CTF metadata: clock {name!r} has an offset past the int64 ns range", meta)
    if len(_PARSED) >= 4:
        _PARSED.pop(next(iter(_PARSED)))
    _PARSED[data] = tc
    return tc


def _stream_files(trace_dir: Path) -> list[Path]:
    return sorted(p for p in trace_dir.iterdir() if p.is_file() and p.name != "metadata" and not p.name.startswith("."))


def _ns(clock: Clock | None, raw: np.ndarray) -> np.ndarray | None:
    """ns from the clock's origin, as babeltrace2 computes it (offset calibrated, then cycles)."""
    if clock is None:
        return None
    s, c = clock.normalised()
    if clock.freq == 1_000_000_000:
        return raw.astype(np.int64) + np.int64(s * 1_000_000_000 + c)
    base = s * 1_000_000_000 + int(1e9 * float(c) / float(clock.freq))
    return (np.floor(1e9 * raw.astype(np.float64) / float(clock.freq))).astype(np.uint64).astype(np.int64) + base


def _to_ns(sf: StreamFile, raw: np.ndarray) -> np.ndarray | None:
    dec = sf.decoder or next(iter(sf.decoders.values()))
    sc = dec.sc
    return _ns(sf.tc.clocks.get(sc.clock) if sc.clock else None, raw)


def _open_streams(path: Path, wants: list[Want], words: list[dict[bytes, int]]) -> list[StreamFile]:
    """The stream files of the CTF trace(s) under `path`, their decoders compiled (TraceSynthError
    for bad metadata, Unsupported for a layout no decoder here handles)."""
    from tracesynth.io.ctf_dirs import find_ctf_metadata

    if not path.exists():
        raise TraceSynthError("no such file or directory", path)
    dirs = [m.parent for m in find_ctf_metadata(path)] if path.is_dir() else []
    if not dirs:
        raise TraceSynthError("directory holds no CTF trace (no 'metadata' file found)", path)
    found = []
    for i, d in enumerate(dirs):
        tc = load_metadata(d)
        try:
            decoders = {sid: compile_stream(tc, sc, wants) for sid, sc in tc.streams.items()}
        except RecursionError:
            raise TraceSynthError("bad CTF metadata: field classes nested too deeply", d / "metadata") from None
        for k, f in enumerate(_stream_files(d)):
            try:
                size = f.stat().st_size
            except OSError as exc:
                raise TraceSynthError(f"cannot read ({exc.strerror})", f) from None
            if size:
                found.append((i, k, f, size, tc, decoders))
    # the compiled core where the trace is big enough to repay loading it (any trace, for Cython's)
    least = stream.AOT_MIN_BYTES if fast.cheap() else stream.FAST_MIN_BYTES
    big = sum(x[3] for x in found) >= least and fast.kernels() is not None
    programs: dict[int, dict[int, fast.Program | None]] = {}
    for i, _, _, _, tc, decoders in found:
        if i not in programs:
            programs[i] = _programs(tc, decoders, wants) if big else {}
    buffers: dict = {}
    return [StreamFile(f, (i, k), tc, dec, programs[i], wants, words, buffers) for i, k, f, _, tc, dec in found]


def _programs(tc: TraceClass, decoders: dict, wants: list[Want]) -> dict[int, fast.Program | None]:
    programs: dict[int, fast.Program | None] = {}
    for sid, dec in decoders.items():
        try:
            programs[sid] = fast.compile_program(tc, dec.sc, dec.sources, wants)
        except (fast.FastUnsupported, Unsupported, RecursionError):
            programs[sid] = None  # the generated Python decoder reads this stream class
    return programs


def decode_trace(path: str | Path, wants: Sequence[Want]) -> dict[str, Any]:
    """Every event of the CTF trace(s) under `path`, muxed in time order.

    Returns {"ts": int64 ns or None (no clock), "event": int32 codes, "names": [...],
    "cpu": (values, valid), "columns": [(values, valid) per want]}.
    """
    wants = [*wants, Want("cpu_id", "int", "packet")]
    names: dict[str, int] = {}
    words: list[dict[bytes, int]] = [{} for _ in wants]
    blocks = list(mux(_open_streams(Path(path), wants, words), _to_ns, names))
    clockless = any(b[0] is None for b in blocks)
    ts = None if clockless else np.concatenate([b[0] for b in blocks] or [np.zeros(0, dtype=np.int64)])
    event = np.concatenate([b[1] for b in blocks] or [np.zeros(0, dtype=np.int32)])
    merged = []
    for j, w in enumerate(wants):
        empty = np.zeros(0, dtype=np.int64 if w.kind == "int" else object)
        vals = np.concatenate([b[2][j][0] for b in blocks] or [empty])
        valid = np.concatenate([b[2][j][1] for b in blocks] or [np.zeros(0, dtype=bool)])
        if w.kind != "int":  # codes -> the bytes (None where absent)
            table = np.empty(len(words[j]) + 1, dtype=object)
            table[:-1] = list(words[j])
            vals = table[vals]
        merged.append((vals, valid))
    return {"ts": ts, "event": event, "names": list(names), "cpu": merged[-1], "columns": merged[:-1]}


class _Words:
    """The decoded text of a string want's table, grown as batches need it (bad UTF-8 marked)."""

    def __init__(self, table: dict[bytes, int]) -> None:
        self.table = table
        self.text: list[str] = []
        self.bad: list[bool] = []

    def column(self, codes: np.ndarray) -> tuple[pa.Array, np.ndarray | None]:
        """A dictionary column (first appearance order) and which rows hold invalid UTF-8."""
        for b in list(self.table)[len(self.text) :]:
            try:
                self.text.append(b.decode("utf-8"))
                self.bad.append(False)
            except UnicodeDecodeError:  # kept, the bad bytes replaced, as the text path keeps them
                self.text.append(b.decode("utf-8", "replace"))
                self.bad.append(True)
        new, order = _first_seen(codes, len(self.text))
        bad = np.array(self.bad, dtype=bool)[order]
        arr = pa.DictionaryArray.from_arrays(
            pa.array(new, type=pa.int32(), mask=new < 0), pa.array([self.text[i] for i in order.tolist()], pa.string())
        )
        return arr, ((new >= 0) & bad[np.maximum(new, 0)]) if bad.any() else None


def _first_seen(codes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    jit = fast.loaded()
    if jit is not None:
        return jit.first_seen(codes.astype(np.int32, copy=False), k)
    ok = codes >= 0
    uniq, first, inv = np.unique(codes[ok], return_index=True, return_inverse=True)
    rank = np.empty(len(uniq), dtype=np.int32)
    rank[np.argsort(first, kind="stable")] = np.arange(len(uniq), dtype=np.int32)
    out = np.full(len(codes), -1, dtype=np.int32)
    out[ok] = rank[inv.ravel()]
    return out, uniq[np.argsort(first, kind="stable")]


def iter_native_batches(path: str | Path, fields: Sequence[Any], batch_rows: int = 1 << 20) -> Iterator[pa.RecordBatch]:
    """Batches like tracesynth.io.babeltrace.iter_ctf_batches, decoded natively."""
    yield from native_batches(path, fields, batch_rows)


def native_batches(path: str | Path, fields: Sequence[Any], batch_rows: int = 1 << 20) -> Iterator[pa.RecordBatch]:
    """iter_native_batches, with the metadata read and the decoders compiled before it returns
    (TraceSynthError or Unsupported raised here, before any batch)."""
    wants = [Want(f.name, f.kind, f.scope, f.events) for f in fields]
    wants.append(Want("cpu_id", "int", "packet"))
    words: list[dict[bytes, int]] = [{} for _ in wants]
    files = _open_streams(Path(path), wants, words)
    return _batches(path, fields, files, batch_rows, [_Words(w) for w in words])


def _batches(
    path: str | Path, fields: Sequence[Any], files: list[StreamFile], batch_rows: int, words: list[_Words]
) -> Iterator[pa.RecordBatch]:
    names: dict[str, int] = {}
    bad = 0
    for ts, event, cols in mux(files, _to_ns, names):
        if ts is None:
            raise TraceSynthError("the trace has no clock: its events carry no timestamps", path)
        for a in range(0, len(ts), batch_rows):
            sl = slice(a, min(len(ts), a + batch_rows))
            batch, nbad = _record_batch(fields, ts[sl], event[sl], names, [(v[sl], ok[sl]) for v, ok in cols], words)
            bad += nbad
            yield batch
    stream.release_free_memory()
    if bad:
        warnings.warn(
            f"{path}: {bad} event(s) hold invalid UTF-8 in a string field (corrupt trace?); "
            "kept with the bad bytes replaced by U+FFFD",
            stacklevel=3,
        )


def _mask(valid: np.ndarray) -> np.ndarray | None:
    """The null mask, or None when every row is valid (no validity bitmap for readers to scan)."""
    return None if valid.all() else ~valid


def _record_batch(
    fields: Sequence[Any], ts: np.ndarray, event: np.ndarray, names: dict, cols: list, words: list
) -> tuple[pa.RecordBatch, int]:
    """(the batch, rows with invalid UTF-8) of one slice; `cols` ends with the cpu column."""
    cpu, cpu_ok = cols[-1]
    # names in order of first appearance, as babeltrace2's text gives them
    codes, order = _first_seen(event, len(names))
    every = list(names)
    out: dict[str, pa.Array] = {
        "ts": pa.array(ts, pa.int64()),
        "event": pa.DictionaryArray.from_arrays(
            pa.array(codes, pa.int32()), pa.array([every[i] for i in order.tolist()], pa.string())
        ),
        "cpu": pa.array(cpu.astype(np.int32), pa.int32(), mask=_mask(cpu_ok)),
    }
    bad = np.zeros(len(ts), dtype=bool)
    for j, (f, (vals, valid)) in enumerate(zip(fields, cols[:-1], strict=True)):
        if f.kind == "int":
            out[f.out] = pa.array(vals, pa.int64(), mask=_mask(valid))
        else:
            out[f.out], rows = words[j].column(vals)
            if rows is not None:
                bad |= rows
    return pa.RecordBatch.from_pydict(out), int(np.count_nonzero(bad))


def native_ctf_metadata(path: str | Path) -> dict[str, Any]:
    """The dict tracesynth.io.babeltrace.ctf_metadata returns, from the native metadata parser."""
    tc = load_metadata(Path(path))
    strip = tc.version != "2"
    ctx: set[str] = set()
    fields: dict[str, set[str]] = {}
    for sc in tc.streams.values():
        ctx |= set(member_names(sc.event_context, strip))
        for ev in sc.events.values():
            ctx |= set(member_names(ev.context, strip))
            fields.setdefault(ev.name, set()).update(member_names(ev.payload, strip))
    clocks = [dict(c.info) or {"name": c.name, "freq": c.freq} for c in tc.clocks.values() if c.info]
    return {
        "env": dict(tc.env),
        "clocks": clocks,
        "uuid": tc.uuid,
        "context_fields": sorted(ctx),
        "event_fields": fields,
    }
