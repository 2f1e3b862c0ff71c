"""A native CTF reader: CTF 1.8 (TSDL) and CTF 2 (JSON) metadata, data streams decoded by Python
functions generated per stream and event class, streams muxed into time order as babeltrace2 does.

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
from tracesynth.io.ctf.compile import CtfDecodeError, Unsupported
from tracesynth.io.ctf.ctf2 import is_ctf2, parse_ctf2
from tracesynth.io.ctf.decode import StreamData, Want, compile_stream, decode_file, member_names
from tracesynth.io.ctf.model import Clock, TraceClass
from tracesynth.io.ctf.tsdl import TsdlError, depacketize, parse_tsdl

__all__ = ["Unsupported", "Want", "decode_trace", "iter_native_batches", "load_metadata", "native_ctf_metadata"]
_DICT = pa.dictionary(pa.int32(), pa.string())


def load_metadata(trace_dir: Path) -> TraceClass:
    """The TraceClass of one CTF trace directory (TraceSynthError naming `metadata` if it is bad)."""
    meta = trace_dir / "metadata"
    try:
        data = meta.read_bytes()
    except OSError as exc:
        raise TraceSynthError(f"cannot read ({exc.strerror})", meta) from None
    try:
        text = depacketize(data)
        return parse_ctf2(text) if is_ctf2(text) else parse_tsdl(data)
    except (TsdlError, RecursionError) as exc:
        raise TraceSynthError(f"bad CTF metadata: {exc}", meta) from None


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


def _want_column(sd: StreamData, j: int, w: Want) -> tuple[np.ndarray, np.ndarray]:
    """(values, valid) of Want j over one stream's rows (values int64 or object bytes)."""
    n = len(sd.ids)
    vals = np.zeros(n, dtype=np.int64) if w.kind == "int" else np.full(n, None, dtype=object)
    valid = np.zeros(n, dtype=bool)
    if not n:
        return vals, valid
    dec = sd.decoder
    ids = np.frombuffer(sd.ids, dtype=np.int64)
    eids = np.array(sorted(dec.sources), dtype=np.int64)
    at = np.searchsorted(eids, ids)  # every id decoded is one of the stream class's
    for level, key in (("packet.context", "packet"), ("event.common_context", "common")):
        use = np.array([(dec.sources[e][j] or ("", ""))[0] == level for e in eids.tolist()], dtype=bool)
        rows = np.flatnonzero(use[at])
        if not len(rows):
            continue
        slots = {dec.sources[e][j][1] for e in eids[use].tolist()}
        for slot in slots:
            k = dec.slots[key].index(slot)
            if level == "packet.context":
                got = np.repeat(_values([pv[k] for _, _, pv in sd.packets], w.kind), [c for _, c, _ in sd.packets])
            else:
                got = _values([r[k + 1] for r in sd.common], w.kind)
            sel = rows if len(slots) == 1 else rows[[dec.sources[int(eids[at[r]])][j][1] == slot for r in rows]]
            _put(vals, valid, sel, got[sel])
    for eid, row in dec.sources.items():
        src = row[j]
        recs = sd.records.get(eid)
        if src is None or src[0] in ("packet.context", "event.common_context") or not recs:
            continue
        k = 1 + _event_slots(dec, eid).index(src[1])
        _put(vals, valid, np.array([r[0] for r in recs], dtype=np.int64), _values([r[k] for r in recs], w.kind))
    return vals, valid


def _event_slots(dec: Any, eid: int) -> list[str]:
    glb = dec.run.__globals__
    return glb[f"S_{glb['EV_NAMES'][eid]}"]


def _values(got: list, kind: str) -> np.ndarray:
    """Python values as an int64 array (None kept as a masked 0 via _put) or an object array."""
    if kind != "int":
        out = np.empty(len(got), dtype=object)
        out[:] = got
        return out
    try:
        return np.array(got, dtype=np.int64)
    except (TypeError, OverflowError):
        # None, or a uint64 above 2**63: wraps like C's int64 cast (as the text path reads it)
        out = np.array([((g + (1 << 63)) % (1 << 64)) - (1 << 63) if g is not None else 0 for g in got], np.int64)
        nulls = np.array([g is None for g in got], dtype=bool)
        return np.ma.masked_array(out, mask=nulls) if nulls.any() else out


