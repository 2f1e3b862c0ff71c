"""Stream any CTF trace through the `babeltrace2` CLI as Arrow record batches.

Reading CTF with bt2's Python field access runs at ~30k events/s; the `babeltrace2` text sink
alone emits ~500k events/s. So we run the CLI as a subprocess with a fixed, parseable
`sink.text.pretty` layout and parse 16 MiB blocks of its output without a Python step per event:
arrow substring searches and numpy digit arithmetic, directed by the line layout (a field is
looked for first where the layout puts it: first in its scope, or right after the field parsed
before it), with regex extraction only for rows the fast path cannot decode (hex or enum integers,
escaped strings, unexpected layouts); `parse_pretty_lines_regex` is the all-regex reference the
tests hold it equal to. A reader thread drains the pipe into a bounded queue, so the subprocess
never stalls while a block is being parsed and memory stays flat in trace length.

One output line per event looks like::

    [1533225246.661375041] sched_switch: stream.packet.context = { cpu_id = 1 },
        stream.event.context = { tid = 5, procname = "wget" }, event.fields = { prev_comm = ... }

API (used by the LTTng and perf CTF readers)::

    from tracesynth.io.babeltrace import Field, iter_ctf_batches, ctf_metadata

    fields = [
        Field("ret", events=("syscall_exit_*",)),           # int64, only parsed on those events
        Field("next_comm", kind="str", events=("sched_switch",)),
        Field("tid", scope="context"),                      # only inside a *context scope
        Field("perf_tid"),                                  # anywhere in the line
    ]
    for batch in iter_ctf_batches(path, fields):            # pyarrow.RecordBatch per block
        batch["ts"]      # int64 ns since the clock origin (clock offset applied, as --clock-seconds)
        batch["event"]   # dictionary<int32, string> event name as babeltrace2 prints it
        batch["cpu"]     # int32, from the packet context's cpu_id (null when absent)
        batch["ret"]     # int64 (null where the event lacks the field or does not match `events`)
        batch["next_comm"]  # dictionary<int32, string>, escapes decoded

    ctf_metadata(path)  # {"env": {...}, "clocks": [{"name", "freq", "offset_s", "offset", ...}], "uuid",
                        #  "context_fields": [...], "event_fields": {event name: {payload field names}}}

Put fields in the order the events print them (e.g. sched_switch's prev_comm, prev_tid, next_comm,
next_tid): each is then found right after the previous one instead of by a search.

Rows come in babeltrace2's muxed order (non-decreasing time across all streams). A field name
is as babeltrace2 prints it (CTF's leading underscore stripped: `_tid` -> `tid`). Integer values
printed in hex or as enumerations are decoded too. Beware: babeltrace2 2.0.4 may print an empty
string field with a stale value from an earlier event of the same class (a recycling bug), so
writers should not rely on empty strings. `import_bt2()` imports the Debian bindings
lazily for callers that need the object API. A failing babeltrace2 (corrupt or truncated trace,
no trace) raises TraceSynthError naming the path, with babeltrace2's own root cause.
"""

from __future__ import annotations

import fnmatch
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracesynth.errors import TraceSynthError

INSTALL_HINT = "install it with `apt-get install babeltrace2`"
_PRETTY_PARAMS = (
    "field-default=hide,no-delta=yes,clock-seconds=yes,name-default=show,name-scope=yes,name-header=no,color=never"
)
_DICT = pa.dictionary(pa.int32(), pa.string())
# Callers up the stack (the CLI's progress bar) get the event count of each parsed block.
progress_callback: ContextVar[Callable[[int], None] | None] = ContextVar("progress_callback", default=None)
# Which CTF decoder iter_ctf_batches/ctf_metadata use: "native" (tracesynth.io.ctf, the default;
# reads CTF 1.8 and CTF 2) or "babeltrace2" (this module's text path). `tracesynth ingest --decoder`
# sets it; TRACESYNTH_CTF_DECODER is the default when it is unset.
DECODERS = ("native", "babeltrace2")
ctf_decoder: ContextVar[str | None] = ContextVar("ctf_decoder", default=None)


def selected_decoder() -> str:
    """The CTF decoder in force (TraceSynthError for an unknown name)."""
    name = ctf_decoder.get() or os.environ.get("TRACESYNTH_CTF_DECODER") or "native"
    if name not in DECODERS:
        raise TraceSynthError(f"unknown CTF decoder {name!r} (choose from {', '.join(DECODERS)})")
    return name


_HEADER = (
    r"^\[(?P<sign>-?)(?P<s>[0-9]+)\.(?P<ns>[0-9]{9})\] (?P<name>[^ \n]+?):(?: |\n|$)"
    r"(?:stream\.packet\.context = \{[^{}]*?cpu_id = (?P<cpu>[0-9]+))?"
)
_INT = r"(?:\( \"[^\"]*\" : container = )?(?P<v>-?(?:0x[0-9A-Fa-f]+|[0-9]+))"
_STR = r"\"(?P<v>(?:[^\"\\]|\\.)*)\""
_SCOPES = {"any": "", "context": r"context = \{[^{}]*?", "payload": r"event\.fields = \{.*?"}


@dataclass(frozen=True)
class Field:
    """A payload/context field to extract into a column.

    name:   the field name as babeltrace2 prints it (e.g. "ret", "next_comm", "perf_tid").
    kind:   "int" (int64 column) or "str" (dictionary string column).
    events: fnmatch patterns of event names to parse it on (None: every event). Restricting it
            is the main speed lever: each field costs one regex pass over the matching lines.
    scope:  "any", "context" (only inside a `*context = { }` scope) or "payload" (event fields);
            e.g. sched_wakeup's payload `tid` is not the context `tid`.
    column: output column name (default: name).
    """

    name: str
    kind: str = "int"
    events: tuple[str, ...] | None = None
    scope: str = "any"
    column: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("int", "str"):
            raise ValueError(f"Field kind must be 'int' or 'str', not {self.kind!r}")
        if self.scope not in _SCOPES:
            raise ValueError(f"Field scope must be one of {sorted(_SCOPES)}, not {self.scope!r}")
        if not re.fullmatch(r"[A-Za-z0-9_]+", self.name):
            raise ValueError(f"bad field name {self.name!r}")

    @property
    def out(self) -> str:
        return self.column or self.name

    @property
    def pattern(self) -> str:
        return _SCOPES[self.scope] + r"[ {]" + re.escape(self.name) + " = " + (_INT if self.kind == "int" else _STR)


