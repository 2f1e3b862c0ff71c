"""CTF 2 metadata (a JSON text sequence of fragments, RFC 7464) to a TraceClass.

Fragments: preamble, field-class-alias, trace-class, clock-class, data-stream-class and
event-record-class. Field classes: fixed-length (bit array, boolean, integers, enumerations,
floating point), variable-length integers/enumerations (LEB128), null-terminated, static- and
dynamic-length strings, blobs and arrays, structure, optional and variant. Field locations are
taken in both spellings seen in the wild: `{"origin": ..., "path": [...]}` and `[origin, ...]`.
"""

from __future__ import annotations

import json
from typing import Any

from tracesynth.io.ctf.model import (
    Array,
    Blob,
    Clock,
    EventClass,
    Float,
    Int,
    Optional,
    Ref,
    StreamClass,
    String,
    Struct,
    TraceClass,
    Variant,
)
from tracesynth.io.ctf.tsdl import TsdlError

_ROLES = {
    "packet-magic-number": "magic",
    "data-stream-class-id": "stream_id",
    "data-stream-id": "stream_instance_id",
    "packet-total-length": "packet_size",
    "packet-content-length": "content_size",
    "default-clock-timestamp": "timestamp",
    "packet-end-default-clock-timestamp": "timestamp_end",
    "discarded-event-record-counter-snapshot": "events_discarded",
    "packet-sequence-number": "packet_seq_num",
    "event-record-class-id": "id",
}
_ORIGINS = {
    "packet-header": "packet.header",
    "packet-context": "packet.context",
    "event-record-header": "event.header",
    "event-record-common-context": "event.common_context",
    "event-record-specific-context": "event.context",
    "event-record-payload": "event.payload",
}


def is_ctf2(data: bytes) -> bool:
    return data.lstrip(b" \t\r\n")[:1] == b"\x1e"


def _location(loc: Any) -> Ref:
    if isinstance(loc, dict):
        origin, path = loc.get("origin"), loc.get("path", [])
    elif isinstance(loc, list) and loc and loc[0] in _ORIGINS:
        origin, path = loc[0], loc[1:]
    else:
        origin, path = None, loc
    if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
        raise TsdlError(f"unsupported field location {loc!r}")
    return Ref(_ORIGINS.get(origin) if origin else None, tuple(path))


class _Builder:
    def __init__(self) -> None:
        self.aliases: dict[str, Any] = {}

    def fc(self, d: Any, clock: str | None) -> Any:
        """A model field class from a JSON field class (`clock`: the stream's default clock)."""
        if isinstance(d, str):
            if d not in self.aliases:
                raise TsdlError(f"unknown field class alias {d!r}")
            d = self.aliases[d]
        if not isinstance(d, dict):
            raise TsdlError(f"a field class must be an object, not {d!r}")
        kind = d.get("type")
        align = int(d.get("alignment", d.get("minimum-alignment", 1)))
        little = d.get("byte-order", "little-endian") == "little-endian"
        if kind in ("fixed-length-bit-array", "fixed-length-bit-map", "fixed-length-boolean") or (
            isinstance(kind, str) and kind.startswith(("fixed-length-unsigned", "fixed-length-signed"))
        ):
            size = int(d["length"])
            if not 0 < size <= 64:
                raise TsdlError(f"fixed-length field of {size} bits is not within 1..64")
            return self._int(
                d,
                Int(
                    size,
                    align,
                    kind.startswith("fixed-length-signed"),
                    little,
                    int(d.get("preferred-display-base", 10)),
                ),
                clock,
            )
        if isinstance(kind, str) and kind.startswith(("variable-length-unsigned", "variable-length-signed")):
            return self._int(d, Int(64, 8, kind.startswith("variable-length-signed"), True, varlen=True), clock)
        if kind == "fixed-length-floating-point-number":
            return Float(int(d["length"]), align, little)
        if kind == "null-terminated-string":
            return String()
        if kind == "static-length-string":
            return String(8, int(d["length"]))
        if kind == "dynamic-length-string":
            return String(8, _location(d["length-field-location"]))
        if kind == "static-length-blob":
            return Blob(int(d["length"]))
        if kind == "dynamic-length-blob":
            return Blob(_location(d["length-field-location"]))
        if kind == "structure":
            members = [(str(m["name"]), self.fc(m["field-class"], clock)) for m in d.get("member-classes", [])]
            return Struct(members, align)
        if kind in ("static-length-array", "dynamic-length-array"):
            n = int(d["length"]) if kind.startswith("static") else _location(d["length-field-location"])
            return Array(self.fc(d["element-field-class"], clock), n, align)
        if kind == "optional":
            ranges = d.get("selector-field-ranges")
            return Optional(
                _location(d["selector-field-location"]),
                self.fc(d["field-class"], clock),
                [tuple(r) for r in ranges] if ranges is not None else None,
            )
        if kind == "variant":
            opts = []
            for o in d["options"]:
                ranges = [tuple(r) for r in o["selector-field-ranges"]]
                opts.append((str(o.get("name", "")), self.fc(o["field-class"], clock), ranges))
            return Variant(_location(d["selector-field-location"]), opts)
        raise TsdlError(f"unsupported CTF 2 field class {kind!r}")

    def _int(self, d: dict[str, Any], f: Int, clock: str | None) -> Int:
        maps = d.get("mappings")
        if isinstance(maps, dict):
            f.mappings = [(str(k), int(lo), int(hi)) for k, rs in maps.items() for lo, hi in rs]
        for role in d.get("roles", []):
            f.role = _ROLES.get(role, f.role)
        if f.role == "timestamp":
            if clock is None:
                raise TsdlError("a default-clock-timestamp field in a data stream class without a default clock")
            f.clock = clock
        return f


