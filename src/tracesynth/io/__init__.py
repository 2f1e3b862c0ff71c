"""Readers and writers. Every reader returns a Trace; `read_trace` detects the format.

Formats:
    lttng        LTTng kernel CTF directory (lttng-modules event names)
    perf-ctf     CTF directory written by `perf data convert --to-ctf`
    perf-data    a perf.data file (decoded through `perf script`)
    perf-script  text printed by `perf script`
    strace       text from `strace -f -ttt -T`
    parquet      a Trace saved by tracesynth
"""

from __future__ import annotations

import re
from pathlib import Path

from tracesynth.errors import TraceSynthError
from tracesynth.io.ctf_dirs import find_ctf_metadata
from tracesynth.trace import Trace

# a packetized CTF metadata stream starts with this magic (either byte order)
_CTF_METADATA_MAGIC = (b"\x57\x1d\xd1\x75", b"\x75\xd1\x1d\x57")

FORMATS = ("lttng", "perf-ctf", "perf-data", "perf-script", "strace", "parquet")

# `perf script` default line: "  comm  tid [cpu] secs.usecs: [period] event: ..."
_PERF_SCRIPT_LINE = re.compile(rb"^\s*\S.*?\s+\d+(?:/\d+)?\s+\[\d+\]\s+\d+\.\d+:\s", re.M)
# strace -f -ttt -T: "[pid] secs.usecs name(" or "secs.usecs name("
_STRACE_LINE = re.compile(rb"^(?:\[pid\s+\d+\]\s+|\d+\s+)?\d{9,}\.\d+\s+(?:\w+\(|<\.\.\.|\+\+\+|---)", re.M)


def detect_format(path: str | Path) -> str:
    """Guess the format from the path and its first bytes; TraceSynthError if nothing fits."""
    p = Path(path)
    if not p.exists():
        raise TraceSynthError("no such file or directory", p)
    if p.is_dir():
        metas = find_ctf_metadata(p)
        if not metas:
            raise TraceSynthError("directory holds no CTF trace (no 'metadata' file found)", p)
        text = metas[0].read_bytes()
        ctf2 = text.lstrip(b" \t\r\n")[:1] == b"\x1e"  # CTF 2: a JSON text sequence (LTTng 2.15's default)
        if not (text.startswith(b"/* CTF") or text[:4] in _CTF_METADATA_MAGIC or ctf2):
            raise TraceSynthError(f"{metas[0].name!r} is not CTF metadata (neither TSDL text nor packetized)", metas[0])
        # the env block names the tracer; LTTng's metadata is packetized but its TSDL text stays readable
        tracer = re.search(rb'tracer_name\s*=\s*"([^"]*)"', text) or re.search(rb'"tracer_name"\s*:\s*"([^"]*)"', text)
        if tracer and tracer.group(1).startswith(b"lttng"):
            return "lttng"
        if b"perf" in text:
            return "perf-ctf"
        if b"lttng" in text.lower():
            return "lttng"
        raise TraceSynthError("CTF trace from an unknown tracer (neither LTTng nor perf)", p)
    try:
        with p.open("rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise TraceSynthError(f"cannot read ({exc.strerror})", p) from None
    if not head:
        raise TraceSynthError("empty file", p)
    if head.startswith(b"PAR1") or p.suffix == ".parquet":
        return "parquet"
    if head.startswith(b"PERFILE2"):
        return "perf-data"
    if _STRACE_LINE.search(head):
        return "strace"
    if _PERF_SCRIPT_LINE.search(head):
        return "perf-script"
    raise TraceSynthError(
        "not a recognised trace (expected an LTTng/perf CTF directory, perf.data, "
        "`perf script` or `strace -f -ttt -T` text, or Parquet); use --format to force one",
        p,
    )


def read_trace(path: str | Path, format: str | None = None) -> Trace:
    """Read any supported trace into a Trace table."""
    fmt = format or detect_format(path)
    if fmt not in FORMATS:
        raise TraceSynthError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if fmt == "parquet":
        return Trace.load(path)
    if fmt == "lttng":
        from tracesynth.io.lttng import read_lttng

        return read_lttng(path)
    if fmt == "strace":
        from tracesynth.io.strace import read_strace

        return read_strace(path)
    from tracesynth.io import perf

    return {"perf-ctf": perf.read_perf_ctf, "perf-data": perf.read_perf_data, "perf-script": perf.read_perf_script}[
        fmt
    ](path)
