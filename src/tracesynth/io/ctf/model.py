"""The field, event, stream and trace classes that both metadata parsers (TSDL, CTF 2) produce.

Sizes and alignments are in bits. Field references (sequence lengths, variant selectors) are kept
as written (`Ref`) and resolved when a decoder is compiled (tracesynth.io.ctf.compile).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Ref:
    """A field location: a root scope ("packet.header", "packet.context", "event.header",
    "event.common_context", "event.context", "event.payload") or None (relative: the enclosing
    scopes are searched, innermost first), then member names."""

    root: str | None
    path: tuple[str, ...]


@dataclass
class Int:
    size: int
    align: int = 1
    signed: bool = False
    little: bool = True
    base: int = 10
    encoding: str | None = None  # "UTF8"/"ASCII" makes an 8-bit array a string
    clock: str | None = None  # the clock whose value this field updates
    mappings: list[tuple[str, int, int]] | None = None  # enumeration labels and their ranges
    role: str | None = None  # "id", "timestamp", "content_size", ... (from name or CTF 2 role)
    varlen: bool = False  # CTF 2 LEB128 integer (size then unused)


@dataclass
class Float:
    size: int
    align: int = 1
    little: bool = True


@dataclass
class String:
    align: int = 8
    length: int | Ref | None = None  # None: null-terminated; else a byte count (CTF 2)


@dataclass
class Blob:
    length: int | Ref
    align: int = 8


@dataclass
class Struct:
    fields: list[tuple[str, Any]]
    align: int = 1


@dataclass
class Array:
    element: Any
    length: int | Ref
    align: int = 1


@dataclass
class Variant:
    selector: Ref
    options: list[tuple[str, Any, list[tuple[int, int]] | None]]  # (name, class, CTF 2 ranges)
    align: int = 1


@dataclass
class Optional:
    selector: Ref
    element: Any
    ranges: list[tuple[int, int]] | None = None  # None: a boolean selector


@dataclass
class Clock:
    name: str
    freq: int = 1_000_000_000
    offset_s: int = 0
    offset: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # as the TSDL clock block says it

    def normalised(self) -> tuple[int, int]:
        """(seconds, cycles < freq), as babeltrace2 calibrates a clock class offset."""
        s, c = self.offset_s, self.offset
        if self.freq and c >= self.freq:
            s += c // self.freq
            c %= self.freq
        return s, c


@dataclass
class EventClass:
    id: int
    name: str
    stream_id: int = 0
    context: Struct | None = None
    payload: Struct | None = None


@dataclass
class StreamClass:
    id: int = 0
    packet_context: Struct | None = None
    event_header: Struct | None = None
    event_context: Struct | None = None
    clock: str | None = None
    events: dict[int, EventClass] = field(default_factory=dict)


@dataclass
class TraceClass:
    packet_header: Struct | None = None
    little: bool = True
    uuid: str | None = None
    env: dict[str, Any] = field(default_factory=dict)
    clocks: dict[str, Clock] = field(default_factory=dict)
    streams: dict[int, StreamClass] = field(default_factory=dict)
    version: str = "1.8"