def _clock(frag: dict[str, Any]) -> Clock:
    off = frag.get("offset-from-origin", frag.get("offset", {})) or {}
    freq = int(frag["frequency"])
    name = str(frag.get("name", frag.get("id", "")))
    info = {"name": name, "freq": freq, "offset_s": int(off.get("seconds", 0)), "offset": int(off.get("cycles", 0))}
    for k in ("description", "precision", "uuid"):
        if k in frag:
            info[k] = frag[k]
    return Clock(name, freq, info["offset_s"], info["offset"], info)


def parse_ctf2(data: bytes) -> TraceClass:
    """A TraceClass from CTF 2 metadata bytes (TsdlError when they are not)."""
    try:
        frags = [json.loads(f) for f in data.decode("utf-8").split("\x1e") if f.strip()]
    except (UnicodeDecodeError, ValueError) as exc:
        raise TsdlError(f"CTF 2 metadata is not valid JSON ({exc})") from None
    if not frags or not isinstance(frags[0], dict) or frags[0].get("type") != "preamble":
        raise TsdlError("CTF 2 metadata must start with a preamble fragment")
    t = TraceClass(version="2")
    b = _Builder()
    clock_ids: dict[str, str] = {}
    for frag in frags[1:]:
        if not isinstance(frag, dict):
            raise TsdlError("a CTF 2 metadata fragment must be a JSON object")
        try:
            _fragment(t, b, clock_ids, frag)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, TsdlError):
                raise
            raise TsdlError(f"bad {frag.get('type')!r} fragment ({type(exc).__name__}: {exc})") from None
    if not t.streams:
        t.streams[0] = StreamClass(0)
    return t


def _fragment(t: TraceClass, b: _Builder, clock_ids: dict[str, str], frag: dict[str, Any]) -> None:
    kind = frag.get("type")
    if kind == "field-class-alias":
        b.aliases[str(frag["name"])] = frag["field-class"]
    elif kind == "trace-class":
        t.env = dict(frag.get("environment", {}))
        if "packet-header-field-class" in frag:
            t.packet_header = b.fc(frag["packet-header-field-class"], None)
        uuid = frag.get("uuid")
        if isinstance(uuid, list) and len(uuid) == 16:
            h = bytes(uuid).hex()
            t.uuid = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        elif isinstance(frag.get("uid"), str):  # CTF 2.0's final name for it
            t.uuid = frag["uid"]
    elif kind == "clock-class":
        c = _clock(frag)
        t.clocks[c.name] = c
        clock_ids[str(frag.get("id", c.name))] = c.name
    elif kind == "data-stream-class":
        cid = frag.get("default-clock-class-id", frag.get("default-clock-class-name"))
        clock = clock_ids.get(str(cid)) if cid is not None else None
        if cid is not None and clock is None:
            raise TsdlError(f"data stream class names unknown clock class {cid!r}")
        sc = StreamClass(int(frag.get("id", 0)), clock=clock)
        for key, attr in (
            ("packet-context-field-class", "packet_context"),
            ("event-record-header-field-class", "event_header"),
            ("event-record-common-context-field-class", "event_context"),
        ):
            if key in frag:
                setattr(sc, attr, b.fc(frag[key], clock))
        t.streams[sc.id] = sc
    elif kind == "event-record-class":
        sid = int(frag.get("data-stream-class-id", 0))
        sc = t.streams.get(sid)
        if sc is None:
            raise TsdlError(f"event record class names unknown data stream class {sid}")
        ev = EventClass(int(frag.get("id", 0)), str(frag.get("name", "")), sid)
        if "specific-context-field-class" in frag:
            ev.context = b.fc(frag["specific-context-field-class"], sc.clock)
        if "payload-field-class" in frag:
            ev.payload = b.fc(frag["payload-field-class"], sc.clock)
        sc.events[ev.id] = ev
