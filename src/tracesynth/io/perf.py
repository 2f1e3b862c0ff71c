"""perf readers: `perf script` text, perf.data (through `perf script`) and perf CTF.

All three produce the Trace table with the LTTng event vocabulary:

    raw_syscalls:sys_enter (NR n)   -> syscall_entry_<name of n>    (tracesynth.io.syscalls table)
    raw_syscalls:sys_exit  (NR n)   -> syscall_exit_<name of n>, ret from "= r"
    syscalls:sys_enter_X / _exit_X  -> syscall_entry_X / syscall_exit_X (ret from the hex value)
    sub:name                        -> name when it already starts with "sub_" (sched:sched_switch ->
                                       sched_switch), else sub_name (irq:softirq_entry ->
                                       irq_softirq_entry, timer:hrtimer_start -> timer_hrtimer_start),
                                       which is how lttng-modules names the same tracepoints.

`tid`, `comm` and `cpu` are perf's own per-sample fields (the thread that was running).

The text parser is the hot path: the input is streamed in large blocks, each block is split into
lines with numpy, and every field is located and decoded with whole-array byte operations (no
Python loop per line). Lines it cannot parse (call-chain frames, headers, garbage) are counted and
skipped with one warning; a file with no event at all is an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.lib.stride_tricks import sliding_window_view

from tracesynth.errors import TraceSynthError
from tracesynth.io.babeltrace import stall_seconds
from tracesynth.io.syscalls import lookup_numbers
from tracesynth.trace import SCHEMA, Trace
from tracesynth.vocab import Vocab

BLOCK_BYTES = 16 << 20
PARSE_THREADS = 2  # blocks parsed concurrently (the machine this targets has 2 cores)
# The fields read_perf_data asks `perf script` for; read_perf_script also accepts perf's default
# layout (optionally with pid/tid and a sample period before the event name).
PERF_SCRIPT_FIELDS = "trace:comm,tid,cpu,time,event,trace"
PERF_CLOCK = "perf_clock"  # perf's default sample clock (the kernel's local_clock, ns since boot)

_SP, _LB, _RB, _COLON, _DOT, _SLASH, _MINUS, _NL = (ord(c) for c in " []:./-\n")
_POW10 = 10 ** np.arange(19, dtype=np.int64)
_POW10F = _POW10[:10].astype(np.float64)
_COMM_WIDTH, _EVENT_WIDTH = 24, 48  # longest comm / "subsystem:event" name the parser accepts
_LPAD, _PAD = 64, 512  # zero bytes before and after each block's text, so windows never leave the buffer


class PerfInstallError(TraceSynthError):
    """perf is missing or cannot trace."""


def perf_binary() -> str:
    """Path of the perf tool, or a TraceSynthError saying what to install."""
    exe = shutil.which("perf")
    if exe is None:
        raise PerfInstallError("perf is not installed: apt-get install linux-perf")
    return exe


# -- event names ----------------------------------------------------------------------------------
def canonical_event(raw: str) -> str:
    """perf tracepoint name -> LTTng-style name (raw_syscalls are resolved per row elsewhere)."""
    sub, _, name = raw.partition(":")
    if not name:
        return raw
    if sub == "syscalls":
        if name.startswith("sys_enter_"):
            return "syscall_entry_" + name[len("sys_enter_") :]
        if name.startswith("sys_exit_"):
            return "syscall_exit_" + name[len("sys_exit_") :]
    sub = _LTTNG_SUBSYSTEM.get(sub, sub)
    return name if name.startswith(sub + "_") else f"{sub}_{name}"


# Subsystems lttng-modules names differently from perf.
_LTTNG_SUBSYSTEM = {"exceptions": "x86_exceptions"}


# -- vectorised byte helpers ------------------------------------------------------------------------
def _first_at_or_after(positions: np.ndarray, start: np.ndarray) -> np.ndarray:
    """For each start, the first position >= start in the sorted array (a sentinel past the end)."""
    return positions[np.minimum(np.searchsorted(positions, start), len(positions) - 1)]


def _positions(buf: np.ndarray, char: int) -> np.ndarray:
    """Sorted positions of `char` in the text part of a padded block, plus a sentinel past its end."""
    text = buf[_LPAD : len(buf) - _PAD]
    pos = np.flatnonzero(text == char) + _LPAD
    return np.append(pos, _LPAD + len(text))  # "not found" lands past every line end, inside the padding


def _win(buf: np.ndarray, start: np.ndarray, width: int) -> np.ndarray:
    """(n, width) bytes buf[start : start + width] per row (one gather for all rows)."""
    return sliding_window_view(buf, width)[start]


def _is_digit(w: np.ndarray) -> np.ndarray:
    return (w >= 48) & (w <= 57)


def _first_true(mask: np.ndarray) -> np.ndarray:
    """Index of the first True per row, or the row width when there is none."""
    k = mask.argmax(axis=1)
    return np.where(mask[np.arange(len(mask)), k], k, mask.shape[1])


def _skip_spaces(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """First non-space at or after pos (within width bytes)."""
    return pos + _first_true(_win(buf, pos, width) != _SP)


def _skip_spaces_back(buf: np.ndarray, last: np.ndarray, width: int) -> np.ndarray:
    """Last non-space at or before `last` (within width bytes)."""
    return last - _first_true(_win(buf, last - width + 1, width)[:, ::-1] != _SP)


def _skip_word(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """First space at or after pos (within width bytes)."""
    return pos + _first_true(_win(buf, pos, width) == _SP)


def _digits_back(buf: np.ndarray, last: np.ndarray, width: int = 12) -> np.ndarray:
    """First index of the run of ASCII digits that ends at `last` (inclusive)."""
    return last + 1 - _first_true(~_is_digit(_win(buf, last - width + 1, width)[:, ::-1]))


def _digits_forward(buf: np.ndarray, start: np.ndarray, width: int = 20) -> np.ndarray:
    """End (exclusive) of the run of ASCII digits that starts at `start`."""
    return start + _first_true(~_is_digit(_win(buf, start, width)))


def _parse_uint(buf: np.ndarray, start: np.ndarray, end: np.ndarray, width: int = 18) -> tuple[np.ndarray, np.ndarray]:
    """Decimal digits buf[start:end] -> (int64 values, ok mask); ok is False for empty/non-digit/too long.

    The `width` bytes ending at `end` are gathered at once (right-aligned), non-digits of the row
    zeroed, and the digits weighted by powers of ten with a matrix-vector product (exact: each
    half of at most 9 digits stays far below 2**53).
    """
    n = end - start
    ok = (n > 0) & (n <= width)
    d = _win(buf, end - width, width) - np.uint8(48)  # uint8: anything but a digit wraps above 9
    d = np.where(np.arange(width) >= (width - n)[:, None], d, np.uint8(0))
    ok &= (d <= 9).all(axis=1)
    if width <= 9:
        return (d @ _POW10F[width - 1 :: -1]).astype(np.int64), ok
    hi = (d[:, : width - 9] @ _POW10F[width - 10 :: -1]).astype(np.int64)
    lo = (d[:, width - 9 :] @ _POW10F[8::-1]).astype(np.int64)
    return hi * 1_000_000_000 + lo, ok


def _parse_hex(buf: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hex digits buf[start:end] (no 0x) -> (int64 two's complement values, ok mask)."""
    n = end - start
    ok = (n > 0) & (n <= 16)
    c = _win(buf, end - 16, 16).astype(np.int64)
    d = np.where(c <= 57, c - 48, (c | 32) - 87)
    live = np.arange(16) >= (16 - n)[:, None]
    ok &= np.all(~live | ((d >= 0) & (d <= 15)), axis=1)
    d = np.where(live, d, 0).astype(np.uint64)
    val = np.zeros(len(n), dtype=np.uint64)
    for k in range(16):  # 16 whole-array steps, not per row
        val = (val << np.uint64(4)) | d[:, k]
    return val.view(np.int64), ok