def babeltrace2_binary() -> str:
    """Path of the babeltrace2 CLI, or a TraceSynthError saying what to install."""
    exe = shutil.which("babeltrace2")
    if exe is None:
        raise TraceSynthError(f"the `babeltrace2` program is needed to read CTF traces; {INSTALL_HINT}")
    return exe


def import_bt2() -> Any:
    """Import babeltrace2's Python bindings (Debian's python3-bt2 lives outside the venv)."""
    try:
        import bt2  # type: ignore[import-not-found]
    except ImportError:
        dist = "/usr/lib/python3/dist-packages"
        if dist not in sys.path:
            sys.path.append(dist)
        try:
            import bt2  # type: ignore[import-not-found]
        except ImportError:
            raise TraceSynthError(
                "babeltrace2's Python bindings are missing; install them with `apt-get install python3-bt2`"
            ) from None
    return bt2


def _root_cause(stderr: str) -> str:
    """The most specific line of babeltrace2's error chain (the last 'CAUSED BY' message)."""
    msgs = []
    for line in stderr.splitlines():
        line = line.strip()
        m = re.match(r"^(?:ERROR:|CAUSED BY)\s+\[[^\]]*\]\s*(?:\([^)]*\))?\s*(.*)$", line)
        if m:
            msgs.append(m.group(1))
        elif msgs and line and not line.startswith(("ERROR", "CAUSED")):
            msgs[-1] = (msgs[-1] + " " + line).strip()
    if not msgs:
        tail = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        return tail[-1] if tail else "babeltrace2 failed without a message"
    msgs = [re.sub(r"\s*[\w-]+-addr=0x[0-9a-fA-F]+,?", "", m).rstrip(", ") for m in msgs]
    generic = (
        "Cannot create component",
        "Component initialization",
        "Graph failed",
        "Cannot run",
        "Command-line error",
    )
    useful = [m for m in msgs if m and not m.startswith(generic)]
    return (useful or msgs)[-1].rstrip(".:")


def run_babeltrace2(args: Sequence[str], path: str | Path, timeout: float = 30) -> str:
    """Run babeltrace2 to completion and return stdout (small outputs only: metadata, queries)."""
    try:
        proc = subprocess.run(
            [babeltrace2_binary(), *args], capture_output=True, text=True, errors="replace", timeout=timeout
        )
    except subprocess.TimeoutExpired:  # babeltrace2 2.0 can loop on some damaged metadata
        raise TraceSynthError(f"babeltrace2 did not finish within {timeout:g} s (corrupt trace?)", path) from None
    if proc.returncode != 0:
        raise TraceSynthError(
            f"babeltrace2 cannot read this trace (truncated or corrupt?): {_root_cause(proc.stderr)}", path
        )
    return proc.stdout


# -- metadata -----------------------------------------------------------------------------------
_ENV_BLOCK = re.compile(r"^env\s*\{(.*?)^\};", re.S | re.M)
_CLOCK_BLOCK = re.compile(r"^clock\s*\{(.*?)^\};", re.S | re.M)
_ASSIGN = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\"(?:[^\"\\]|\\.)*\"|[^;]+?)\s*;", re.M)
_TRACE_UUID = re.compile(r"^trace\s*\{.*?uuid\s*=\s*\"([0-9a-fA-F-]+)\"", re.S | re.M)


def _tsdl_value(raw: str) -> Any:
    raw = raw.strip()
    if raw.startswith('"'):
        return _unescape(raw[1:-1])
    try:
        return int(raw, 0)
    except ValueError:
        return raw


_META_MAGIC = 0x75D11D57
_META_HEADER = 37  # bytes: magic, uuid[16], checksum, content_size, packet_size, 5 one-byte fields


def check_packetized_metadata(path: Path) -> None:
    """TraceSynthError if a packetized metadata file ends inside a packet (a truncated copy).

    babeltrace2 may spin forever on such a file instead of failing, so it is checked first.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceSynthError(f"cannot read ({exc.strerror})", path) from None
    order = {_META_MAGIC.to_bytes(4, "little"): "little", _META_MAGIC.to_bytes(4, "big"): "big"}.get(data[:4])
    if order is None:
        return  # TSDL text (or not metadata at all: babeltrace2 says so)
    off = 0
    while off < len(data):
        head = data[off : off + _META_HEADER]
        if len(head) < _META_HEADER or head[:4] != data[:4]:
            raise TraceSynthError(f"metadata packet at byte {off} is damaged or cut short", path)
        content_bits = int.from_bytes(head[24:28], order)
        size = int.from_bytes(head[28:32], order) // 8
        if size < _META_HEADER or content_bits > size * 8 or off + size > len(data):
            raise TraceSynthError(f"metadata packet at byte {off} is damaged or cut short (truncated copy?)", path)
        off += size


def ctf_metadata(path: str | Path) -> dict[str, Any]:
    """Environment, clocks and trace UUID of one CTF trace directory (the native metadata parser,
    or babeltrace2's `-o ctf-metadata` when that decoder is selected)."""
    if selected_decoder() == "native":
        from tracesynth.io.ctf import native_ctf_metadata

        return native_ctf_metadata(path)
    if (Path(path) / "metadata").is_file():
        check_packetized_metadata(Path(path) / "metadata")
    text = run_babeltrace2(["-o", "ctf-metadata", str(path)], path)
    env: dict[str, Any] = {}
    for block in _ENV_BLOCK.findall(text):
        env.update({k: _tsdl_value(v) for k, v in _ASSIGN.findall(block)})
    clocks = []
    for block in _CLOCK_BLOCK.findall(text):
        clocks.append({k: _tsdl_value(v) for k, v in _ASSIGN.findall(block)})
    m = _TRACE_UUID.search(text)
    return {
        "env": env,
        "clocks": clocks,
        "uuid": m.group(1) if m else None,
        "context_fields": sorted(_context_field_names(text)),
        "event_fields": _event_field_names(text),
    }


_EVENT_BLOCK = re.compile(r"^event\s*\{(.*?)^\};", re.S | re.M)


def _event_field_names(text: str) -> dict[str, set[str]]:
    """Event name -> payload field names (leading '_' stripped), from the TSDL event blocks."""
    out: dict[str, set[str]] = {}
    for block in _EVENT_BLOCK.findall(text):
        m = re.search(r'\bname\s*=\s*"((?:[^"\\]|\\.)*)"\s*;', block)
        if not m:
            continue
        names = out.setdefault(_unescape(m.group(1)), set())
        fm = re.search(r"fields\s*:=\s*struct\s*\{", block)
        if fm:
            body = _balanced_body(block, fm.end())
            names.update(n[1:] if n.startswith("_") else n for n in _FIELD_NAME.findall(_strip_nested(body)))
    return out


_FIELD_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:\[[^\]]*\])*\s*;")


