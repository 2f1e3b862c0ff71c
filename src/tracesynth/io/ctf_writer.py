"""Write a Trace as a CTF 1.8 trace laid out like an LTTng kernel trace (babeltrace2 reads it back),
or as CTF 2 (`ctf_version="2"`: the same data streams, JSON metadata; babeltrace2 2.1+ and
tracesynth's native reader read it, Debian's babeltrace2 2.0.4 does not).

Layout (what `read_lttng` reads back exactly):

- `metadata`: plain-text TSDL starting with the `/* CTF 1.8` line Trace Compass requires (or CTF 2's
  JSON text sequence, its field names without TSDL's leading underscore). The env says
  `domain = "kernel"`, `tracer_name = "lttng-modules"` (so trace tools treat it as a kernel trace)
  plus `tracesynth = 1` and the trace's metadata as JSON (`tracesynth_metadata`). One clock
  (`monotonic`, 1 GHz) whose offset holds whole seconds of the first timestamp, so cycles stay
  small and non-negative.
- One stream file per CPU (`channel0_<cpu>`, packet context `cpu_id`); rows with a null CPU go to
  one `channel0_nocpu` stream of a second stream class without `cpu_id`.
- Every event carries LTTng-style context fields `_tid` (int32, -1 = unknown) and `_procname`
  (string, `<unknown>` = unknown), as `lttng add-context -t tid -t procname` would, so threads round-trip
  exactly even where no sched_switch precedes an event.
- Event classes are keyed by (name, has ret): rows with a non-null `ret` use a class whose payload
  is `int64 _ret` (syscall exits, like lttng-modules), the others a class without it, so null
  `ret` round-trips too. `sched_switch` also carries lttng-modules' payload: prev_* is the row's
  own thread (the task switching out), next_* the thread of the next event on the same CPU (or
  `swapper/<cpu>`, tid 0, when none follows).

All fields are byte-aligned and little-endian, so records are built for many events at once with
numpy (fixed parts written column by column, the variable `_procname` bytes scattered by length)
instead of a Python loop per event. Limits: event names must be printable without spaces,
quotes, backslashes or commas; tids must fit int32; a comm of "" or "<unknown>" reads back as null
(babeltrace2 2.0 shows a stale value for an empty string field, so unknown comms are never written
empty). Rows with
equal timestamps on different CPUs come back in babeltrace2's stream-merge order.
"""

from __future__ import annotations

import json
import re
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import BinaryIO

import numpy as np

from atomicio import atomic_path
from tracesynth.errors import TraceSynthError
from tracesynth.trace import Trace

CTF_MAGIC = 0xC1FC1FC1
CTF_VERSIONS = ("1.8", "2")
TASK_COMM_LEN = 16  # sched_switch prev_comm/next_comm are char[16] in lttng-modules
NULL_COMM = "<unknown>"  # written for a null comm (never "": babeltrace2 2.0.4 misprints empty strings)
_NAME_OK = re.compile(r"[!-~]+")  # printable ASCII without space
_NAME_BAD_CHARS = set('"\\,')
_HEADER_BYTES = 12  # uint32 id + uint64 timestamp
_CTX_FIXED = 4  # int32 _tid, then the NUL-terminated _procname
_SWITCH_BYTES = TASK_COMM_LEN + 4 + 4 + 8 + TASK_COMM_LEN + 4 + 4

_SWITCH_DTYPE = np.dtype(
    [
        ("prev_comm", f"S{TASK_COMM_LEN}"),
        ("prev_tid", "<i4"),
        ("prev_prio", "<i4"),
        ("prev_state", "<i8"),
        ("next_comm", f"S{TASK_COMM_LEN}"),
        ("next_tid", "<i4"),
        ("next_prio", "<i4"),
    ]
)
_PKT_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("uuid", "u1", (16,)),
        ("stream_id", "<u4"),
        ("stream_instance_id", "<u8"),
        ("timestamp_begin", "<u8"),
        ("timestamp_end", "<u8"),
        ("content_size", "<u8"),
        ("packet_size", "<u8"),
        ("packet_seq_num", "<u8"),
        ("events_discarded", "<u8"),
    ]
)
_INT = "integer {{ size = {size}; align = 8; signed = {signed}; encoding = none; base = 10; }}"
_CHAR = "integer { size = 8; align = 8; signed = 0; encoding = UTF8; base = 10; }"