def _strings(
    buf: np.ndarray, start: np.ndarray, end: np.ndarray, width: int
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Codes and distinct values of the byte strings buf[start:end] (each at most `width` bytes).

    The strings are gathered as fixed-width, zero-filled rows and hashed by arrow's dictionary
    encoder; returns (codes, values, ok) where ok is False for strings longer than `width`.
    """
    n = end - start
    ok = (n > 0) & (n <= width)
    w = _win(buf, start, width).copy()
    w[np.arange(width) >= n[:, None]] = 0
    arr = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(n), [None, pa.py_buffer(w)])
    enc = pc.dictionary_encode(arr)
    values = [v.rstrip(b"\0").decode("utf-8", "replace") for v in enc.dictionary.to_pylist()]
    return enc.indices.to_numpy(), values, ok


# -- the block parser ---------------------------------------------------------------------------------
class _Block:
    """Columns of one parsed block, with event/comm codes into the reader's vocabularies."""

    __slots__ = ("ts", "event", "cpu", "tid", "comm", "ret", "has_ret")

    def __init__(self, ts, event, cpu, tid, comm, ret, has_ret):  # noqa: ANN001
        self.ts, self.event, self.cpu, self.tid, self.comm, self.ret, self.has_ret = (
            ts,
            event,
            cpu,
            tid,
            comm,
            ret,
            has_ret,
        )


def _event_lines(buf: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, first non-space byte) of each event line of the ``size`` bytes of text padded in ``buf``;
    blank, comment and header lines left out."""
    nl = np.flatnonzero(buf[_LPAD : _LPAD + size] == _NL) + _LPAD
    if len(nl) == 0:
        return (np.zeros(0, dtype=np.int64),) * 3
    starts = np.empty(len(nl), dtype=np.int64)
    starts[0] = _LPAD
    starts[1:] = nl[:-1] + 1
    ends = nl.astype(np.int64)
    ends -= buf[ends - 1] == ord("\r")  # CRLF text (a file from Windows): the '\r' is not part of the line
    # Drop blank lines and comment/header lines before locating fields.
    first = _skip_spaces(buf, starts, 64)
    keep = (first < ends) & (buf[first] != ord("#"))
    return starts[keep], ends[keep], first[keep]


def _payloads(
    buf: np.ndarray, raw_codes: np.ndarray, raw_names: list[str], p0: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the rows' payloads (from ``p0``, after "event: ") say of syscalls: (ret, has_ret, sys_dir, sys_nr);
    raw_syscalls rows carry their direction and number, their names are looked up later."""
    n = len(p0)
    ret = np.zeros(n, dtype=np.int64)
    has_ret = np.zeros(n, dtype=bool)
    sys_dir = np.zeros(n, dtype=np.int8)  # 1: raw_syscalls:sys_enter, 2: raw_syscalls:sys_exit
    sys_nr = np.full(n, -1, dtype=np.int64)
    for k, raw in enumerate(raw_names):
        if raw in ("raw_syscalls:sys_enter", "raw_syscalls:sys_exit"):
            rows = np.flatnonzero(raw_codes == k)
            # "NR 12 (args)" / "NR 12 = ret"
            s = p0[rows] + 3
            neg = buf[s] == _MINUS  # "NR -1": the kernel lost the number (restarted call): unknown
            e = _digits_forward(buf, s + neg, 8)
            nr, ok_nr = _parse_uint(buf, s + neg, e, 4)
            sys_nr[rows] = np.where(ok_nr & ~neg, nr, -1)
            sys_dir[rows] = 1 if raw.endswith("enter") else 2
            if raw.endswith("exit"):
                r0 = e + 3  # " = "
                minus = buf[r0] == _MINUS
                r0 = r0 + minus
                val, ok_r = _parse_uint(buf, r0, ends[rows], 18)
                ret[rows] = np.where(minus, -val, val)
                has_ret[rows] = ok_r
        elif raw.startswith("syscalls:sys_exit_"):
            rows = np.flatnonzero(raw_codes == k)
            # "0x<hex>" (the return value as an unsigned long)
            val, ok_r = _parse_hex(buf, p0[rows] + 2, ends[rows])
            ret[rows] = val
            has_ret[rows] = ok_r
    return ret, has_ret, sys_dir, sys_nr


def _parse_block(data: bytes) -> tuple[dict[str, Any] | None, int]:
    """Parse whole lines of perf script text; returns (block-local columns, number of lines skipped).

    Thread-safe (no shared state): event and comm codes index the block's own name lists, and
    raw syscall rows carry their number; _finish_block maps them onto the reader's vocabularies.
    """
    # Zero padding on both sides lets every fixed-width window read past a malformed line's ends.
    buf = np.frombuffer(bytes(_LPAD) + data + bytes(_PAD), dtype=np.uint8)
    starts, ends, first = _event_lines(buf, len(data))
    if len(starts) == 0:
        return None, 0
    colons = _positions(buf, _COLON)
    # [cpu]: the first '[' of the line, then ']'.
    lb = _first_at_or_after(_positions(buf, _LB), first)
    rb = _first_at_or_after(_positions(buf, _RB), lb)
    ok = (lb < ends) & (rb < ends) & (lb > first)
    lb = np.where(ok, lb, first + 1)
    rb = np.where(ok, rb, lb + 1)
    cpu, ok_c = _parse_uint(buf, lb + 1, rb, 4)
    ok &= ok_c
    # tid just before '[', optional "pid/" before it, comm before that.
    tid_last = _skip_spaces_back(buf, lb - 1, 16)
    tid_first = _digits_back(buf, tid_last, 10)
    tid, ok_t = _parse_uint(buf, tid_first, tid_last + 1, 9)
    ok &= ok_t
    has_pid = buf[tid_first - 1] == _SLASH
    pid_first = np.where(has_pid, _digits_back(buf, tid_first - 2, 12), tid_first)
    comm_last = _skip_spaces_back(buf, pid_first - 1, 16)
    ok &= (comm_last >= first) & (pid_first > first) & (comm_last - first < _COMM_WIDTH)
    # time "sec.frac:" after "] ".
    t0 = _skip_spaces(buf, rb + 1, 16)
    tcolon = _first_at_or_after(colons, t0)
    dot = _first_at_or_after(_positions(buf, _DOT), t0)
    ok &= (dot < tcolon) & (tcolon < ends)
    sec, ok_s = _parse_uint(buf, t0, dot, 10)
    frac, ok_f = _parse_uint(buf, dot + 1, tcolon, 9)
    ok &= ok_s & ok_f
    flen = np.clip(tcolon - dot - 1, 0, 9)
    ts = sec * 1_000_000_000 + frac * _POW10[9 - flen]
    # event "sub:name:" after the time (a sample period may stand before it).
    e0 = _skip_spaces(buf, tcolon + 1, 32)
    period = _is_digit(buf[e0])
    if period.any():
        after = _skip_spaces(buf, _skip_word(buf, e0, 24), 32)
        e0 = np.where(period, after, e0)
    sep = _first_at_or_after(colons, e0)
    e1 = colons[np.minimum(np.searchsorted(colons, sep + 1), len(colons) - 1)]
    ok &= (sep < ends) & (e1 <= ends) & (e1 > sep + 1) & (sep > e0) & (e1 - e0 <= _EVENT_WIDTH)
    skipped = int((~ok).sum())  # blank and comment lines are not counted
    if not ok.all():
        sel = np.flatnonzero(ok)
        starts, ends, first, lb, cpu, tid, pid_first, comm_last = (
            a[sel] for a in (starts, ends, first, lb, cpu, tid, pid_first, comm_last)
        )
        ts, e0, e1 = ts[sel], e0[sel], e1[sel]
    n = len(starts)
    if n == 0:
        return None, skipped
    raw_codes, raw_names, _ = _strings(buf, e0, e1, _EVENT_WIDTH)
    comm_codes, comm_names, _ = _strings(buf, first, comm_last + 1, _COMM_WIDTH)
    ret, has_ret, sys_dir, sys_nr = _payloads(buf, raw_codes, raw_names, e1 + 2, ends)
    cols = {"ts": ts, "cpu": cpu.astype(np.int32), "tid": tid, "ret": ret, "has_ret": has_ret}
    cols.update(raw_codes=raw_codes, raw_names=raw_names, comm_codes=comm_codes, comm_names=comm_names)
    cols.update(sys_dir=sys_dir, sys_nr=sys_nr)
    return cols, skipped


def _finish_block(cols: dict[str, Any], events: Vocab, comms: Vocab) -> _Block:
    """Map a parsed block's local codes onto the reader's vocabularies (in block order)."""
    event = events.add_all(canonical_event(r) for r in cols["raw_names"])[cols["raw_codes"]]
    for d, prefix in ((1, "syscall_entry_"), (2, "syscall_exit_")):
        rows = np.flatnonzero(cols["sys_dir"] == d)
        if len(rows):
            codes, names = lookup_numbers(cols["sys_nr"][rows])
            event[rows] = events.add_all(prefix + nm for nm in names)[codes]
    comm = comms.add_all(cols["comm_names"])[cols["comm_codes"]]
    return _Block(cols["ts"], event, cols["cpu"], cols["tid"], comm, cols["ret"], cols["has_ret"])


def _iter_blocks(stream: IO[bytes], block_bytes: int = BLOCK_BYTES) -> Iterator[bytes]:
    """Whole-line blocks of about block_bytes from a binary stream."""
    rest = b""
    while True:
        chunk = stream.read(block_bytes)
        if not chunk:
            break
        data = rest + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            rest = data
            continue
        rest = data[cut + 1 :]
        yield data[: cut + 1]
    if rest.strip():
        yield rest + b"\n"


def _assemble(blocks: list[_Block], events: Vocab, comms: Vocab, metadata: dict[str, Any]) -> Trace:
    def cat(name: str, dtype: Any) -> np.ndarray:
        return np.concatenate([getattr(b, name) for b in blocks]) if blocks else np.zeros(0, dtype=dtype)

    ts = cat("ts", np.int64)
    order = None
    if len(ts) > 1 and (ts[1:] < ts[:-1]).any():  # compared, not subtracted (no int64 overflow)
        order = np.argsort(ts, kind="stable")  # perf sorts by time; tolerate text that was not
    cols = {
        "ts": ts,
        "event": cat("event", np.int32),
        "cpu": cat("cpu", np.int32),
        "tid": cat("tid", np.int64),
        "comm": cat("comm", np.int32),
        "ret": cat("ret", np.int64),
    }
    has_ret = cat("has_ret", bool)
    if order is not None:
        cols = {k: v[order] for k, v in cols.items()}
        has_ret = has_ret[order]
    table = pa.table(
        [
            pa.array(cols["ts"], pa.int64()),
            pa.DictionaryArray.from_arrays(pa.array(cols["event"], pa.int32()), pa.array(events.values, pa.string())),
            pa.array(cols["cpu"], pa.int32()),
            pa.array(cols["tid"], pa.int64()),
            pa.DictionaryArray.from_arrays(pa.array(cols["comm"], pa.int32()), pa.array(comms.values, pa.string())),
            pa.array(cols["ret"], pa.int64(), mask=~has_ret),
        ],
        schema=SCHEMA,
    )
    return Trace(table, metadata)


def parse_perf_script_stream(
    stream: IO[bytes], source: str | Path, metadata: dict[str, Any] | None = None, block_bytes: int = BLOCK_BYTES
) -> Trace:
    """Parse `perf script` text from a binary stream, block by block (memory ~ a few blocks + the table).

    Blocks are parsed on a small thread pool (numpy releases the GIL), at most `workers + 1` in
    flight, and folded into the table in file order.
    """
    events, comms = Vocab(), Vocab()
    blocks: list[_Block] = []
    skipped = 0
    workers = max(1, min(PARSE_THREADS, os.cpu_count() or 1))
    from tracesynth.io.babeltrace import progress_callback  # the CLI's progress bar, when one is shown

    on_progress = progress_callback.get()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[Future] = deque()

        def fold(fut: Future) -> None:
            nonlocal skipped
            cols, bad = fut.result()
            skipped += bad
            if cols is not None:
                blocks.append(_finish_block(cols, events, comms))
                if on_progress is not None:
                    on_progress(len(cols["ts"]))

        for data in _iter_blocks(stream, block_bytes):
            pending.append(pool.submit(_parse_block, data))
            while len(pending) > workers:
                fold(pending.popleft())
        while pending:
            fold(pending.popleft())
    n = sum(len(b.ts) for b in blocks)
    if n == 0:
        what = f"{skipped} unparseable line(s)" if skipped else "no lines"
        raise TraceSynthError(
            f"no perf script events found ({what}; expected 'comm tid [cpu] time: event: ...')", source
        )
    if skipped:
        warnings.warn(f"{source}: skipped {skipped} line(s) that are not perf script events", stacklevel=2)
    meta = {"source_format": "perf-script", "clock": PERF_CLOCK}
    meta.update(metadata or {})
    return _assemble(blocks, events, comms, meta)


def read_perf_script(path: str | Path, block_bytes: int = BLOCK_BYTES) -> Trace:
    """Read text printed by `perf script` (tracepoints; the default or PERF_SCRIPT_FIELDS layout)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return parse_perf_script_stream(f, path, {"source": path.name}, block_bytes)
    except OSError as exc:
        raise TraceSynthError(f"cannot read ({exc.strerror})", path) from None


def perf_script_command(perf_data: str | Path) -> list[str]:
    """The `perf script` command line whose output read_perf_data parses."""
    return [perf_binary(), "script", "--force", "-i", str(perf_data), "-F", PERF_SCRIPT_FIELDS, "--ns"]


def read_perf_data(path: str | Path, metadata: dict[str, Any] | None = None) -> Trace:
    """Decode a perf.data file by streaming `perf script` output through the text parser."""
    path = Path(path)
    if not path.is_file():
        raise TraceSynthError("no such file", path)
    cmd = perf_script_command(path)
    env = dict(os.environ, LC_ALL="C")
    stall = stall_seconds()
    # stderr to a file: perf may print many warnings about a damaged file, and a full stderr pipe
    # would block it while we wait on stdout
    with tempfile.TemporaryFile() as errf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, stdin=subprocess.DEVNULL, env=env)
        assert proc.stdout is not None
        watched = _Watchdog(proc, stall)
        try:
            try:
                trace = parse_perf_script_stream(watched, path, {"source": path.name, "source_format": "perf-data"})
            except TraceSynthError:
                if watched.stalled:
                    raise TraceSynthError(
                        f"perf script printed nothing for {stall:g} s (corrupt file?)", path
                    ) from None
                proc.wait()
                errf.seek(0)
                detail = _perf_error_line(errf.read().decode(errors="replace"))
                if proc.returncode and detail:
                    raise TraceSynthError(f"perf script failed: {detail}", path) from None
                raise
            if proc.wait() != 0 or watched.stalled:
                if watched.stalled:
                    raise TraceSynthError(f"perf script printed nothing for {stall:g} s (corrupt file?)", path)
                errf.seek(0)
                detail = _perf_error_line(errf.read().decode(errors="replace"))
                raise TraceSynthError(f"perf script failed: {detail or proc.returncode}", path)
        finally:  # on any way out (an error, Ctrl-C) perf must not be left running
            watched.stop()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
    trace.metadata.update(metadata or {})
    return trace


class _Watchdog:
    """perf's stdout, read as a stream; perf is killed when it prints nothing for `stall` seconds."""

    def __init__(self, proc: subprocess.Popen, stall: float) -> None:
        self.proc, self.stall = proc, stall
        self.last = time.monotonic()
        self.stalled = False
        self._done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def read(self, n: int) -> bytes:
        """Up to n bytes (fewer only at the end), noting every time perf delivers some."""
        parts, got = [], 0
        while got < n:
            data = self.proc.stdout.read1(n - got)
            if not data:
                break
            self.last = time.monotonic()
            parts.append(data)
            got += len(data)
        return b"".join(parts)

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.stall / 4)):
            if time.monotonic() - self.last > self.stall:
                self.stalled = True
                self.proc.kill()  # its stdout then ends, and the reader sees end of file
                return

    def stop(self) -> None:
        self._done.set()