def _balanced_body(text: str, start: int) -> str:
    """Text from `start` (just after an opening brace) to its matching closing brace."""
    depth, i = 1, start
    while i < len(text) and depth:
        depth += (text[i] == "{") - (text[i] == "}")
        i += 1
    return text[start : i - 1]


def _strip_nested(body: str) -> str:
    """Drop nested { ... } blocks (type bodies), keeping the field declarations at this level."""
    out, depth = [], 0
    for ch in body:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _context_field_names(text: str) -> set[str]:
    """Names (leading '_' stripped) of the fields declared in any `...context := struct { }`."""
    names: set[str] = set()
    for m in re.finditer(r"(?:event\.context|(?<![.\w])context)\s*:=\s*struct\s*\{", text):
        depth, i, body = 1, m.end(), []
        while i < len(text) and depth:
            ch = text[i]
            depth += (ch == "{") - (ch == "}")
            if depth == 1 and ch != "}":
                body.append(ch)
            i += 1
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:\[[^\]]*\])?\s*;", "".join(body)):
            names.add(name[1:] if name.startswith("_") else name)
    return names


# -- value decoding -------------------------------------------------------------------------------
_ESCAPES = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b"0": b"\0", b"a": b"\a", b"b": b"\b", b"f": b"\f", b"v": b"\v"}
_ESC_RE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.S)


def _unescape(s: str) -> str:
    """Undo babeltrace2's C-style string escapes (\\n, \\", \\xHH, ...)."""
    if "\\" not in s:
        return s

    def repl(m: re.Match[bytes]) -> bytes:
        g = m.group(1)
        if g[:1] == b"x" and len(g) == 3:
            return bytes([int(g[1:], 16)])
        return _ESCAPES.get(g, g)

    return _ESC_RE.sub(repl, s.encode("utf-8", "surrogateescape")).decode("utf-8", "replace")


def _ints(strings: pa.Array) -> pa.Array:
    """Decimal/hex strings (nulls kept) -> int64; hex above 2**63 wraps like C's int64 cast."""
    hexmask = pc.starts_with(strings, "0x")
    if not pc.any(hexmask).as_py():
        try:
            return pc.cast(strings, pa.int64())
        except pa.ArrowInvalid:  # a uint64 above 2**63: wrap like C's int64 cast (rare)
            vals = [None if v is None else ((int(v) + (1 << 63)) % (1 << 64)) - (1 << 63) for v in strings.to_pylist()]
            return pa.array(vals, type=pa.int64())
    dec = pc.cast(pc.if_else(hexmask, pa.scalar(None, pa.string()), strings), pa.int64())
    hexes = strings.filter(hexmask).to_pylist()
    vals = np.array([int(h, 16) & 0xFFFFFFFFFFFFFFFF for h in hexes], dtype=np.uint64).view(np.int64)
    return pc.replace_with_mask(dec, pc.fill_null(hexmask, False), pa.array(vals, type=pa.int64()))


def _dict_strings(strings: pa.Array) -> pa.DictionaryArray:
    enc = pc.dictionary_encode(strings)
    values = enc.dictionary.to_pylist()
    if any("\\" in v for v in values):
        enc = pa.DictionaryArray.from_arrays(enc.indices, pa.array([_unescape(v) for v in values]))
    return enc.cast(_DICT)


def _struct_field(extracted: pa.StructArray, name: str) -> pa.Array:
    """A field of extract_regex's struct, null wherever the regex did not match."""
    return pc.struct_field(extracted, name) if extracted.null_count == 0 else _with_parent_nulls(extracted, name)


def _with_parent_nulls(extracted: pa.StructArray, name: str) -> pa.Array:
    child = extracted.field(name)
    return pc.if_else(pc.is_valid(extracted), child, pa.scalar(None, child.type))


# -- parsing ------------------------------------------------------------------------------------
def _horner(mat: np.ndarray, ndigits: np.ndarray) -> np.ndarray:
    """Integers from rows of digit values (0..9), using the first `ndigits[i]` columns of row i."""
    val = np.zeros(len(mat), dtype=np.int64)
    for j in range(mat.shape[1] if len(mat) else 0):
        take = j < ndigits
        val = np.where(take, val * 10 + mat[:, j].astype(np.int64), val)
    return val


_PAD = 64  # zero bytes after every block, so fixed-width windows never run off the end