def _tsdl_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _check_names(names: list[str], directory: Path) -> None:
    for name in names:
        if not _NAME_OK.fullmatch(name) or _NAME_BAD_CHARS & set(name):
            raise TraceSynthError(
                f"event name {name!r} cannot be written to CTF (use printable ASCII without spaces, "
                "quotes, backslashes or commas)",
                directory,
            )


def _tsdl_classes(classes: list[tuple[str, bool]], with_cpu: bool, without_cpu: bool, with_context: bool) -> list[str]:
    """The TSDL stream and event blocks."""
    lines: list[str] = []
    context = [
        "\tevent.context := struct {",
        f"\t\t{_INT.format(size=32, signed=1)} _tid;",
        "\t\tstring _procname;",
        "\t};",
    ]
    base_pc = [
        "\t\tuint64_clock_monotonic_t timestamp_begin;",
        "\t\tuint64_clock_monotonic_t timestamp_end;",
        "\t\tuint64_t content_size;",
        "\t\tuint64_t packet_size;",
        "\t\tuint64_t packet_seq_num;",
        "\t\tuint64_t events_discarded;",
    ]
    stream_ids = ([0] if with_cpu else []) + ([1] if without_cpu else [])
    for sid in stream_ids:
        cpu_line = ["\t\tuint32_t cpu_id;"] if sid == 0 else []
        lines += [
            "stream {",
            f"\tid = {sid};",
            "\tevent.header := struct event_header;",
            "\tpacket.context := struct {",
            *base_pc,
            *cpu_line,
            "\t};",
            *(context if with_context else []),
            "};",
            "",
        ]
    for sid in stream_ids:
        for i, (name, has_ret) in enumerate(classes):
            fields = []
            if has_ret:
                fields.append(f"\t\t{_INT.format(size=64, signed=1)} _ret;")
            if name == "sched_switch":
                fields += [
                    f"\t\t{_CHAR} _prev_comm[{TASK_COMM_LEN}];",
                    f"\t\t{_INT.format(size=32, signed=1)} _prev_tid;",
                    f"\t\t{_INT.format(size=32, signed=1)} _prev_prio;",
                    f"\t\t{_INT.format(size=64, signed=1)} _prev_state;",
                    f"\t\t{_CHAR} _next_comm[{TASK_COMM_LEN}];",
                    f"\t\t{_INT.format(size=32, signed=1)} _next_tid;",
                    f"\t\t{_INT.format(size=32, signed=1)} _next_prio;",
                ]
            body = ["\tfields := struct {", *fields, "\t};"] if fields else []
            lines += ["event {", f'\tname = "{name}";', f"\tid = {i};", f"\tstream_id = {sid};", *body, "};", ""]
    return lines


def _metadata_text(
    trace_uuid: uuidlib.UUID,
    offset_s: int,
    classes: list[tuple[str, bool]],
    with_cpu: bool,
    without_cpu: bool,
    trace_meta: dict,
    with_context: bool = True,
) -> str:
    host = str(trace_meta.get("hostname") or "tracesynth")
    meta_json = json.dumps(trace_meta, sort_keys=True, default=str)
    lines = [
        "/* CTF 1.8 */",
        "",
        "typealias integer { size = 8; align = 8; signed = false; } := uint8_t;",
        "typealias integer { size = 32; align = 8; signed = false; } := uint32_t;",
        "typealias integer { size = 64; align = 8; signed = false; } := uint64_t;",
        "",
        "trace {",
        "\tmajor = 1;",
        "\tminor = 8;",
        f'\tuuid = "{trace_uuid}";',
        "\tbyte_order = le;",
        "\tpacket.header := struct {",
        "\t\tuint32_t magic;",
        "\t\tuint8_t  uuid[16];",
        "\t\tuint32_t stream_id;",
        "\t\tuint64_t stream_instance_id;",
        "\t};",
        "};",
        "",
        "env {",
        f"\thostname = {_tsdl_string(host)};",
        '\tdomain = "kernel";',
        '\tsysname = "Linux";',
        '\ttracer_name = "lttng-modules";',
        "\ttracer_major = 2;",
        "\ttracer_minor = 13;",
        "\ttracesynth = 1;",
        f"\ttracesynth_metadata = {_tsdl_string(meta_json)};",
        "};",
        "",
        "clock {",
        '\tname = "monotonic";',
        f'\tuuid = "{uuidlib.uuid5(trace_uuid, "clock")}";',
        '\tdescription = "Monotonic Clock";',
        "\tfreq = 1000000000;",
        f"\toffset_s = {offset_s};",
        "\toffset = 0;",
        "};",
        "",
        "typealias integer {",
        "\tsize = 64; align = 8; signed = false;",
        "\tmap = clock.monotonic.value;",
        "} := uint64_clock_monotonic_t;",
        "",
        "struct event_header {",
        "\tuint32_t id;",
        "\tuint64_clock_monotonic_t timestamp;",
        "};",
        "",
    ]
    lines += _tsdl_classes(classes, with_cpu, without_cpu, with_context)
    return "\n".join(lines)