def _put(vals: np.ndarray, valid: np.ndarray, rows: np.ndarray, got: np.ndarray) -> None:
    if isinstance(got, np.ma.MaskedArray):
        ok = ~np.ma.getmaskarray(got)
        vals[rows] = got.filled(0)
        valid[rows] = ok
    elif got.dtype == object:
        vals[rows] = got
        valid[rows] = np.array([g is not None for g in got], dtype=bool)
    else:
        vals[rows] = got
        valid[rows] = True


def _decode_dir(trace_dir: Path, wants: list[Want], rank0: int) -> list[tuple[tuple, StreamData, TraceClass]]:
    tc = load_metadata(trace_dir)
    try:
        decoders = {sid: compile_stream(tc, sc, wants) for sid, sc in tc.streams.items()}
    except RecursionError:
        raise TraceSynthError("bad CTF metadata: field classes nested too deeply", trace_dir / "metadata") from None
    out = []
    for k, f in enumerate(_stream_files(trace_dir)):
        try:
            data = f.read_bytes()
        except OSError as exc:
            raise TraceSynthError(f"cannot read ({exc.strerror})", f) from None
        if not data:
            continue
        try:
            sd = decode_file(tc, decoders, data)
        except (CtfDecodeError, Unsupported, RecursionError) as exc:
            raise TraceSynthError(f"cannot read this trace (truncated or corrupt?): {exc}", f) from None
        # babeltrace2's muxer breaks timestamp ties by stream class id, then stream id
        inst = sd.instance if sd.instance is not None else k
        out.append(((rank0, sd.decoder.sc.id, inst, k), sd, tc))
    return out


def decode_trace(path: str | Path, wants: Sequence[Want]) -> dict[str, Any]:
    """Every event of the CTF trace(s) under `path`, muxed in time order.

    Returns {"ts": int64 ns or None (no clock), "event": int32 codes, "names": [...],
    "cpu": (values, valid), "columns": [(values, valid) per want]}.
    """
    from tracesynth.io import find_ctf_metadata

    path = Path(path)
    if not path.exists():
        raise TraceSynthError("no such file or directory", path)
    dirs = [m.parent for m in find_ctf_metadata(path)] if path.is_dir() else []
    if not dirs:
        raise TraceSynthError("directory holds no CTF trace (no 'metadata' file found)", path)
    wants = [*wants, Want("cpu_id", "int", "packet")]
    streams = []
    for i, d in enumerate(dirs):
        streams += _decode_dir(d, wants, i)
    streams.sort(key=lambda s: s[0])
    names: dict[str, int] = {}
    parts: dict[str, list] = {"ts": [], "event": [], "rank": []}
    cols: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in wants]
    clockless = False
    for r, (_, sd, tc) in enumerate(streams):
        raw = np.frombuffer(sd.ts, dtype=np.uint64) if len(sd.ts) else np.zeros(0, dtype=np.uint64)
        sc = sd.decoder.sc
        ns = _ns(tc.clocks.get(sc.clock) if sc.clock else None, raw)
        clockless |= ns is None
        parts["ts"].append(ns if ns is not None else np.zeros(len(raw), dtype=np.int64))
        ids = np.frombuffer(sd.ids, dtype=np.int64) if len(sd.ids) else np.zeros(0, dtype=np.int64)
        lut = {eid: names.setdefault(ev.name, len(names)) for eid, ev in sc.events.items()}
        parts["event"].append(np.array([lut[i] for i in ids.tolist()], dtype=np.int32) if len(ids) else ids[:0])
        parts["rank"].append(np.full(len(ids), r, dtype=np.int32))
        for j, w in enumerate(wants):
            cols[j].append(_want_column(sd, j, w))
    ts = np.concatenate(parts["ts"]) if parts["ts"] else np.zeros(0, dtype=np.int64)
    rank = np.concatenate(parts["rank"]) if parts["rank"] else np.zeros(0, dtype=np.int32)
    order = np.arange(len(ts)) if clockless else np.lexsort((rank, ts))
    event = (np.concatenate(parts["event"]) if parts["event"] else np.zeros(0, dtype=np.int32))[order]
    merged = []
    for j in range(len(wants)):
        vals = np.concatenate([c[0] for c in cols[j]]) if cols[j] else np.zeros(0, dtype=np.int64)
        valid = np.concatenate([c[1] for c in cols[j]]) if cols[j] else np.zeros(0, dtype=bool)
        merged.append((vals[order], valid[order]))
    return {
        "ts": None if clockless else ts[order],
        "event": event,
        "names": list(names),
        "cpu": merged[-1],
        "columns": merged[:-1],
    }