def _gather(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """Rows buf[pos[i] : pos[i] + width] as an (n, width) uint8 matrix (row copies, no index matrix)."""
    windows = np.lib.stride_tricks.sliding_window_view(buf, width)
    return windows[np.clip(pos, 0, len(windows) - 1)]


def _ints_at(buf: np.ndarray, pos: np.ndarray, stop: int = 44, with_end: bool = False) -> Any:
    """Decimal integers at byte positions `pos` -> (values, ok); not ok: hex, enum, overflow.

    A number must end at `stop` (default ','), a space, a newline or '}'. With with_end, also
    returns the position just after each number.
    """
    if len(pos) == 0:
        z = np.zeros(0, dtype=np.int64)
        return (z, z.astype(bool), z) if with_end else (z, z.astype(bool))
    neg = buf[pos] == 45  # '-'
    p = pos + neg
    width = 12  # most numbers are short: widen only if one fills the window
    digits = _gather(buf, p, width) - np.uint8(48)  # uint8: non-digits wrap above 9
    isdigit = digits <= 9
    if isdigit.all(axis=1).any():
        width = 19
        digits = _gather(buf, p, width) - np.uint8(48)
        isdigit = digits <= 9
    nd = np.where(isdigit.all(axis=1), width, np.argmin(isdigit, axis=1))
    after = buf[np.minimum(p + nd, len(buf) - 1)]
    ok = (nd >= 1) & (nd <= 18) & ((after == stop) | (after == 32) | (after == 10) | (after == 125))
    nd = np.where(ok, nd, 0)
    val = _horner(digits[:, : int(nd.max())], nd)
    val = np.where(neg, -val, val)
    return (val, ok, p + nd) if with_end else (val, ok)


def _strings_from_segments(buf: np.ndarray, start: np.ndarray, length: np.ndarray, valid: np.ndarray) -> pa.Array:
    """A string array of buf[start:start+length] per row (copied contiguous), null where not valid."""
    n = len(start)
    length = np.where(valid, length, 0)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(length, out=offsets[1:])
    total = int(offsets[-1])
    width = int(length.max()) if n else 0
    if total == 0:
        data = np.zeros(0, np.uint8)
    elif width <= _PAD:  # fixed-width row copies, then keep each row's first `length` bytes
        data = _gather(buf, start, width)[np.arange(width) < length[:, None]]
    else:
        data = buf[np.repeat(start - offsets[:-1], length) + np.arange(total)]
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data), bitmap)


class _Block:
    """One block of babeltrace2 pretty lines, parsed with numpy/arrow searches instead of regex captures."""

    def __init__(self, lines: pa.StringArray, padded: np.ndarray | None = None) -> None:
        """`lines`: each element one whole line with its newline, offset 0, no nulls. `padded`: the
        lines' data buffer as numpy, already followed by _PAD zero bytes (else it is copied)."""
        _, offsets, data = lines.buffers()
        self.lines = lines
        self.n = len(lines)
        off = np.frombuffer(offsets, dtype=np.int32, count=self.n + 1).astype(np.int64)
        if padded is not None:
            self.buf = padded
        else:
            self.buf = np.zeros(int(off[-1]) + _PAD, dtype=np.uint8)
            if self.n:
                self.buf[: int(off[-1])] = np.frombuffer(data, dtype=np.uint8, count=int(off[-1]))
        self.starts = off[:-1]
        self.ends = off[1:] - 1  # the newline
        self._finds: dict[str, np.ndarray] = {}
        self._quotes: np.ndarray | None = None
        self._backslashes: np.ndarray | None = None
        self._closers: np.ndarray | None = None
        self._name_end: np.ndarray | None = None
        self.scope_cache: dict[str, np.ndarray] | None = None
        self.cursor: dict[str, np.ndarray] = {}  # per scope: where the field after the last parsed one starts
        self._subs: dict[tuple[str, ...], tuple[_Block, np.ndarray]] = {}

    @classmethod
    def from_buffer(cls, padded: np.ndarray, nbytes: int) -> _Block:
        """Lines of padded[:nbytes] (whole lines), where padded[nbytes:] holds >= _PAD zero bytes."""
        nl = np.flatnonzero(padded[:nbytes] == 10)
        offsets = np.empty(len(nl) + 1, dtype=np.int32)
        offsets[0] = 0
        offsets[1:] = nl + 1
        return cls(pa.StringArray.from_buffers(len(nl), pa.py_buffer(offsets), pa.py_buffer(padded)), padded)

    @classmethod
    def from_bytes(cls, block: bytes) -> _Block:
        padded = np.zeros(len(block) + _PAD, dtype=np.uint8)
        padded[: len(block)] = np.frombuffer(block, dtype=np.uint8)
        return cls.from_buffer(padded, len(block))

    def subset(self, key: tuple[str, ...], rows: np.ndarray) -> tuple[_Block, np.ndarray]:
        """A block of only the selected lines (cached per event filter) and their row numbers."""
        if key not in self._subs:
            idx = np.flatnonzero(rows)
            sub = _Block(self.lines.take(pa.array(idx)))
            shift = sub.starts - self.starts[idx]
            sub._name_end = self.name_end[idx] + shift
            sc = _scopes(self)  # positions move with their lines; -1 (absent) stays -1
            sub.scope_cache = {
                k: v[idx] if k == "known" else np.where(v[idx] >= 0, v[idx] + shift, -1) for k, v in sc.items()
            }
            self._subs[key] = (sub, idx)
        return self._subs[key]

    def find(self, needle: str) -> np.ndarray:
        """Relative position of the first `needle` in each line (-1 if absent)."""
        if needle not in self._finds:
            self._finds[needle] = pc.find_substring(self.lines, needle).to_numpy().astype(np.int64)
        return self._finds[needle]

    @property
    def quotes(self) -> np.ndarray:
        if self._quotes is None:
            self._quotes = np.flatnonzero(self.buf == 34)
        return self._quotes

    @property
    def name_end(self) -> np.ndarray:
        """Absolute position of the ':' that ends each line's event name."""
        if self._name_end is None:
            colon = self.find(": ")
            self._name_end = np.where(colon >= 0, self.starts + colon, self.ends - 1)
        return self._name_end

    def find_rows(self, needle: str, rows: np.ndarray) -> np.ndarray:
        """Like find() but only for the selected rows (-1 elsewhere); searches a subset when sparse."""
        if needle in self._finds or rows.mean() > 0.5:
            return np.where(rows, self.find(needle), -1)
        out = np.full(self.n, -1, dtype=np.int64)
        idx = np.flatnonzero(rows)
        if len(idx):
            out[idx] = pc.find_substring(self.lines.take(pa.array(idx)), needle).to_numpy().astype(np.int64)
        return out

    @property
    def closers(self) -> np.ndarray:
        """Positions of every '}' in the block."""
        if self._closers is None:
            self._closers = np.flatnonzero(self.buf == 125)
        return self._closers

    @property
    def backslashes(self) -> np.ndarray:
        if self._backslashes is None:
            self._backslashes = np.flatnonzero(self.buf == 92)
        return self._backslashes