def _put(out: np.ndarray, pos: np.ndarray, data: np.ndarray) -> None:
    """out[pos[i] + k] = data[i, k] for every k, one column at a time (memory O(rows))."""
    for k in range(data.shape[1]):
        out[pos + k] = data[:, k]


def _records(
    ids: np.ndarray,
    cycles: np.ndarray,
    tid: np.ndarray,
    comm_codes: np.ndarray,
    comm_bytes: list[bytes],
    ret: np.ndarray,
    has_ret: np.ndarray,
    switch: np.ndarray | None,
    is_switch: np.ndarray,
    with_context: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Byte image of consecutive event records and each record's end offset."""
    n = len(ids)
    comm_len = np.array([len(b) for b in comm_bytes], dtype=np.int64)
    strlen = comm_len[comm_codes] + 1 if with_context else np.zeros(n, dtype=np.int64)
    payload = np.where(has_ret, 8, 0) + np.where(is_switch, _SWITCH_BYTES, 0)
    fixed = _HEADER_BYTES + (_CTX_FIXED if with_context else 0)
    rec_len = fixed + strlen + payload
    end = np.cumsum(rec_len)
    start = end - rec_len
    out = np.zeros(int(end[-1]) if n else 0, dtype=np.uint8)
    head_fields = [("id", "<u4"), ("ts", "<u8")] + ([("tid", "<i4")] if with_context else [])
    head = np.empty(n, dtype=np.dtype(head_fields))
    head["id"], head["ts"] = ids, cycles
    if with_context:
        head["tid"] = tid
    _put(out, start, head.view(np.uint8).reshape(n, fixed))
    if comm_bytes and with_context:
        width = int(comm_len.max())
        mat = np.zeros((len(comm_bytes), max(width, 1)), dtype=np.uint8)
        for i, b in enumerate(comm_bytes):
            mat[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
        for k in range(width):  # byte k of each row's procname, rows whose name is longer than k
            rows = np.flatnonzero(strlen - 1 > k)
            out[start[rows] + fixed + k] = mat[comm_codes[rows], k]
    pay = start + fixed + strlen
    rows = np.flatnonzero(has_ret)
    if len(rows):
        _put(out, pay[rows], ret[rows].astype("<i8").view(np.uint8).reshape(len(rows), 8))
    rows = np.flatnonzero(is_switch)
    if len(rows) and switch is not None:
        _put(out, pay[rows] + np.where(has_ret[rows], 8, 0), switch.view(np.uint8).reshape(len(rows), _SWITCH_BYTES))
    return out, end


def _switch_payload(
    positions: np.ndarray, tid: np.ndarray, comm_codes: np.ndarray, comm_bytes: list[bytes], cpu: int | None
) -> np.ndarray:
    """lttng-modules sched_switch fields for the switch rows at `positions` of one stream."""
    n = len(tid)
    truncated = np.array([b[: TASK_COMM_LEN - 1] for b in comm_bytes], dtype=f"S{TASK_COMM_LEN}")
    idle = f"swapper/{cpu if cpu is not None else 0}".encode()
    nxt = positions + 1
    has_next = nxt < n
    nxt = np.minimum(nxt, n - 1)
    rec = np.zeros(len(positions), dtype=_SWITCH_DTYPE)
    rec["prev_comm"] = truncated[comm_codes[positions]]
    rec["prev_tid"] = tid[positions]
    rec["prev_prio"] = 20
    rec["next_tid"] = np.where(has_next & (tid[nxt] >= 0), tid[nxt], 0)
    rec["next_comm"] = np.where(has_next & (tid[nxt] >= 0), truncated[comm_codes[nxt]], idle)
    rec["next_prio"] = 20
    return rec


def _int_fc(bits: int, signed: bool = False, role: str | None = None) -> dict:
    kind = "fixed-length-signed-integer" if signed else "fixed-length-unsigned-integer"
    fc: dict = {"type": kind, "length": bits, "byte-order": "little-endian", "alignment": 8}
    if role:
        fc["roles"] = [role]
    return fc


def _struct_fc(*members: tuple[str, dict]) -> dict:
    return {"type": "structure", "member-classes": [{"name": n, "field-class": fc} for n, fc in members]}


def _metadata_ctf2(
    trace_uuid: uuidlib.UUID,
    offset_s: int,
    classes: list[tuple[str, bool]],
    with_cpu: bool,
    without_cpu: bool,
    trace_meta: dict,
    with_context: bool = True,
) -> str:
    """The CTF 2 metadata (a JSON text sequence) of the layout _metadata_text describes in TSDL:
    the same packets and records, field names without CTF 1.8's leading underscore."""
    host = str(trace_meta.get("hostname") or "tracesynth")
    env = {
        "hostname": host,
        "domain": "kernel",
        "sysname": "Linux",
        "tracer_name": "lttng-modules",
        "tracer_major": 2,
        "tracer_minor": 15,
        "tracesynth": 1,
        "tracesynth_metadata": json.dumps(trace_meta, sort_keys=True, default=str),
    }
    uuid_list = list(trace_uuid.bytes)
    frags: list[dict] = [
        {"type": "preamble", "version": 2, "uuid": uuid_list},
        {
            "type": "trace-class",
            "uid": str(trace_uuid),
            "environment": env,
            "packet-header-field-class": _struct_fc(
                ("magic", _int_fc(32, role="packet-magic-number")),
                ("uuid", {"type": "static-length-blob", "length": 16, "roles": ["metadata-stream-uuid"]}),
                ("stream_id", _int_fc(32, role="data-stream-class-id")),
                ("stream_instance_id", _int_fc(64, role="data-stream-id")),
            ),
        },
        {
            "type": "clock-class",
            "id": "monotonic",
            "name": "monotonic",
            "description": "Monotonic Clock",
            "frequency": 1_000_000_000,
            "offset-from-origin": {"seconds": offset_s, "cycles": 0},
        },
    ]
    stream_ids = ([0] if with_cpu else []) + ([1] if without_cpu else [])
    for sid in stream_ids:
        frags.append(_stream_class_ctf2(sid, with_context))
    comm = {"type": "static-length-string", "length": TASK_COMM_LEN, "encoding": "utf-8"}
    switch = [
        ("prev_comm", comm),
        ("prev_tid", _int_fc(32, True)),
        ("prev_prio", _int_fc(32, True)),
        ("prev_state", _int_fc(64, True)),
        ("next_comm", comm),
        ("next_tid", _int_fc(32, True)),
        ("next_prio", _int_fc(32, True)),
    ]
    for sid in stream_ids:
        for i, (name, has_ret) in enumerate(classes):
            members = ([("ret", _int_fc(64, True))] if has_ret else []) + (switch if name == "sched_switch" else [])
            frag = {"type": "event-record-class", "id": i, "name": name, "data-stream-class-id": sid}
            if members:
                frag["payload-field-class"] = _struct_fc(*members)
            frags.append(frag)
    return "".join("\x1e" + json.dumps(f, indent=2) + "\n" for f in frags)


def _stream_class_ctf2(sid: int, with_context: bool) -> dict:
    clock_ts = "default-clock-timestamp"
    pc = [
        ("timestamp_begin", _int_fc(64, role=clock_ts)),
        ("timestamp_end", _int_fc(64, role="packet-end-default-clock-timestamp")),
        ("content_size", _int_fc(64, role="packet-content-length")),
        ("packet_size", _int_fc(64, role="packet-total-length")),
        ("packet_seq_num", _int_fc(64, role="packet-sequence-number")),
        ("events_discarded", _int_fc(64, role="discarded-event-record-counter-snapshot")),
    ]
    if sid == 0:
        pc.append(("cpu_id", _int_fc(32)))
    frag = {
        "type": "data-stream-class",
        "id": sid,
        "default-clock-class-id": "monotonic",
        "packet-context-field-class": _struct_fc(*pc),
        "event-record-header-field-class": _struct_fc(
            ("id", _int_fc(32, role="event-record-class-id")), ("timestamp", _int_fc(64, role=clock_ts))
        ),
    }
    if with_context:
        frag["event-record-common-context-field-class"] = _struct_fc(
            ("tid", _int_fc(32, True)), ("procname", {"type": "null-terminated-string"})
        )
    return frag


def _write_stream(
    f: BinaryIO,
    c: int | None,
    stream_no: int,
    rows: np.ndarray,
    x: SimpleNamespace,
    packet_bytes: int,
    chunk_rows: int,
    context: bool,
    on_progress: Callable[[int], None] | None,
) -> None:
    """One stream file: the rows of CPU `c` (None: no CPU), chunk by chunk, in packets."""
    pkt_dtype = _PKT_DTYPE if c is None else np.dtype(_PKT_DTYPE.descr + [("cpu_id", "<u4")])
    seq = 0
    sw_pos = np.flatnonzero(x.is_switch[rows])
    switch_all = _switch_payload(sw_pos, x.tid[rows], x.comm_codes[rows], x.comm_bytes, c) if len(sw_pos) else None
    for lo in range(0, len(rows), chunk_rows):
        r = rows[lo : lo + chunk_rows]
        isw = x.is_switch[r]
        sw = None
        if switch_all is not None and isw.any():
            a, b = np.searchsorted(sw_pos, [lo, lo + len(r)])
            sw = switch_all[a:b]
        body, end = _records(
            x.class_id[r],
            x.cycles[r],
            x.tid[r],
            x.comm_codes[r],
            x.comm_bytes,
            x.ret[r],
            x.has_ret[r],
            sw,
            isw,
            context,
        )
        # packets: cut where the running size crosses a multiple of packet_bytes
        start = end - np.diff(np.concatenate([[0], end]))
        cuts = np.flatnonzero(np.diff(start // packet_bytes)) + 1
        bounds = np.concatenate([[0], cuts, [len(r)]])
        for i0, i1 in zip(bounds[:-1], bounds[1:], strict=True):
            b0, b1 = int(start[i0]), int(end[i1 - 1])
            hdr = np.zeros(1, dtype=pkt_dtype)
            hdr["magic"] = CTF_MAGIC
            hdr["uuid"] = x.uuid
            hdr["stream_id"] = 0 if c is not None else 1
            hdr["stream_instance_id"] = stream_no
            hdr["timestamp_begin"] = x.cycles[r[i0]]
            hdr["timestamp_end"] = x.cycles[r[i1 - 1]]
            hdr["content_size"] = hdr["packet_size"] = (pkt_dtype.itemsize + b1 - b0) * 8
            hdr["packet_seq_num"] = seq
            if c is not None:
                hdr["cpu_id"] = c
            seq += 1
            f.write(hdr.tobytes())
            f.write(body[b0:b1].tobytes())
        if on_progress is not None:
            on_progress(len(r))


def _columns(trace: Trace, directory: Path) -> SimpleNamespace:
    """The trace's columns as the records need them (TraceSynthError for what CTF cannot hold)."""
    ev_codes, ev_names = trace.codes("event")
    _check_names(ev_names, directory)
    ts = trace.ts.astype(np.int64)
    offset_s = int(ts.min() // 1_000_000_000)
    cycles = (ts - offset_s * 1_000_000_000).astype(np.uint64)
    tid = trace.table["tid"].fill_null(-1).to_numpy().astype(np.int64)
    if len(tid) and (tid.max() > np.iinfo(np.int32).max or tid.min() < -1):
        raise TraceSynthError("tid values must fit in int32 (0 .. 2147483647) to be written to CTF", directory)
    tid = tid.astype(np.int32)
    comm_codes, comm_vocab = trace.codes("comm")
    comm_bytes = [s.encode("utf-8") for s in comm_vocab]
    if any(b"\0" in b for b in comm_bytes):
        raise TraceSynthError("a comm value contains a NUL byte and cannot be written to CTF", directory)
    # unknown (null or empty) comms become NULL_COMM, the last vocabulary entry
    comm_bytes = [b or NULL_COMM.encode() for b in comm_bytes] + [NULL_COMM.encode()]
    comm_codes = np.where(comm_codes < 0, len(comm_vocab), comm_codes)
    ret_col = trace.table["ret"].combine_chunks()
    has_ret = ret_col.is_valid().to_numpy(zero_copy_only=False)
    ret = ret_col.fill_null(0).to_numpy().astype(np.int64)
    cpu_col = trace.table["cpu"].combine_chunks()
    cpu_valid = cpu_col.is_valid().to_numpy(zero_copy_only=False)
    cpu = cpu_col.fill_null(0).to_numpy().astype(np.int64)
    if cpu_valid.any() and cpu[cpu_valid].min() < 0:
        raise TraceSynthError("negative cpu numbers cannot be written to CTF", directory)

    # event classes: (name, has ret) in a stable order
    key = ev_codes.astype(np.int64) * 2 + has_ret
    used = np.unique(key)
    classes = [(ev_names[k // 2], bool(k % 2)) for k in used]
    class_id = np.searchsorted(used, key).astype(np.uint32)
    switch_code = ev_names.index("sched_switch") if "sched_switch" in ev_names else -2
    is_switch_all = ev_codes == switch_code

    return SimpleNamespace(
        offset_s=offset_s,
        cycles=cycles,
        tid=tid,
        comm_codes=comm_codes,
        comm_bytes=comm_bytes,
        ret=ret,
        has_ret=has_ret,
        cpu=cpu,
        cpu_valid=cpu_valid,
        classes=classes,
        class_id=class_id,
        is_switch=is_switch_all,
    )


def write_ctf(
    trace: Trace,
    directory: str | Path,
    packet_bytes: int = 1 << 20,
    chunk_rows: int = 1 << 20,
    on_progress: Callable[[int], None] | None = None,
    context: bool = True,
    ctf_version: str = "1.8",
) -> Path:
    """Write `trace` as an LTTng-style CTF trace directory, atomically (replaces `directory`).

    `on_progress` receives the number of events written after each chunk. With context=False
    events carry no tid/procname context, like a plain `lttng enable-event -k` session: readers
    then derive threads from sched_switch (rows before a CPU's first switch read back as null).
    ctf_version "1.8" (TSDL metadata; Debian's babeltrace2 2.0 and Trace Compass read it) or "2"
    (JSON metadata as LTTng 2.15 writes by default; the data streams are the same bytes).
    """
    directory = Path(directory)
    if ctf_version not in CTF_VERSIONS:
        raise TraceSynthError(f"unknown CTF version {ctf_version!r} (choose from {', '.join(CTF_VERSIONS)})")
    n = len(trace)
    if n == 0:
        raise TraceSynthError("the trace has no events; nothing to write", directory)
    x = _columns(trace, directory)
    trace_uuid = uuidlib.uuid4()
    meta_text = (_metadata_ctf2 if ctf_version == "2" else _metadata_text)(
        trace_uuid,
        x.offset_s,
        x.classes,
        bool(x.cpu_valid.any()),
        bool((~x.cpu_valid).any()),
        dict(trace.metadata),
        with_context=context,
    )
    x.uuid = np.frombuffer(trace_uuid.bytes, dtype=np.uint8)
    cpu, ok = x.cpu, x.cpu_valid
    streams = [(int(c), np.flatnonzero(ok & (cpu == c))) for c in np.unique(cpu[ok])]
    if (~ok).any():
        streams.append((None, np.flatnonzero(~ok)))
    with atomic_path(directory, directory=True, contents=("metadata", "channel0_*")) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes it private; a trace directory is meant to be shared
        (tmp / "metadata").write_text(meta_text, encoding="utf-8")
        for stream_no, (c, rows) in enumerate(streams):
            name = f"channel0_{c}" if c is not None else "channel0_nocpu"
            with open(tmp / name, "wb") as f:
                _write_stream(f, c, stream_no, rows, x, packet_bytes, chunk_rows, context, on_progress)
    return directory