def _str_column(vals: np.ndarray, valid: np.ndarray, bad_rows: set[int], a: int) -> pa.Array:
    """A dictionary column of decoded strings (first appearance order); rows whose bytes are not
    UTF-8 go to `bad_rows` (kept, the bad bytes replaced by U+FFFD, as the text path keeps them)."""
    codes = np.full(len(vals), -1, dtype=np.int32)
    lut: dict[bytes, int] = {}
    for i in np.flatnonzero(valid).tolist():
        codes[i] = lut.setdefault(vals[i], len(lut))
    words = []
    for k, b in enumerate(lut):
        try:
            words.append(bytes(b).decode("utf-8"))
        except UnicodeDecodeError:
            words.append(bytes(b).decode("utf-8", "replace"))
            bad_rows.update((np.flatnonzero(codes == k) + a).tolist())
    return pa.DictionaryArray.from_arrays(
        pa.array(codes, type=pa.int32(), mask=codes < 0), pa.array(words, pa.string())
    )


def iter_native_batches(path: str | Path, fields: Sequence[Any], batch_rows: int = 1 << 20) -> Iterator[pa.RecordBatch]:
    """Batches like tracesynth.io.babeltrace.iter_ctf_batches, decoded natively."""
    wants = [Want(f.name, f.kind, f.scope, f.events) for f in fields]
    got = decode_trace(path, wants)
    if got["ts"] is None:
        raise TraceSynthError("the trace has no clock: its events carry no timestamps", path)
    n = len(got["ts"])
    bad: set[int] = set()
    for a in range(0, n, batch_rows):
        sl = slice(a, min(n, a + batch_rows))
        cpu, cpu_ok = got["cpu"]
        # names in order of first appearance, as babeltrace2's text gives them
        uniq, first, codes = np.unique(got["event"][sl], return_index=True, return_inverse=True)
        rank = np.empty(len(uniq), dtype=np.int32)
        rank[np.argsort(first, kind="stable")] = np.arange(len(uniq), dtype=np.int32)
        names = pa.array([got["names"][u] for u in uniq[np.argsort(first, kind="stable")].tolist()], pa.string())
        cols: dict[str, pa.Array] = {
            "ts": pa.array(got["ts"][sl], pa.int64()),
            "event": pa.DictionaryArray.from_arrays(pa.array(rank[codes.ravel()], pa.int32()), names),
            "cpu": pa.array(cpu[sl].astype(np.int32), pa.int32(), mask=~cpu_ok[sl]),
        }
        for f, (vals, valid) in zip(fields, got["columns"], strict=True):
            if f.kind == "int":
                cols[f.out] = pa.array(vals[sl], pa.int64(), mask=~valid[sl])
            else:
                cols[f.out] = _str_column(vals[sl], valid[sl], bad, a)
        yield pa.RecordBatch.from_pydict(cols)
    if bad:
        warnings.warn(
            f"{path}: {len(bad)} event(s) hold invalid UTF-8 in a string field (corrupt trace?); "
            "kept with the bad bytes replaced by U+FFFD",
            stacklevel=3,
        )


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
