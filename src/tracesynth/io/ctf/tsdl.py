"""CTF 1.8 metadata: TSDL text (plain or in LTTng's packetized metadata stream) to a TraceClass.

The subset LTTng, perf and barectf write: typealias/typedef, integer (size, align, signed,
byte_order, base, encoding, map = clock.NAME.value), floating_point, string, enum, struct (named
or not, align(N)), variant <tag>, fixed arrays and sequences, and the trace, env, clock, stream
and event blocks. Field meanings (event id, timestamp, packet sizes, ...) follow the names
babeltrace2 gives a meaning to; an unmapped `timestamp` is mapped to the trace's only clock.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from tracesynth.io.ctf.model import (
    Array,
    Clock,
    EventClass,
    Float,
    Int,
    Ref,
    StreamClass,
    String,
    Struct,
    TraceClass,
    Variant,
)

META_MAGIC = 0x75D11D57
_HEADER_BYTES = 37
_TOKEN = re.compile(
    r"\s+|/\*.*?\*/|//[^\n]*|(?P<str>\"(?:[^\"\\]|\\.)*\")|(?P<num>0[xX][0-9a-fA-F]+|[0-9]+)[uUlL]*"
    r"|(?P<id>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>:=|\.\.\.|[{}\[\]()<>;,=:.+\-*])",
    re.S,
)
_TYPE_KEYWORDS = {"integer", "floating_point", "string", "struct", "enum", "variant"}
_ROOTS = {
    "trace.packet.header": "packet.header",
    "stream.packet.context": "packet.context",
    "stream.event.header": "event.header",
    "stream.event.context": "event.common_context",
    "event.context": "event.context",
    "event.fields": "event.payload",
}


class TsdlError(ValueError):
    """The metadata is not TSDL this parser understands."""


def depacketize(data: bytes) -> bytes:
    """The TSDL text of a metadata file: as it is, or joined from its metadata packets."""
    order = {META_MAGIC.to_bytes(4, "little"): "little", META_MAGIC.to_bytes(4, "big"): "big"}.get(data[:4])
    if order is None:
        return data
    out, off = [], 0
    while off < len(data):
        head = data[off : off + _HEADER_BYTES]
        if len(head) < _HEADER_BYTES or head[:4] != data[:4]:
            raise TsdlError(f"metadata packet at byte {off} is damaged or cut short")
        content = int.from_bytes(head[24:28], order) // 8
        size = int.from_bytes(head[28:32], order) // 8
        if size < _HEADER_BYTES or content > size or content < _HEADER_BYTES or off + size > len(data):
            raise TsdlError(f"metadata packet at byte {off} is damaged or cut short (truncated copy?)")
        out.append(data[off + _HEADER_BYTES : off + content])
        off += size
    return b"".join(out)


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    for m in _TOKEN.finditer(text):
        if m.start() != pos:
            break
        pos = m.end()
        kind = m.lastgroup
        if kind:
            out.append((kind, m.group(kind)))
    if pos != len(text):
        line = text.count("\n", 0, pos) + 1
        raise TsdlError(f"unexpected character {text[pos]!r} on metadata line {line}")
    return out


def unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t", "r": "\r", "0": "\0"}.get(m.group(1), m.group(1)), s)


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.aliases: dict[str, Any] = {}
        self.named: dict[tuple[str, str], Any] = {}
        self.trace = TraceClass()
        self.byte_order = "le"
        self.events: list[EventClass] = []

    # -- token helpers ------------------------------------------------------------------------
    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.toks[j][1] if j < len(self.toks) else None

    def kind(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.toks[j][0] if j < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        if self.i >= len(self.toks):
            raise TsdlError("metadata ends in the middle of a declaration")
        tok = self.toks[self.i][1]
        if want is not None and tok != want:
            raise TsdlError(f"expected {want!r} in the metadata, found {tok!r}")
        self.i += 1
        return tok

    def dotted(self) -> str:
        parts = [self.take()]
        while self.peek() == "." and self.kind(1) == "id":
            self.take()
            parts.append(self.take())
        return ".".join(parts)

    def number(self) -> int:
        sign = -1 if self.peek() == "-" else 1
        if self.peek() in ("-", "+"):
            self.take()
        if self.kind() != "num":
            raise TsdlError(f"expected a number in the metadata, found {self.peek()!r}")
        raw = self.take()
        return sign * int(raw, 16 if raw[:2] in ("0x", "0X") else 8 if len(raw) > 1 and raw[0] == "0" else 10)

    def value(self) -> Any:
        """An attribute value: string, number or (dotted) identifier."""
        if self.kind() == "str":
            return unescape(self.take()[1:-1])
        if self.kind() == "num" or self.peek() in ("-", "+"):
            return self.number()
        return self.dotted()

    # -- top level ----------------------------------------------------------------------------
    def parse(self) -> TraceClass:
        while self.i < len(self.toks):
            tok = self.peek()
            if tok == ";":
                self.take()
            elif tok == "typealias":
                self.typealias()
            elif tok == "typedef":
                self.typedef()
            elif tok in ("trace", "env", "clock", "stream", "event", "callsite") and self.peek(1) == "{":
                self.take()
                getattr(self, "block_" + tok)(self.block())
            elif tok in _TYPE_KEYWORDS:
                self.type_spec()
                if self.peek() != ";":
                    self.declarator(None)
                self.take(";")
            else:
                raise TsdlError(f"unexpected {tok!r} at the top level of the metadata")
        return self.finish()

    def typealias(self) -> None:
        self.take("typealias")
        t = self.type_spec()
        self.take(":=")
        names = []
        while self.peek() != ";":
            names.append(self.take())
        self.take(";")
        self.aliases[" ".join(names)] = t

    def typedef(self) -> None:
        self.take("typedef")
        t = self.type_spec()
        name, t = self.declarator(t)
        self.take(";")
        self.aliases[name] = t

    def block(self) -> dict[str, Any]:
        """`{ key = value; key := type; ... };` as a dict."""
        self.take("{")
        out: dict[str, Any] = {}
        while self.peek() != "}":
            if self.peek() == "typealias":
                self.typealias()
                continue
            if self.peek() == "typedef":
                self.typedef()
                continue
            if self.peek() == ";":
                self.take()
                continue
            key = self.dotted()
            op = self.take()
            if op == "=":
                out[key] = self.value()
            elif op == ":=":
                out[key] = self.type_only()
            else:
                raise TsdlError(f"expected '=' or ':=' after {key!r} in the metadata, found {op!r}")
            self.take(";")
        self.take("}")
        if self.peek() == ";":
            self.take()
        return out

    # -- types --------------------------------------------------------------------------------
    def type_only(self) -> Any:
        if self.peek() in _TYPE_KEYWORDS:
            return self.type_spec()
        names = []
        while self.kind() == "id":
            names.append(self.take())
        return self.alias(" ".join(names))

    def alias(self, name: str) -> Any:
        if name not in self.aliases:
            raise TsdlError(f"unknown type {name!r} in the metadata")
        return self.aliases[name]

    def attrs(self) -> dict[str, Any]:
        self.take("{")
        out: dict[str, Any] = {}
        while self.peek() != "}":
            key = self.dotted()
            self.take("=")
            out[key] = self.value()
            self.take(";")
        self.take("}")
        return out

    def type_spec(self) -> Any:
        tok = self.take()
        if tok == "integer":
            return self.integer(self.attrs())
        if tok == "floating_point":
            a = self.attrs()
            size = int(a.get("exp_dig", 8)) + int(a.get("mant_dig", 24))
            return Float(size, int(a.get("align", 8)), self.order(a.get("byte_order")))
        if tok == "string":
            if self.peek() == "{":
                self.attrs()
            return String()
        if tok == "struct":
            return self.struct()
        if tok == "enum":
            return self.enum()
        if tok == "variant":
            return self.variant()
        self.i -= 1
        return self.type_only()

    def order(self, raw: Any) -> Any:
        if raw in (None, "native"):
            return None  # the trace's byte order, known once the trace block is read
        if raw in ("le", "little", "little_endian"):
            return True
        if raw in ("be", "big", "big_endian", "network"):
            return False
        raise TsdlError(f"unknown byte_order {raw!r} in the metadata")

    def integer(self, a: dict[str, Any]) -> Int:
        size = int(a.get("size", 0))
        if not 0 < size <= 64:
            raise TsdlError(f"integer size {size} is not within 1..64")
        signed = str(a.get("signed", "false")).lower() in ("1", "true")
        base = {"decimal": 10, "hexadecimal": 16, "x": 16, "X": 16, "p": 16, "octal": 8, "o": 8, "binary": 2}
        b = a.get("base", 10)
        enc = a.get("encoding")
        clock = None
        mapped = a.get("map")
        if isinstance(mapped, str):
            parts = mapped.split(".")
            if len(parts) == 3 and parts[0] == "clock" and parts[2] == "value":
                clock = parts[1]
        align = int(a.get("align", 8 if size % 8 == 0 else 1))
        return Int(
            size,
            align,
            signed,
            self.order(a.get("byte_order")),
            base.get(b, b if isinstance(b, int) else 10),
            None if enc in (None, "none") else str(enc),
            clock,
        )

    def struct(self) -> Struct:
        name = self.take() if self.kind() == "id" and self.peek() != "align" else None
        if self.peek() != "{":
            if name is None or ("struct", name) not in self.named:
                raise TsdlError(f"unknown struct {name!r} in the metadata")
            return self.named[("struct", name)]
        self.take("{")
        fields: list[tuple[str, Any]] = []
        while self.peek() != "}":
            fields.extend(self.field_decls())
        self.take("}")
        align = 1
        if self.peek() == "align":
            self.take()
            self.take("(")
            align = self.number()
            self.take(")")
        s = Struct(fields, align)
        if name:
            self.named[("struct", name)] = s
        return s

    def field_decls(self) -> list[tuple[str, Any]]:
        if self.peek() == "typealias":
            self.typealias()
            return []
        if self.peek() == "typedef":
            self.typedef()
            return []
        if self.peek() in _TYPE_KEYWORDS:
            t = self.type_spec()
        else:  # an alias name: every identifier but the last (the declarator)
            names = []
            while self.kind() == "id" and self.kind(1) == "id":
                names.append(self.take())
            t = self.alias(" ".join(names))
        out = []
        while True:
            out.append(self.declarator(t))
            if self.peek() != ",":
                break
            self.take()
        self.take(";")
        return out

    def declarator(self, t: Any) -> tuple[str, Any]:
        name = self.take()
        dims = []
        while self.peek() == "[":
            self.take()
            if self.kind() == "num":
                dims.append(self.number())
            else:
                dims.append(self.ref(self.dotted()))
            self.take("]")
        for d in reversed(dims):
            t = Array(t, d)
        return name, t

    def ref(self, dotted: str) -> Ref:
        for prefix, root in sorted(_ROOTS.items(), key=lambda kv: -len(kv[0])):
            if dotted.startswith(prefix + "."):
                return Ref(root, tuple(dotted[len(prefix) + 1 :].split(".")))
        return Ref(None, tuple(dotted.split(".")))

    def enum(self) -> Int:
        name = self.take() if self.kind() == "id" else None
        container: Any = None
        if self.peek() == ":":
            self.take()
            container = self.type_spec() if self.peek() in _TYPE_KEYWORDS else self.type_only()
        if self.peek() != "{":
            if name is None or ("enum", name) not in self.named:
                raise TsdlError(f"unknown enum {name!r} in the metadata")
            return self.named[("enum", name)]
        if container is None:
            container = self.alias("int")
        if not isinstance(container, Int):
            raise TsdlError("an enum's container must be an integer")
        maps: list[tuple[str, int, int]] = []
        nxt = 0
        self.take("{")
        while self.peek() != "}":
            label = self.take()
            label = unescape(label[1:-1]) if label.startswith('"') else label
            lo = hi = nxt
            if self.peek() == "=":
                self.take()
                lo = hi = self.number()
                if self.peek() == "...":
                    self.take()
                    hi = self.number()
            maps.append((label, lo, hi))
            nxt = hi + 1
            if self.peek() == ",":
                self.take()
        self.take("}")
        e = copy.copy(container)
        e.mappings = maps
        if name:
            self.named[("enum", name)] = e
        return e

    def variant(self) -> Variant:
        name = self.take() if self.kind() == "id" else None
        tag = None
        if self.peek() == "<":
            self.take()
            tag = self.ref(self.dotted())
            self.take(">")
        if self.peek() != "{":
            base = self.named.get(("variant", name or ""))
            if base is None:
                raise TsdlError(f"unknown variant {name!r} in the metadata")
            return Variant(tag or base.selector, base.options, base.align)
        self.take("{")
        opts: list[tuple[str, Any, Any]] = []
        while self.peek() != "}":
            opts.extend((n, t, None) for n, t in self.field_decls())
        self.take("}")
        v = Variant(tag or Ref(None, ()), opts)
        if name:
            self.named[("variant", name)] = v
        return v

    # -- blocks -------------------------------------------------------------------------------
    def block_trace(self, d: dict[str, Any]) -> None:
        self.byte_order = d.get("byte_order", "le")
        self.trace.uuid = d.get("uuid")
        self.trace.packet_header = d.get("packet.header")

    def block_env(self, d: dict[str, Any]) -> None:
        self.trace.env.update(d)

    def block_clock(self, d: dict[str, Any]) -> None:
        name = str(d.get("name", ""))
        self.trace.clocks[name] = Clock(
            name, int(d.get("freq", 1_000_000_000)), int(d.get("offset_s", 0)), int(d.get("offset", 0)), d
        )

    def block_callsite(self, d: dict[str, Any]) -> None:
        pass

    def block_stream(self, d: dict[str, Any]) -> None:
        sc = StreamClass(int(d.get("id", 0)), d.get("packet.context"), d.get("event.header"), d.get("event.context"))
        if sc.id in self.trace.streams:
            raise TsdlError(f"stream class {sc.id} declared twice in the metadata")
        self.trace.streams[sc.id] = sc

    def block_event(self, d: dict[str, Any]) -> None:
        ev = EventClass(int(d.get("id", -1)), str(d.get("name", "")), int(d.get("stream_id", -1)))
        ev.context, ev.payload = d.get("context"), d.get("fields")
        self.events.append(ev)

    def finish(self) -> TraceClass:
        t = self.trace
        little = self.order(self.byte_order)
        t.little = True if little is None else little
        roots: list[Any] = [t.packet_header, *(e for e in self.events for e in (e.context, e.payload))]
        for sc in t.streams.values():
            roots += [sc.packet_context, sc.event_header, sc.event_context]
        for r in roots:
            _set_native(r, t.little, set())
        if not t.streams:
            t.streams[0] = StreamClass(0)
        t.packet_header = _with_roles(t.packet_header, {"magic", "stream_id", "stream_instance_id"}, deep=True)
        for sc in t.streams.values():
            sc.packet_context = _with_roles(sc.packet_context, _PACKET_ROLES, deep=False)
            sc.event_header = _with_roles(sc.event_header, {"id", "timestamp"}, deep=True)
            _map_clocks(t, sc)
        for ev in self.events:
            sid = ev.stream_id if ev.stream_id >= 0 else (min(t.streams) if len(t.streams) == 1 else 0)
            sc = t.streams.get(sid)
            if sc is None:
                raise TsdlError(f"event {ev.name!r} names stream class {sid}, which the metadata lacks")
            ev.stream_id = sid
            if ev.id < 0:
                ev.id = 0 if not sc.events else max(sc.events) + 1
            if ev.id in sc.events:
                raise TsdlError(f"event id {ev.id} declared twice in stream class {sid}")
            sc.events[ev.id] = ev
        return t


_PACKET_ROLES = {
    "timestamp_begin",
    "timestamp_end",
    "content_size",
    "packet_size",
    "events_discarded",
    "packet_seq_num",
}


def _set_native(fc: Any, little: bool, seen: set[int]) -> None:
    """Give integers and floats without a byte_order the trace's."""
    if fc is None or id(fc) in seen:
        return
    seen.add(id(fc))
    if isinstance(fc, Int | Float):
        if fc.little is None:
            fc.little = little
    elif isinstance(fc, Struct):
        for _, f in fc.fields:
            _set_native(f, little, seen)
    elif isinstance(fc, Variant):
        for _, f, _ in fc.options:
            _set_native(f, little, seen)
    elif isinstance(fc, Array):
        _set_native(fc.element, little, seen)