def _perf_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and "not valid for" not in ln]
    return lines[-1] if lines else ""


# -- perf CTF -------------------------------------------------------------------------------------
_SIDEBAND = ("perf_comm", "perf_fork")


def _ctf_fields() -> list:
    from tracesynth.io.babeltrace import Field

    return [
        Field("perf_tid", events=("*:*",), scope="payload"),
        Field("id", events=("raw_syscalls:*",), scope="payload", column="nr"),
        Field("ret", events=("raw_syscalls:sys_exit", "syscalls:sys_exit_*"), scope="payload"),
        Field("tid", events=_SIDEBAND, scope="payload", column="sb_tid"),
        Field("ptid", events=("perf_fork",), scope="payload", column="sb_ptid"),
        Field("comm", kind="str", events=("perf_comm",), scope="payload", column="sb_comm"),
    ]


def _comm_from_sideband(
    ts: np.ndarray, tid: np.ndarray, sb: list[tuple[int, str, int, int, str | None]], comms: Vocab
) -> np.ndarray:
    """Per-sample comm codes (-1: unknown) from perf's COMM/FORK side-band events, as perf's thread map does.

    A COMM event names a thread from its time on; a FORK event gives the child its parent's current
    name. Side-band events are few (one per exec/thread), so they are walked in Python; samples are
    then assigned per thread with one searchsorted.
    """
    current: dict[int, int] = {}
    history: dict[int, tuple[list[int], list[int]]] = {}
    for t, kind, child, parent, name in sb:  # time order
        if kind == "perf_comm":
            code = comms.add(name or "")
        else:
            code = current.get(parent, -1)
        current[child] = code
        times, codes = history.setdefault(child, ([], []))
        times.append(t)
        codes.append(code)
    out = np.full(len(ts), -1, dtype=np.int32)
    if not history:
        return out
    order = np.argsort(tid, kind="stable")
    sorted_tid = tid[order]
    bounds = np.flatnonzero(np.diff(sorted_tid)) + 1
    for rows in np.split(order, bounds):
        if len(rows) == 0:
            continue
        h = history.get(int(tid[rows[0]]))
        if h is None:
            continue
        times, codes = np.asarray(h[0], dtype=np.int64), np.asarray(h[1], dtype=np.int32)
        k = np.searchsorted(times, ts[rows], side="right") - 1
        out[rows] = np.where(k >= 0, codes[np.maximum(k, 0)], -1)
    return out