def _valid_utf8(block: bytes | np.ndarray, nbytes: int, source: str | Path | None) -> bytes | np.ndarray:
    """`block` itself when its text is valid UTF-8; else a copy with the bad bytes replaced, and a warning.

    A flipped byte in a CTF string field (a comm, a filename) reaches us as raw bytes; keeping the
    event with U+FFFD in that string loses less than refusing the whole trace.
    """
    raw = block if isinstance(block, bytes) else memoryview(block)[: nbytes if nbytes >= 0 else len(block)]
    whole = pa.StringArray.from_buffers(1, pa.py_buffer(np.array([0, len(raw)], dtype=np.int32)), pa.py_buffer(raw))
    try:
        whole.validate(full=True)
        return block
    except pa.ArrowInvalid:
        pass
    lines = bytes(raw).split(b"\n")
    bad = 0
    for i, line in enumerate(lines):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            lines[i] = line.decode("utf-8", "replace").encode("utf-8")
            bad += 1
    where = f"{source}: " if source else ""
    warnings.warn(
        f"{where}{bad} event(s) hold invalid UTF-8 in a string field (corrupt trace?); "
        "kept with the bad bytes replaced by U+FFFD",
        stacklevel=3,
    )
    return b"\n".join(lines)


def parse_pretty_block(
    block: bytes | np.ndarray, fields: Sequence[Field] = (), source: str | Path | None = None, nbytes: int = -1
) -> pa.RecordBatch:
    """Parse whole lines of our sink.text.pretty output into a RecordBatch (ts, event, cpu, *fields).

    `block` is bytes, or a uint8 array whose first `nbytes` bytes are the lines, followed by at
    least 64 zero bytes (what iter_ctf_batches builds, to avoid copies).

    Positions come from arrow's substring search and values from numpy digit arithmetic; rows
    the fast path cannot decode (hex or enum integers, escaped strings, odd scopes) go through
    the regex parser, so the result always equals parse_pretty_lines_regex's.
    """
    block = _valid_utf8(block, nbytes, source)
    b = _Block.from_buffer(block, nbytes) if isinstance(block, np.ndarray) else _Block.from_bytes(block)
    n, buf, starts = b.n, b.buf, b.starts
    if n == 0:
        return empty_batch(fields)
    neg = buf[starts + 1] == 45
    k = bytes(buf[:64]).find(b".")  # "[SECONDS.": the same width on every line of a block, mostly
    if k > 1 and not neg.any() and (buf[starts + k] == 46).all():
        digits = _gather(buf, starts + 1, k + 9) - np.uint8(48)  # seconds, '.', nanoseconds
        sec = _horner(digits[:, : k - 1], np.full(n, k - 1))
        sec_ok = (digits[:, : k - 1] <= 9).all(axis=1) & (k - 1 <= 18)
        nsm = digits[:, k:]
        dot = starts + k
    else:
        dot = starts + b.find(".")
        sec, sec_ok = _ints_at(buf, starts + 1 + neg, stop=46)  # seconds end at the '.'
        nsm = _gather(buf, dot + 1, 9) - np.uint8(48)
        sec_ok &= dot > starts
    good = (
        (buf[starts] == 91)
        & sec_ok
        & (buf[np.minimum(dot + 10, len(buf) - 1)] == 93)
        & (buf[np.minimum(dot + 11, len(buf) - 1)] == 32)
        & (nsm <= 9).all(axis=1)
    )
    colon = b.find(": ")
    name_end = np.where(colon >= 0, starts + colon, b.ends - 1)
    b._name_end = name_end
    name_start = dot + 12
    good &= (name_end > name_start) & (buf[np.minimum(name_end, len(buf) - 1)] == 58)
    if not good.all():  # not our layout: let the regex parser decide (it names the bad line)
        return parse_pretty_lines_regex(b.lines, fields, source)
    ts = sec * 1_000_000_000 + _horner(nsm, np.full(n, 9))
    ts = np.where(neg, -ts, ts)
    names = _strings_from_segments(buf, name_start, name_end - name_start, np.ones(n, dtype=bool))
    event = pc.dictionary_encode(names).cast(_DICT)
    cpu_key = np.frombuffer(b"stream.packet.context = { cpu_id = ", dtype=np.uint8)
    has_cpu = (_gather(buf, name_end + 2, len(cpu_key)) == cpu_key).all(axis=1)  # right after the name
    cpu_val, cpu_ok = _ints_at(buf, np.where(has_cpu, name_end + 2 + len(cpu_key), 0))
    cpu = pa.array(cpu_val.astype(np.int32), mask=~(has_cpu & cpu_ok))
    cols: dict[str, pa.Array] = {"ts": pa.array(ts, type=pa.int64()), "event": event, "cpu": cpu}
    dict_names = event.dictionary.to_pylist()
    codes = event.indices.to_numpy(zero_copy_only=False)
    for f in fields:
        cols[f.out] = _fast_field(b, f, dict_names, codes)
    return pa.RecordBatch.from_pydict(cols)


_MATCHES: dict[tuple[tuple[str, ...], str], bool] = {}


def _matches(patterns: tuple[str, ...], name: str) -> bool:
    """fnmatch of an event name against patterns, memoised (asked for every batch's vocabulary)."""
    key = (patterns, name)
    hit = _MATCHES.get(key)
    if hit is None:
        if len(_MATCHES) > 100_000:
            _MATCHES.clear()
        hit = _MATCHES[key] = any(fnmatch.fnmatchcase(name, p) for p in patterns)
    return hit