def _with_roles(fc: Struct | None, names: set[str], deep: bool) -> Struct | None:
    """A copy of a scope's struct with the meaning of its named integers set (as babeltrace2 does)."""
    if fc is None:
        return None
    fc = copy.deepcopy(fc)

    def walk(f: Any, top: bool) -> None:
        # members share alias objects: each integer given a meaning gets its own copy
        if isinstance(f, Struct) and (top or deep):
            for i, (n, sub) in enumerate(f.fields):
                if isinstance(sub, Int) and n in names:
                    sub = copy.copy(sub)
                    sub.role = n
                    f.fields[i] = (n, sub)
                walk(sub, False)
        elif isinstance(f, Variant) and deep:
            for i, (n, sub, r) in enumerate(f.options):
                if isinstance(sub, Int) and n in names:
                    sub = copy.copy(sub)
                    sub.role = n
                    f.options[i] = (n, sub, r)
                walk(sub, False)

    walk(fc, True)
    return fc


def _map_clocks(t: TraceClass, sc: StreamClass) -> None:
    """The stream's clock: the one its timestamps map to; an unmapped timestamp gets the only clock."""

    def walk(f: Any, visit: Any) -> None:
        if isinstance(f, Int):
            visit(f)
        elif isinstance(f, Struct):
            for _, sub in f.fields:
                walk(sub, visit)
        elif isinstance(f, Variant):
            for _, sub, _ in f.options:
                walk(sub, visit)

    def auto(f: Int) -> None:
        if f.clock is None and f.role in ("timestamp", "timestamp_begin", "timestamp_end"):
            if not t.clocks:  # babeltrace2 makes an implicit 1 GHz clock
                t.clocks["default"] = Clock("default")
            if len(t.clocks) == 1:
                f.clock = next(iter(t.clocks))
        if f.role == "timestamp_end":
            f.clock = None  # babeltrace2 does not move the clock to a packet's end time
        if f.clock is not None:
            if f.clock not in t.clocks:
                raise TsdlError(f"integer mapped to unknown clock {f.clock!r}")
            sc.clock = sc.clock or f.clock

    walk(sc.packet_context, auto)
    walk(sc.event_header, auto)


def parse_tsdl(data: bytes) -> TraceClass:
    """A TraceClass from the bytes of a CTF 1.8 `metadata` file (TsdlError when it is not)."""
    text = depacketize(data).decode("utf-8", "replace")
    p = _Parser(text)
    # the C types every TSDL parser knows without a typealias
    p.aliases["int"] = Int(32, 8, True)
    return p.parse()
