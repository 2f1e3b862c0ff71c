"""Decode one stream file incrementally, in chunks of events, and mux the streams of a trace.

A stream file is memory-mapped and read packet by packet: the packet header and context by the
generated Python function (few per file), the events by the compiled core
(tracesynth.io.ctf.fast) into fixed-size column buffers, a chunk at a time. A stream class the
core cannot express, and the rest of a file from a packet the core stops on, go through the
Python decoder (tracesynth.io.ctf.decode), which reports damage as it always has.

`mux` merges the streams' chunks into time order, in blocks: an event is emitted once every
stream that may still hold an earlier one has been read past it, so memory holds about one chunk
per stream. Ties go by stream class id, then stream id, as babeltrace2's muxer breaks them.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracesynth.io.ctf import fast
from tracesynth.io.ctf.compile import CtfDecodeError
from tracesynth.io.ctf.decode import StreamData, StreamDecoder, Want, _packet_head, decode_file

CHUNK = 1 << 16  # events per chunk and stream
# below this much stream data, the Python decoder finishes before numba would be loaded
FAST_MIN_BYTES = 8 << 20
# the same for the ahead-of-time (Cython) core, which loads in about a millisecond: every trace
AOT_MIN_BYTES = 0
_PAGE = mmap.PAGESIZE


@dataclass
class Chunk:
    """Rows of one stream: raw clock values, event class ids, (values, valid) per want."""

    raw: np.ndarray
    ids: np.ndarray
    cols: list[tuple[np.ndarray, np.ndarray]]


class _Out:
    """The column buffers the compiled core writes into."""

    def __init__(self, nregs: int, ncols: int, cap: int) -> None:
        self.regs = np.zeros(nregs, dtype=np.int64)
        self.ts = np.zeros(cap, dtype=np.uint64)
        self.ids = np.zeros(cap, dtype=np.int64)
        self.vals = np.zeros((ncols, cap), dtype=np.int64)
        self.lens = np.zeros((ncols, cap), dtype=np.int64)
        self.valid = np.zeros((ncols, cap), dtype=np.uint8)
        self.packets: list[tuple[int, int, tuple]] = []  # (first row, end row, packet values)

    def reset(self) -> None:
        self.packets = []
        self.valid[:] = 0


def wrap_int(v: int) -> int:
    """A uint64 above 2**63 as C's int64 cast reads it (as the text path does)."""
    return ((v + (1 << 63)) % (1 << 64)) - (1 << 63)