def _fast_field(b: _Block, f: Field, names: list[str], codes: np.ndarray) -> pa.Array:
    type_ = pa.int64() if f.kind == "int" else _DICT
    if f.events is None:
        return _field_values(b, f)
    wanted = [i for i, nm in enumerate(names) if _matches(f.events, nm)]
    if not wanted:
        return pa.nulls(b.n, type=type_)
    rows = np.isin(codes, wanted)
    if rows.all():
        return _field_values(b, f)
    # search only the selected lines (a substring search costs the whole line where it fails)
    sub, idx = b.subset(f.events, rows)
    vals = _field_values(sub, f)
    where = np.full(b.n, -1, dtype=np.int64)
    where[idx] = np.arange(len(idx))
    return vals.take(pa.array(where, mask=where < 0))


def _expect(buf: np.ndarray, pos: np.ndarray, literal: bytes) -> np.ndarray:
    """Rows whose bytes at `pos` spell `literal` (False where pos < 0)."""
    width = -(-len(literal) // 8) * 8  # compare 8 bytes at a time
    padded = np.zeros(width, dtype=np.uint8)
    padded[: len(literal)] = np.frombuffer(literal, dtype=np.uint8)
    mask = np.zeros(width, dtype=np.uint8)
    mask[: len(literal)] = 0xFF
    words = np.ascontiguousarray(_gather(buf, pos, width)).view("<u8")
    return (pos >= 0) & ((words & mask.view("<u8")) == padded.view("<u8")).all(axis=1)


_PACKET_CTX = b"stream.packet.context = { "
_EVENT_CTX = b"stream.event.context = { "
_PAYLOAD = b"event.fields = { "


def _first_after(sorted_pos: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The first element of sorted_pos at or after each pos (a huge value when none)."""
    if len(sorted_pos) == 0:
        return np.full(len(pos), np.iinfo(np.int64).max)
    i = np.searchsorted(sorted_pos, pos)
    return np.where(i < len(sorted_pos), sorted_pos[np.minimum(i, len(sorted_pos) - 1)], np.iinfo(np.int64).max)


def _scopes(b: _Block) -> dict[str, np.ndarray]:
    """Where each line's scopes are, from the layout: packet context, stream event context, payload.

    Returns absolute positions (-1 when absent): `ctx` / `ctx_end` (the stream event context's
    first field and closing brace), `pay` (the payload's first field), and `known` (rows whose
    layout was fully recognised; the others are searched for their fields).
    """
    if b.scope_cache is not None:
        return b.scope_cache
    buf, ends = b.buf, b.ends
    closers = b.closers
    cur = b.name_end + 2
    done = cur > ends  # "name:" with nothing after it

    def close_scope(open_: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(closing brace, next scope start, line ends after it) for rows whose scope opens at start."""
        close = _first_after(closers, start)
        close = np.where(open_ & (close < ends), close, -1)
        after = np.where(close >= 0, close + 1, 0)
        at_end = open_ & (close >= 0) & (buf[after] == 10)
        more = open_ & (close >= 0) & (buf[after] == 44) & (buf[after + 1] == 32)
        return close, np.where(more, after + 2, -1), at_end

    pk = ~done & _expect(buf, cur, _PACKET_CTX)
    _, nxt, pk_end = close_scope(pk, cur)
    done = done | pk_end
    cur = np.where(pk, nxt, cur)
    ev = ~done & _expect(buf, cur, _EVENT_CTX)
    ctx = np.where(ev, cur + len(_EVENT_CTX), -1)
    ctx_end, nxt, ev_end = close_scope(ev, cur)
    done = done | ev_end
    cur = np.where(ev, nxt, cur)
    pf = ~done & _expect(buf, cur, _PAYLOAD)
    pay = np.where(pf, cur + len(_PAYLOAD), -1)
    b.scope_cache = {"ctx": ctx, "ctx_end": ctx_end, "pay": pay, "known": done | pf}
    return b.scope_cache


def _field_values(b: _Block, f: Field) -> pa.Array:
    """Values of field `f` on every line of block `b` (null where absent).

    Fast path: the field sits where the layout says (first in its scope, or right after the
    field parsed before it in that scope). Other rows use a substring search; undecodable values
    go to the regex.
    """
    n, buf, starts = b.n, b.buf, b.starts
    sc = _scopes(b)
    name_eq = f"{f.name} = ".encode()
    cands = []
    if f.scope in ("context", "any"):
        cands += [b.cursor.get("context", np.full(n, -1)), sc["ctx"]]
    if f.scope in ("payload", "any"):
        cands += [b.cursor.get("payload", np.full(n, -1)), sc["pay"]]
    hit = np.zeros(n, dtype=bool)
    vpos = np.zeros(n, dtype=np.int64)
    hit_scope = np.zeros(n, dtype=np.int8)  # 1 context, 2 payload
    for i, c in enumerate(cands):
        ok = ~hit & _expect(buf, c, name_eq)
        vpos = np.where(ok, c + len(name_eq), vpos)
        hit_scope = np.where(ok, 1 if (f.scope == "context" or (f.scope == "any" and i < 2)) else 2, hit_scope)
        hit |= ok
    # rows the layout did not settle: search for the key (only those rows)
    search = ~hit & (~sc["known"] | (sc["ctx"] >= 0 if f.scope == "context" else sc["pay"] >= 0))
    if f.scope == "any":
        search = ~hit & (~sc["known"] | (sc["ctx"] >= 0) | (sc["pay"] >= 0))
    key = f" {f.name} = "
    slow = np.zeros(n, dtype=bool)
    if search.any():
        pos = b.find_rows(key, search)
        found = search & (pos >= 0)
        ab = starts + pos
        if f.scope == "any":
            in_scope = found
        elif f.scope == "payload":
            pay = np.where(sc["known"], sc["pay"], starts + b.find_rows("event.fields = {", found & ~sc["known"]))
            in_scope = found & (pay >= starts) & (ab > pay)
        else:
            ctx = b.find_rows("event.context = {", found)
            ctx_abs = starts + ctx
            in_scope = found & (ctx >= 0) & (ab > ctx_abs) & (ab < _first_after(b.closers, ctx_abs))
        slow |= found & ~in_scope  # a later occurrence may be in scope: ask the regex
        vpos = np.where(in_scope, ab + len(key), vpos)
        hit |= in_scope
        hit_scope = np.where(in_scope, 1 if f.scope == "context" else 2, hit_scope)
    vpos = np.where(hit, vpos, 0)
    if f.kind == "int":
        val, ok, vend = _ints_at(buf, vpos, with_end=True)
        fast = hit & ok
        slow |= hit & ~ok
        out = pa.array(val, type=pa.int64(), mask=~fast)
    else:
        quoted = hit & (buf[vpos] == 34)
        close = _first_after(b.quotes, vpos + 1)
        escaped = (np.searchsorted(b.backslashes, close) - np.searchsorted(b.backslashes, vpos)) > 0
        fast = quoted & (close < b.ends) & ~escaped
        slow |= hit & ~fast
        close = np.where(fast, close, vpos)
        out = _strings_from_segments(buf, vpos + 1, close - vpos - 1, fast)
        vend = close + 1
    for code, scope in ((1, "context"), (2, "payload")):  # where the next field may start
        b.cursor[scope] = np.where(fast & (hit_scope == code), vend + 2, -1)
    if slow.any():
        out = pc.replace_with_mask(out, pa.array(slow), _regex_values(b.lines, f, np.flatnonzero(slow)))
    return out if f.kind == "int" else _dict_strings(out)


def _regex_values(lines: pa.Array, f: Field, idx: np.ndarray) -> pa.Array:
    raw = _struct_field(pc.extract_regex(lines.take(pa.array(idx)), f.pattern), "v")
    return _ints(raw) if f.kind == "int" else raw


def parse_pretty_lines_regex(
    lines: pa.Array, fields: Sequence[Field] = (), source: str | Path | None = None
) -> pa.RecordBatch:
    """Reference parser: the same result as parse_pretty_block, by regex (slower; used as fallback)."""
    hdr = pc.extract_regex(lines, _HEADER)
    if hdr.null_count:
        bad = int(np.flatnonzero(pc.is_null(hdr).to_numpy(zero_copy_only=False))[0])
        text = str(lines[bad].as_py())[:120].rstrip()
        raise TraceSynthError(f"unexpected babeltrace2 output line {text!r}", source)
    s = pc.cast(pc.struct_field(hdr, "s"), pa.int64())
    ns = pc.cast(pc.struct_field(hdr, "ns"), pa.int64())
    ts = pc.add(pc.multiply(s, 1_000_000_000), ns)
    neg = pc.equal(pc.struct_field(hdr, "sign"), "-")
    if pc.any(neg).as_py():
        ts = pc.if_else(neg, pc.negate(ts), ts)
    event = pc.dictionary_encode(pc.struct_field(hdr, "name")).cast(_DICT)
    cpu_str = pc.struct_field(hdr, "cpu")
    cpu = pc.cast(pc.if_else(pc.equal(cpu_str, ""), pa.scalar(None, pa.string()), cpu_str), pa.int32())
    cols: dict[str, pa.Array] = {"ts": ts, "event": event, "cpu": cpu}
    names = event.dictionary.to_pylist()
    codes = event.indices
    for f in fields:
        cols[f.out] = _extract_field(lines, f, names, codes)
    return pa.RecordBatch.from_pydict(cols)


def _extract_field(lines: pa.Array, f: Field, names: list[str], codes: pa.Array) -> pa.Array:
    n = len(lines)
    type_ = pa.int64() if f.kind == "int" else _DICT
    if f.events is None:
        sel = None
        subset = lines
    else:
        wanted = [i for i, nm in enumerate(names) if _matches(f.events, nm)]
        if not wanted:
            return pa.nulls(n, type=type_)
        sel = pc.is_in(codes, pa.array(wanted, type=codes.type))
        subset = lines.filter(sel)
    raw = _struct_field(pc.extract_regex(subset, f.pattern), "v")
    vals = _ints(raw) if f.kind == "int" else _dict_strings(raw)
    if sel is None:
        return vals
    # scatter the subset's values back to their rows
    idx = np.full(n, -1, dtype=np.int64)
    where = np.flatnonzero(sel.to_numpy(zero_copy_only=False))
    idx[where] = np.arange(len(where))
    take = pa.array(idx, mask=idx < 0)
    return vals.take(take)


def _lines_from_block(block: bytes) -> pa.Array:
    """Zero-copy string array of the lines of `block` (each keeps its trailing newline)."""
    buf = np.frombuffer(block, dtype=np.uint8)
    nl = np.flatnonzero(buf == 10)
    offsets = np.empty(len(nl) + 1, dtype=np.int32)
    offsets[0] = 0
    offsets[1:] = nl + 1
    return pa.StringArray.from_buffers(len(nl), pa.py_buffer(offsets), pa.py_buffer(block))


def _drain(stream: Any, q: queue.Queue, chunk: int, stop: threading.Event) -> None:
    fd = stream.fileno()
    try:
        while not stop.is_set():
            data = os.read(fd, chunk)
            if not data:
                break
            q.put(data)
    except OSError:
        pass
    finally:
        q.put(None)


def _take_lines(chunks: list[bytes], size: int, done: bool) -> tuple[np.ndarray, int, list[bytes]]:
    """Copy the whole lines of `chunks` into one zero-padded buffer: (buffer, its line bytes, rest).

    At the end of the stream (done) everything is taken, with a final newline added if missing.
    """
    cut, acc = -1, size
    if done:
        cut = size
    else:
        for chunk in reversed(chunks):
            acc -= len(chunk)
            i = chunk.rfind(b"\n")
            if i >= 0:
                cut = acc + i + 1
                break
    if cut <= 0:
        return np.zeros(_PAD, dtype=np.uint8), 0, chunks
    buf = np.empty(cut + 1 + _PAD, dtype=np.uint8)
    pos, rest = 0, []
    for chunk in chunks:
        take = max(0, min(len(chunk), cut - pos))
        if take:
            buf[pos : pos + take] = np.frombuffer(chunk, dtype=np.uint8, count=take)
        if take < len(chunk):
            rest.append(chunk[take:])
        pos += take
    nbytes = cut
    if done and buf[cut - 1] != 10:
        buf[cut] = 10
        nbytes += 1
    buf[nbytes:] = 0
    return buf, nbytes, rest


def stall_seconds() -> float:
    """Seconds without output after which a decoding tool (babeltrace2, perf script) counts as stuck.

    Both can loop forever on some corrupt inputs; TRACESYNTH_STALL_SECONDS overrides the default.
    """
    try:
        return max(1.0, float(os.environ.get("TRACESYNTH_STALL_SECONDS", "120")))
    except ValueError:
        return 120.0


_PERF_STREAM = re.compile(r"^perf_stream_(\d+)$")


def stream_warnings(path: str | Path) -> list[str]:
    """Stream files of the CTF trace(s) under `path` that babeltrace2 would skip without a word.

    babeltrace2 reads whatever stream files it finds: a 0-byte one, or one deleted from the
    directory, just leaves that CPU out. We name them: empty files; LTTng streams listed in
    `index/` (one `NAME.idx` per stream) whose data file is gone; gaps in perf's per-CPU
    `perf_stream_N` numbering (a deleted file, or a CPU that recorded nothing).
    """
    path = Path(path)
    out = []
    metas = [path / "metadata"] if (path / "metadata").is_file() else sorted(path.rglob("metadata"))
    for meta in metas:
        d = meta.parent
        files = {p.name: p for p in d.iterdir() if p.is_file() and p.name != "metadata" and not p.name.startswith(".")}
        empty = sorted(n for n, p in files.items() if p.stat().st_size == 0)
        if empty:
            out.append(f"{d}: empty stream file(s) {', '.join(empty)} (no events read from them)")
        index = d / "index"
        listed = {p.name[: -len(".idx")] for p in index.glob("*.idx")} if index.is_dir() else set()
        gone = sorted(listed - set(files))
        nums = sorted(int(m.group(1)) for n in files if (m := _PERF_STREAM.match(n)))
        if nums:
            gone += [f"perf_stream_{i}" for i in sorted(set(range(nums[-1] + 1)) - set(nums))]
        if gone:
            out.append(f"{d}: stream file(s) {', '.join(gone)} missing (deleted?); the trace lacks their events")
    return out


def iter_ctf_batches(
    path: str | Path,
    fields: Sequence[Field] = (),
    batch_bytes: int = 16 << 20,
    on_progress: Callable[[int], None] | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[pa.RecordBatch]:
    """Yield RecordBatches (ts, event, cpu, *fields) for every event of the CTF trace at `path`.

    Memory stays within a few `batch_bytes` of text whatever the trace length. `on_progress`
    receives the number of events in each batch (default: the `progress_callback` context
    variable). Raises TraceSynthError naming `path` when
    babeltrace2 fails (after the events it could read were parsed: callers building one table
    discard them) or when it prints nothing.
    """
    path = Path(path)
    if not path.exists():
        raise TraceSynthError("no such file or directory", path)
    for msg in stream_warnings(path):
        warnings.warn(msg, stacklevel=3)
    on_progress = on_progress or progress_callback.get()
    if selected_decoder() == "native" and not extra_args:
        native = _native_batches(path, fields, on_progress)
        if native is not None:
            yield from native
            return
    if batch_bytes >= 1 << 31:
        raise ValueError("batch_bytes must stay below 2 GiB (int32 string offsets)")
    cmd = [babeltrace2_binary(), str(path), *extra_args, "-c", "sink.text.pretty", "-p", _PRETTY_PARAMS]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        q: queue.Queue = queue.Queue(maxsize=max(4, batch_bytes // (1 << 20)))  # ~one block in flight
        stop = threading.Event()
        reader = threading.Thread(target=_drain, args=(proc.stdout, q, 1 << 20, stop), daemon=True)
        reader.start()
        stall = stall_seconds()
        try:
            pending: list[bytes] = []
            size = 0
            done = False
            while not done:
                try:
                    data = q.get(timeout=stall)
                except queue.Empty:
                    raise TraceSynthError(
                        f"babeltrace2 printed nothing for {stall:g} s (stuck on a corrupt trace?)", path
                    ) from None
                if data is None:
                    done = True
                else:
                    pending.append(data)
                    size += len(data)
                if size >= batch_bytes or (done and size):
                    block, nbytes, pending = _take_lines(pending, size, done)
                    size = sum(len(p) for p in pending)
                    if nbytes:
                        batch = parse_pretty_block(block, fields, path, nbytes=nbytes)
                        if on_progress is not None:
                            on_progress(batch.num_rows)
                        yield batch
            rc = proc.wait()
            if rc != 0:
                err.seek(0)
                msg = _root_cause(err.read().decode("utf-8", "replace"))
                raise TraceSynthError(f"babeltrace2 cannot read this trace (truncated or corrupt?): {msg}", path)
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            reader.join(timeout=5)


def _native_batches(
    path: Path, fields: Sequence[Field], on_progress: Callable[[int], None] | None
) -> Iterator[pa.RecordBatch] | None:
    """The trace decoded by tracesynth.io.ctf, batch by batch, or None (with a warning) when its
    metadata uses a layout that decoder does not handle: babeltrace2 then reads it."""
    from tracesynth.io.ctf import Unsupported, native_batches

    try:
        batches = native_batches(path, fields)  # metadata and decoders ready: no Unsupported later
    except Unsupported as exc:
        warnings.warn(f"{path}: the native CTF decoder cannot read this trace ({exc}); using babeltrace2", stacklevel=4)
        return None
    if on_progress is None:
        return batches
    return _counted(batches, on_progress)


def _counted(batches: Iterator[pa.RecordBatch], on_progress: Callable[[int], None]) -> Iterator[pa.RecordBatch]:
    for b in batches:
        on_progress(b.num_rows)
        yield b


def empty_batch(fields: Sequence[Field] = ()) -> pa.RecordBatch:
    """A zero-row batch with the columns iter_ctf_batches yields for `fields`."""
    cols = {
        "ts": pa.array([], pa.int64()),
        "event": pa.array([], pa.string()).dictionary_encode().cast(_DICT),
        "cpu": pa.array([], pa.int32()),
    }
    for f in fields:
        cols[f.out] = (
            pa.array([], pa.int64()) if f.kind == "int" else pa.array([], pa.string()).dictionary_encode().cast(_DICT)
        )
    return pa.RecordBatch.from_pydict(cols)