def read_perf_ctf(path: str | Path) -> Trace:
    """Read a CTF directory written by `perf data convert --to-ctf` (through babeltrace2).

    Samples carry perf_tid and the packet's cpu_id; `comm` comes from the side-band COMM/FORK
    events, which perf writes only with `perf data convert --to-ctf DIR --all` (without them comm
    stays null, with a warning).
    """
    from tracesynth.io.babeltrace import iter_ctf_batches

    path = Path(path)
    events, comms = Vocab(), Vocab()
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("ts", "event", "cpu", "tid", "ret", "has_ret")}
    sideband: list[tuple[int, str, int, int, str | None]] = []
    for batch in iter_ctf_batches(path, _ctf_fields()):
        if batch.num_rows == 0:
            continue
        ev = batch["event"]
        names = ev.dictionary.to_pylist()
        codes = ev.indices.to_numpy(zero_copy_only=False)
        ts = batch["ts"].to_numpy(zero_copy_only=False)
        is_sample = np.array([":" in n for n in names], dtype=bool)[codes]
        is_sb = np.array([n in _SIDEBAND for n in names], dtype=bool)[codes]
        if is_sb.any():
            rows = np.flatnonzero(is_sb)
            sb_tid = batch["sb_tid"].to_numpy(zero_copy_only=False)
            sb_ptid = batch["sb_ptid"].fill_null(-1).to_numpy(zero_copy_only=False)
            sb_comm = batch["sb_comm"].cast(pa.string()).to_pylist()
            for r in rows:
                sideband.append((int(ts[r]), names[codes[r]], int(sb_tid[r]), int(sb_ptid[r]), sb_comm[r]))
        rows = np.flatnonzero(is_sample)
        if len(rows) == 0:
            continue
        codes = codes[rows]
        event = events.add_all(canonical_event(n) for n in names)[codes]
        nr = batch["nr"].fill_null(-1).to_numpy(zero_copy_only=False)[rows]
        for k, raw in enumerate(names):
            if raw in ("raw_syscalls:sys_enter", "raw_syscalls:sys_exit"):
                sel = np.flatnonzero(codes == k)
                sc, sn = lookup_numbers(nr[sel])
                prefix = "syscall_entry_" if raw.endswith("enter") else "syscall_exit_"
                event[sel] = events.add_all(prefix + n for n in sn)[sc]
        ret = batch["ret"].take(pa.array(rows))
        cols["ts"].append(ts[rows])
        cols["event"].append(event)
        cols["cpu"].append(batch["cpu"].fill_null(-1).to_numpy(zero_copy_only=False)[rows].astype(np.int32))
        cols["tid"].append(batch["perf_tid"].fill_null(-1).to_numpy(zero_copy_only=False)[rows])
        cols["ret"].append(ret.fill_null(0).to_numpy(zero_copy_only=False))
        cols["has_ret"].append(~ret.is_null().to_numpy(zero_copy_only=False))
    if not cols["ts"]:
        raise TraceSynthError("no perf samples in this CTF trace", path)
    ts = np.concatenate(cols["ts"])
    tid = np.concatenate(cols["tid"])
    if not sideband:
        warnings.warn(f"{path}: no perf_comm events (convert with `--all`); comm left empty", stacklevel=2)
    comm = _comm_from_sideband(ts, tid, sideband, comms)
    cpu = np.concatenate(cols["cpu"])
    table = pa.table(
        [
            pa.array(ts, pa.int64()),
            pa.DictionaryArray.from_arrays(
                pa.array(np.concatenate(cols["event"]), pa.int32()), pa.array(events.values, pa.string())
            ),
            pa.array(cpu, pa.int32(), mask=cpu < 0),
            pa.array(tid, pa.int64(), mask=tid < 0),
            pa.DictionaryArray.from_arrays(
                pa.array(comm, pa.int32(), mask=comm < 0), pa.array(comms.values, pa.string())
            ),
            pa.array(np.concatenate(cols["ret"]), pa.int64(), mask=~np.concatenate(cols["has_ret"])),
        ],
        schema=SCHEMA,
    )
    return Trace(table, {"source_format": "perf-ctf", "source": path.name, "clock": PERF_CLOCK})