@dataclass
class StreamFile:
    """One stream file of a trace, decoded lazily (`chunks`)."""

    path: Path
    order: int  # position among the trace's stream files
    tc: Any
    decoders: dict[int, StreamDecoder]
    programs: dict[int, fast.Program | None]
    wants: list[Any]
    words: list[dict[bytes, int]]  # per want, the strings seen so far (shared by a trace's streams)
    # the column buffers by (registers, columns), shared by a read's stream files: a file's generator
    # only pauses after its rows are copied out, and resets the buffers when it goes on (one set of
    # buffers, warm in the cache, rather than one per stream file to allocate and fault in)
    buffers: dict[tuple[int, int], _Out] = field(default_factory=dict, repr=False)
    decoder: StreamDecoder | None = None
    instance: int | None = None
    _plan: list | None = field(default=None, repr=False)

    def chunks(self) -> Iterator[Chunk]:
        """The file's events, a chunk at a time (CtfDecodeError naming the packet's byte offset)."""
        with self.path.open("rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield from self._chunks(mm, np.frombuffer(mm, dtype=np.uint8))
        finally:
            try:
                mm.close()
            except BufferError:  # a traceback still holds a view of it: the collector closes it
                pass

    def _chunks(self, mm: mmap.mmap, buf: np.ndarray) -> Iterator[Chunk]:
        pos, clk, total = 0, 0, len(mm)
        out: _Out | None = None
        while pos < total:
            clk0 = clk
            p, clk, roles, pvals, size, content = self._head(mm, pos, clk)
            prog = self.programs.get(self.decoder.sc.id) if self.decoder else None
            if prog is None:  # the Python decoder, for the rest of the file
                if out is not None and out.packets:
                    yield self._finish(out, buf)
                yield from self._python_rest(mm, pos, clk0)
                return
            if out is None:
                key = (prog.nregs, prog.ncols)
                if key not in self.buffers:
                    self.buffers[key] = _Out(*key, CHUNK)
                out = self.buffers[key]
                out.reset()  # another file's rows, already copied out
            n0 = out.packets[-1][1] if out.packets else 0
            done = 0  # rows of this packet in chunks already yielded
            lim = pos + size // 8
            status, p, clk2, n = fast.run_packet(prog, buf, pos, lim, p, content, clk, n0, out)
            while status == fast.FULL:
                out.packets.append((n0, n, pvals))
                yield self._finish(out, buf)
                if pos >= _PAGE:  # the pages read so far leave the resident set
                    mm.madvise(mmap.MADV_DONTNEED, 0, pos // _PAGE * _PAGE)
                done += n - n0
                out.reset()  # _finish copied the rows out: the buffers are reused (no allocator churn)
                n0 = 0
                status, p, clk2, n = fast.run_packet(prog, buf, pos, lim, p, content, clk2, 0, out)
            if status != fast.OK:  # the Python decoder redoes this packet and reports what is wrong
                if out.packets:
                    yield self._finish(out, buf)
                yield from self._python_rest(mm, pos, clk0, skip=done)
                return
            clk = int(clk2)
            out.packets.append((n0, n, pvals))
            pos = lim
        if out is not None and out.packets and out.packets[-1][1]:
            yield self._finish(out, buf)

    def _head(self, mm: mmap.mmap, pos: int, clk: int) -> tuple:
        """The packet at byte pos: (p, clk, roles, packet values, size, content size) in bits."""
        tc, decoders = self.tc, self.decoders
        try:
            try:
                p, clk, roles, pvals = _packet_head(tc, decoders, mm[pos : pos + 4096], clk)
            except (IndexError, CtfDecodeError, struct.error):
                p, clk, roles, pvals = _packet_head(tc, decoders, mm[pos:], clk)
            d = decoders[roles.get("stream_id", next(iter(decoders)) if len(decoders) == 1 else 0)]
            if self.decoder is not None and d is not self.decoder:
                raise CtfDecodeError("packets of different stream classes in one stream file")
            if self.decoder is None:
                self.decoder = d
                self.instance = roles.get("stream_instance_id")
            size = roles.get("packet_size", roles.get("content_size", (len(mm) - pos) * 8))
            content = roles.get("content_size", size)
            if size <= 0 or size % 8 or content > size or pos + size // 8 > len(mm) or content < p:
                raise CtfDecodeError(f"packet sizes (content {content} bits, packet {size} bits) do not fit the file")
        except CtfDecodeError as exc:
            raise CtfDecodeError(f"packet at byte {pos}: {exc}") from None
        except (IndexError, ValueError, KeyError, NameError, OverflowError, TypeError, struct.error) as exc:
            raise CtfDecodeError(f"packet at byte {pos}: cannot decode ({type(exc).__name__}: {exc})") from None
        return p, clk, roles, pvals, size, content

    def _python_rest(self, mm: mmap.mmap, pos: int, clk: int, skip: int = 0) -> Iterator[Chunk]:
        """The file from byte pos on, by the Python decoder (its first `skip` rows already out)."""
        sd = decode_file(self.tc, self.decoders, mm[pos:], base=pos, clk=clk)
        if self.decoder is None:
            self.decoder = sd.decoder
            self.instance = sd.instance
        if len(sd.ids) <= skip:
            return
        raw = np.frombuffer(sd.ts, dtype=np.uint64)[skip:].copy()
        ids = np.frombuffer(sd.ids, dtype=np.int64)[skip:].copy()
        cols = []
        for j, w in enumerate(self.wants):
            vals, valid = _want_column(sd, j, w)
            vals, valid = vals[skip:], valid[skip:]
            if w.kind != "int":  # bytes -> codes in the trace's string table
                reg = self.words[j]
                codes = np.full(len(vals), -1, dtype=np.int32)
                codes[valid] = [reg.setdefault(bytes(b), len(reg)) for b in vals[valid].tolist()]
                vals = codes
            cols.append((vals, valid))
        yield Chunk(raw, ids, cols)

    def _finish(self, out: _Out, buf: np.ndarray) -> Chunk:
        """The rows of `out` as a Chunk: packet values filled in, strings interned as codes."""
        n = out.packets[-1][1] if out.packets else 0
        ids = out.ids[:n].copy()
        cols = []
        for j, w in enumerate(self.wants):
            valid = out.valid[j, :n].astype(bool)
            if w.kind == "int":
                cols.append((out.vals[j, :n].copy(), valid))
                continue
            offs, lens = out.vals[j, :n], out.lens[j, :n]
            local, first = fast.loaded().intern(buf, offs, lens, out.valid[j, :n])
            reg = self.words[j]
            lut = np.array(
                [reg.setdefault(buf[offs[f] : offs[f] + lens[f]].tobytes(), len(reg)) for f in first.tolist()],
                dtype=np.int32,
            )
            codes = np.append(lut, np.int32(-1))[local]  # local is -1 where not valid: code -1
            cols.append((codes, valid))
        self._packet_columns(out.packets, ids, cols)
        return Chunk(out.ts[:n].copy(), ids, cols)

    def _packet_columns(self, packets: list, ids: np.ndarray, cols: list) -> None:
        """Fill the wants whose value comes from the packet context, packet by packet."""
        dec = self.decoder
        eids = np.array(sorted(dec.sources), dtype=np.int64)
        if self._plan is None:  # (want, packet value index, which event classes) once per file
            self._plan = []
            for j in range(len(self.wants)):
                srcs = [dec.sources[e][j] for e in eids.tolist()]
                for slot in sorted({s[1] for s in srcs if s and s[0] == "packet.context"}):
                    use = np.array([bool(s and s[0] == "packet.context" and s[1] == slot) for s in srcs], dtype=bool)
                    self._plan.append((j, dec.slots["packet"].index(slot), use, use.all()))
        if not self._plan:
            return
        at = None
        for j, k, use, everywhere in self._plan:
            vals, valid = cols[j]
            if not everywhere and at is None:
                at = np.searchsorted(eids, ids)
            rows_use = None if everywhere else use[at]
            for a, b, pv in packets:
                if b > a and pv[k] is not None:
                    rows = slice(a, b) if rows_use is None else a + np.flatnonzero(rows_use[a:b])
                    vals[rows] = wrap_int(pv[k])
                    valid[rows] = True


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc): decoding churns through temporary
    buffers, and the holes they leave would otherwise stay in the process's resident set while
    the caller builds its table."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class _Pending:
    """A stream being muxed: its chunk iterator and the rows read but not yet emitted, kept as the
    chunks they came in (joined once, with the other streams' rows, when they are emitted)."""

    def __init__(self, sf: StreamFile, to_ns: Any) -> None:
        self.sf = sf
        self.it = sf.chunks()
        self.to_ns = to_ns  # (stream file, raw clock values) -> ns, or None without a clock
        self.done = False
        self.pieces: list[tuple[np.ndarray | None, np.ndarray, list]] = []  # (ts, ids, cols)
        self.n = 0

    def pull(self) -> None:
        """Read the next chunk (or mark the stream done)."""
        from tracesynth.errors import TraceSynthError

        try:
            c = next(self.it)
        except StopIteration:
            self.done = True
            return
        except CtfDecodeError as exc:
            raise TraceSynthError(f"cannot read this trace (truncated or corrupt?): {exc}", self.sf.path) from None
        if len(c.ids):
            self.pieces.append((self.to_ns(self.sf, c.raw), c.ids, c.cols))
            self.n += len(c.ids)

    def last_ts(self) -> int:
        return int(self.pieces[-1][0][-1])

    def before(self, w: int) -> int:
        """How many pending rows come before the first one at or after w."""
        k = 0
        for ts, _, _ in self.pieces:
            ahead = ts >= w
            if ahead.any():
                return k + int(ahead.argmax())
            k += len(ts)
        return k

    def take(self, k: int) -> list[tuple]:
        """The first k pending rows, as pieces (ts, ids, cols), removed."""
        out = []
        self.n -= k
        while k:
            ts, ids, cols = self.pieces[0]
            if k >= len(ids):
                out.append(self.pieces.pop(0))
                k -= len(ids)
                continue
            out.append((None if ts is None else ts[:k], ids[:k], [(v[:k], ok[:k]) for v, ok in cols]))
            self.pieces[0] = (None if ts is None else ts[k:], ids[k:], [(v[k:], ok[k:]) for v, ok in cols])
            k = 0
        return out


def mux(files: list[StreamFile], to_ns: Any, names: dict[str, int]) -> Iterator[tuple]:
    """Blocks (ts ns or None, event name codes, cols) of every stream in time order; `names`
    gets each event name's code (stream classes in stream order). Without a clock on some stream,
    the streams follow one another (ts None)."""
    pend = [_Pending(sf, to_ns) for sf in files]
    for s in pend:
        s.pull()
    # babeltrace2's muxer breaks timestamp ties by stream class id, then stream id
    pend.sort(
        key=lambda s: (
            s.sf.order[0],
            s.sf.decoder.sc.id if s.sf.decoder else 0,
            s.sf.instance if s.sf.instance is not None else s.sf.order[1],
            s.sf.order[1],
        )
    )
    luts = []
    for s in pend:
        evs = s.sf.decoder.sc.events if s.sf.decoder else {}
        eids = np.array(sorted(evs), dtype=np.int64)
        code = np.array([names.setdefault(evs[e].name, len(names)) for e in eids.tolist()], np.int32)
        if len(eids) and 0 <= eids[0] and eids[-1] < 1 << 20:  # a table indexed by id: a gather, not a search
            table = np.zeros(int(eids[-1]) + 1, dtype=np.int32)
            table[eids] = code
            luts.append((None, table))
        else:
            luts.append((eids, code))
    if any(s.to_ns(s.sf, np.zeros(0, dtype=np.uint64)) is None for s in pend):  # one stream after the other
        for r, s in enumerate(pend):
            while s.n or not s.done:
                if s.n:
                    yield _merge([(r, p) for p in s.take(s.n)], luts, True)
                if not s.done:
                    s.pull()
        return
    while True:
        for s in pend:
            while not s.done and not s.n:
                s.pull()
        live = [s for s in pend if not s.done]
        # every row before w is final: no stream still being read can hold an earlier one
        w = min(s.last_ts() for s in live) if live else None
        parts = []
        for r, s in enumerate(pend):
            if s.n:
                k = s.before(w) if w is not None else s.n
                parts += [(r, p) for p in s.take(k)]
        if parts:
            yield _merge(parts, luts, False)
        elif not live:
            return
        else:
            for s in live:
                if s.last_ts() == w:
                    s.pull()


def _merge(parts: list, luts: list, clockless: bool) -> tuple:
    codes = []
    for r, (_, ids, _) in parts:  # every id decoded is one of its stream class's
        eids, code = luts[r]
        codes.append(code[ids] if eids is None else code[np.searchsorted(eids, ids)])
    event = np.concatenate(codes)
    ncols = len(parts[0][1][2])
    cols = [
        (np.concatenate([p[2][j][0] for _, p in parts]), np.concatenate([p[2][j][1] for _, p in parts]))
        for j in range(ncols)
    ]
    if clockless:
        return None, event, cols
    ts = np.concatenate([p[0] for _, p in parts])
    order = np.argsort(ts, kind="stable")  # parts in stream order: ties keep it
    return ts[order], event[order], [(v[order], ok[order]) for v, ok in cols]


# -- the Python decoder's rows as one requested column -----------------------------------------------
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
