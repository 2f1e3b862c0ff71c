"""Stream any CTF trace through the `babeltrace2` CLI as Arrow record batches.

Reading CTF with bt2's Python field access runs at ~30k events/s; the `babeltrace2` text sink
alone emits ~500k events/s. So we run the CLI as a subprocess with a fixed, parseable
`sink.text.pretty` layout and parse big blocks of its output with vectorised pyarrow regex
kernels (no Python per event). A reader thread drains the pipe into a bounded queue, so the
subprocess never stalls while a block is being parsed and memory stays flat in trace length.

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

    ctf_metadata(path)  # {"env": {...}, "clocks": [{"name", "freq", "offset_s", "offset", ...}], "uuid"}

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


def run_babeltrace2(args: Sequence[str], path: str | Path, timeout: float | None = 120) -> str:
    """Run babeltrace2 to completion and return stdout (small outputs only: metadata, queries)."""
    proc = subprocess.run(
        [babeltrace2_binary(), *args], capture_output=True, text=True, errors="replace", timeout=timeout
    )
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


def ctf_metadata(path: str | Path) -> dict[str, Any]:
    """Environment, clocks and trace UUID of one CTF trace directory (via `-o ctf-metadata`)."""
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
    }


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
        return pc.cast(strings, pa.int64())
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
def parse_pretty_lines(
    lines: pa.Array, fields: Sequence[Field] = (), source: str | Path | None = None
) -> pa.RecordBatch:
    """Parse a block of sink.text.pretty lines (our parameter set) into a RecordBatch."""
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
        wanted = [i for i, nm in enumerate(names) if any(fnmatch.fnmatchcase(nm, p) for p in f.events)]
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
    on_progress = on_progress or progress_callback.get()
    if batch_bytes >= 1 << 31:
        raise ValueError("batch_bytes must stay below 2 GiB (int32 string offsets)")
    cmd = [babeltrace2_binary(), str(path), *extra_args, "-c", "sink.text.pretty", "-p", _PRETTY_PARAMS]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        q: queue.Queue = queue.Queue(maxsize=max(4, (2 * batch_bytes) // (1 << 20)))
        stop = threading.Event()
        reader = threading.Thread(target=_drain, args=(proc.stdout, q, 1 << 20, stop), daemon=True)
        reader.start()
        try:
            pending: list[bytes] = []
            size = 0
            done = False
            while not done:
                data = q.get()
                if data is None:
                    done = True
                else:
                    pending.append(data)
                    size += len(data)
                if size >= batch_bytes or (done and size):
                    block = b"".join(pending)
                    cut = len(block) if done else block.rfind(b"\n") + 1
                    rest = block[cut:]
                    pending, size = ([rest], len(rest)) if rest else ([], 0)
                    if cut:
                        if done and not block.endswith(b"\n"):
                            block += b"\n"
                            cut += 1
                        batch = parse_pretty_lines(_lines_from_block(block[:cut]), fields, path)
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
